"""Who may change routing from the dashboard (issue 13, item 6).

``dashboard.auth``: login (the user's own token, checked with GET /v1/whoami, used for
every change), header (identity from a trusted auth proxy's header, the server's token
plus X-Actor), none (read-only). No free-text actor; a non-loopback bind needs login or
header. AppTest cannot seed request headers, so header mode patches
``dashboard.auth.request_headers`` (the one place the dashboard reads them).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dashboard import auth
from dashboard.cli import check_listen
from pdscope.config import ConfigError, is_loopback, parse_config
from tests.support.controllers import FakeController

from .conftest import TOKEN, USER_TOKEN, make_seeded
from .test_pages import FORM_BUTTONS, open_page, sign_in, texts, with_dashboard

REPO = Path(__file__).resolve().parents[2]


def _form_buttons(at):  # type: ignore[no-untyped-def]
    return [b for b in at.button if b.label in FORM_BUTTONS]


def _set_override(at, instance: str = "decode-1", reason: str = "NIC flapping"):  # type: ignore[no-untyped-def]
    at.selectbox(key="w_instance").select(instance)
    at.text_input(key="w_reason").input(reason)
    next(b for b in at.button if b.label == "Set override").click().run()
    assert not at.exception, [e.message for e in at.exception]
    return at


# -- login mode (the default) ------------------------------------------------------------


def test_login_is_the_default_and_a_wrong_token_changes_nothing(
    tmp_path: Path, fake_controller: FakeController, monkeypatch: pytest.MonkeyPatch
) -> None:
    seeded = make_seeded(tmp_path, controller_port=fake_controller.port, duration_s=600.0)
    assert parse_config(seeded.config.read_text()).dashboard.auth == "login"
    at = open_page(seeded.config, "controller", monkeypatch, token=TOKEN)
    assert all(b.disabled for b in _form_buttons(at))
    sign_in(at, "not-a-token")
    assert "The controller refused this token." in texts(at)
    assert all(b.disabled for b in _form_buttons(at))
    assert fake_controller.mutations() == []
    # and the server's own token in the environment does not sign anyone in
    sign_in(at, "")
    assert "Paste your controller API token." in texts(at)
    assert fake_controller.mutations() == []


def test_login_uses_the_identitys_token_and_sign_out_ends_it(
    tmp_path: Path, fake_controller: FakeController, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_controller.identities["dave-token"] = "dave"
    seeded = make_seeded(tmp_path, controller_port=fake_controller.port, duration_s=600.0)
    at = sign_in(open_page(seeded.config, "controller", monkeypatch, token=TOKEN), "dave-token")
    assert "audited as **dave**" in texts(at)
    assert not any(b.disabled for b in _form_buttons(at))
    _set_override(at)
    (call,) = fake_controller.mutations()
    assert call.headers["authorization"] == "Bearer dave-token" and "x-actor" not in call.headers
    next(b for b in at.sidebar.button if b.label == "Sign out").click().run()
    assert all(b.disabled for b in _form_buttons(at))
    assert "Sign in (sidebar)" in texts(at)


def test_login_with_the_controller_down_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seeded = make_seeded(tmp_path, controller_port=1, duration_s=600.0)  # nothing listens on port 1
    at = sign_in(open_page(seeded.config, "controller", monkeypatch), USER_TOKEN)
    assert "Cannot check the token" in texts(at)
    assert all(b.disabled for b in _form_buttons(at))


def test_login_mode_ignores_an_identity_header(
    tmp_path: Path, fake_controller: FakeController, monkeypatch: pytest.MonkeyPatch
) -> None:
    seeded = make_seeded(tmp_path, controller_port=fake_controller.port, duration_s=600.0)
    with_dashboard(seeded.config, auth="login", identity_header="X-Forwarded-User")
    monkeypatch.setattr(auth, "request_headers", lambda: {"X-Forwarded-User": "mallory"})
    at = open_page(seeded.config, "controller", monkeypatch, token=TOKEN)
    assert "mallory" not in texts(at)
    assert all(b.disabled for b in _form_buttons(at))


# -- header mode ---------------------------------------------------------------------------


def test_header_mode_acts_on_behalf_of_the_proxys_user(
    tmp_path: Path, fake_controller: FakeController, monkeypatch: pytest.MonkeyPatch
) -> None:
    seeded = make_seeded(tmp_path, controller_port=fake_controller.port, duration_s=600.0)
    with_dashboard(seeded.config, auth="header", identity_header="X-Forwarded-User")
    monkeypatch.setattr(auth, "request_headers", lambda: {"x-forwarded-user": "erin\x07@corp"})
    at = open_page(seeded.config, "controller", monkeypatch, token=TOKEN)
    assert "Signed in as **erin@corp**" in texts(at)  # control characters dropped
    assert not [w for w in at.sidebar.text_input if w.key == "login_token"]  # no login box
    _set_override(at)
    (call,) = fake_controller.mutations()
    assert call.headers["authorization"] == f"Bearer {TOKEN}"
    assert call.headers["x-actor"] == "erin@corp"


def test_header_mode_without_the_header_is_read_only(
    tmp_path: Path, fake_controller: FakeController, monkeypatch: pytest.MonkeyPatch
) -> None:
    seeded = make_seeded(tmp_path, controller_port=fake_controller.port, duration_s=600.0)
    with_dashboard(seeded.config, auth="header", identity_header="X-Forwarded-User")
    monkeypatch.setattr(auth, "request_headers", lambda: {"X-Forwarded-User": "  "})
    at = open_page(seeded.config, "controller", monkeypatch, token=TOKEN)
    assert "carries no `X-Forwarded-User` header" in texts(at)
    assert all(b.disabled for b in _form_buttons(at))
    assert fake_controller.mutations() == []


def test_header_mode_without_the_server_token_is_read_only(
    tmp_path: Path, fake_controller: FakeController, monkeypatch: pytest.MonkeyPatch
) -> None:
    seeded = make_seeded(tmp_path, controller_port=fake_controller.port, duration_s=600.0)
    with_dashboard(seeded.config, auth="header", identity_header="X-Forwarded-User")
    monkeypatch.setattr(auth, "request_headers", lambda: {"X-Forwarded-User": "erin"})
    at = open_page(seeded.config, "controller", monkeypatch, token=None)
    assert "PDSCOPE_API_TOKEN" in texts(at)
    assert all(b.disabled for b in _form_buttons(at))


# -- none mode ------------------------------------------------------------------------------


def test_none_mode_is_read_only(
    tmp_path: Path, fake_controller: FakeController, monkeypatch: pytest.MonkeyPatch
) -> None:
    seeded = make_seeded(tmp_path, controller_port=fake_controller.port, duration_s=600.0)
    with_dashboard(seeded.config, auth="none")
    at = open_page(seeded.config, "controller", monkeypatch, token=TOKEN)
    assert "read-only (`dashboard.auth: none`)" in texts(at)
    assert not [w for w in at.sidebar.text_input if w.key == "login_token"]
    buttons = _form_buttons(at)
    assert len(buttons) == len(FORM_BUTTONS) and all(b.disabled for b in buttons)


# -- identities, config and the bind refusal -------------------------------------------------


def test_clean_identity() -> None:
    assert auth.clean_identity(None) is None
    assert auth.clean_identity(" \t ") is None
    assert auth.clean_identity("Jose\u0301") == "Jos\u00e9"  # NFC
    assert auth.clean_identity("a\r\nX-Evil: 1") == "aX-Evil: 1"
    assert len(auth.clean_identity("é" * 100) or "") == auth.MAX_IDENTITY_CHARS
    for blank in ("\u3164", "\u2800", "\u200b\u202e", "\u0301\u0301"):  # nothing visible: read-only
        assert auth.clean_identity(blank) is None, repr(blank)


MINIMAL = """model: {name: tiny, kv_bytes_per_token: 1024}
pools:
  p: {role: prefill, instances: [{name: p0, url: "http://127.0.0.1:8100"}]}
  d: {role: decode, instances: [{name: d0, url: "http://127.0.0.1:8200"}]}
