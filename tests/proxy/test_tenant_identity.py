"""A request's tenant (``proxy.tenants``): hostile header values never become a tenant or a label."""

from __future__ import annotations

import hashlib

import pytest

from pdscope.config.tenants import TenantSettings
from proxy.tenants import Identify, Identity

KEY = b"sk-team-a-secret"


def _identify(**kw: object) -> Identify:
    doc = {
        "enabled": True,
        "tenants": {"team-a": {"api_key_sha256": [hashlib.sha256(KEY).hexdigest()]}, "b.c@d_e": {}},
        **kw,
    }
    return Identify(TenantSettings.model_validate(doc))


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        (None, Identity("default")),
        (b"", Identity("default")),
        (b"team-a", Identity("team-a")),
        (b"b.c@d_e", Identity("b.c@d_e")),
        (b"default", Identity("default")),
        (b"team-z", Identity("default", "unknown")),
        (b"x" * 64, Identity("default", "too_long")),
        (b"x" * 100_000, Identity("default", "too_long")),
        (b"team-a\n", Identity("default", "malformed")),  # '$' alone would let it by
        (b"team\x00a", Identity("default", "malformed")),
        (b"team a", Identity("default", "malformed")),
        (b"-team", Identity("default", "malformed")),
        ("t\u00e9am".encode(), Identity("default", "malformed")),
        (b"team-a,b.c@d_e", Identity("default", "malformed")),
    ],
)
def test_a_header_names_a_declared_tenant_or_its_problem(raw: bytes | None, want: Identity) -> None:
    ident = _identify()
    assert ident.header == b"x-pdscope-tenant"
    assert ident(raw) == want


def test_the_configured_header_is_read() -> None:
    assert _identify(header="X-Team").header == b"x-team"


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        (None, Identity("default")),
        (b"Bearer " + KEY, Identity("team-a")),
        (b"bearer  " + KEY, Identity("team-a")),
        (b"Bearer sk-other", Identity("default", "unknown_key")),
        (b"Basic " + KEY, Identity("default", "malformed")),
        (b"Bearer ", Identity("default", "malformed")),
        (b"Bearer " + b"k" * 10_000, Identity("default", "too_long")),
    ],
)
def test_an_api_key_names_its_tenant_by_its_digest(raw: bytes | None, want: Identity) -> None:
    ident = _identify(source="api_key")
    assert ident.header == b"authorization"
    assert ident(raw) == want


def test_the_refusal_names_the_problem_not_the_value() -> None:
    ident = _identify(unknown="refuse")
    assert ident.refuse
    text = ident.message("malformed")
    assert "x-pdscope-tenant" in text and "not a tenant id" in text