"""


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ("dashboard: {auth: header}\n", "f.yaml:5: dashboard: auth: header needs identity_header"),
        (
            "dashboard: {auth: open}\n",
            "f.yaml:5: dashboard.auth: Input should be 'login', 'header' or 'none'",
        ),
        ("dashboard: {auth: header, identity_header: 'X User'}\n", "f.yaml:5: dashboard.identity_header:"),
    ],
)
def test_dashboard_auth_config_errors(section: str, expected: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(MINIMAL + section, "f.yaml")
    assert any(line.startswith(expected) for line in exc.value.problems), exc.value.problems


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.9.8.7", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("dashboard.example.com", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_non_loopback_bind_needs_login_or_header() -> None:
    refusal = check_listen("0.0.0.0", "none")
    assert refusal is not None and "not loopback" in refusal and "dashboard.auth" in refusal
    assert check_listen("0.0.0.0", "login") is None
    assert check_listen("0.0.0.0", "header") is None
    assert check_listen("127.0.0.1", "none") is None


def test_dashboard_command_refuses_an_open_bind_without_starting(tmp_path: Path) -> None:
    config = tmp_path / "pdscope.yaml"
    config.write_text(MINIMAL + "dashboard: {auth: none}\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdscope.cli",
            "--config",
            str(config),
            "dashboard",
            "--host",
            "0.0.0.0",
            "--port",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 1
    assert "pdscope dashboard: refusing to listen on 0.0.0.0 (not loopback)" in proc.stderr
