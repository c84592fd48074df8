"""A record's tenant: the proxy root span's ``pdscope.tenant``, hostile input until checked. A well-formed
id (and with tenants on, a declared one) is kept; anything else is left out, named in the record's
dropped notes and counted once by the sink, and the rest of the record is as it would be without it."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from collector.assemble import assemble
from collector.sink import StoreSink
from collector.tenant import tenant_of
from pdscope import semconv as sc
from pdscope.config import LatencySLO, SLOSettings, Tenant, TenantSettings
from store.db import make_engine, session_factory
from store.migrate import upgrade
from store.models import RequestRecord
from tests.collector.traces import request_spans

T0 = 1_800_000_000.0
SLO = SLOSettings(ttft=LatencySLO(target_ms=600), tpot=LatencySLO(target_ms=150))
ON = TenantSettings(enabled=True, tenants={"team-a": Tenant(weight=2.0), "batch@etl": Tenant()})


@pytest.mark.parametrize(
    ("value", "settings", "stored"),
    [
        ("team-a", ON, "team-a"),
        ("batch@etl", ON, "batch@etl"),
        ("default", ON, "default"),  # added to every config
        ("team-b", ON, None),  # well-formed, not declared: never a new label
        ("team-b", None, "team-b"),  # no settings: any well-formed id
        ("team-b", TenantSettings(), "team-b"),  # tenants off: the proxy names none but default
        ("a" * 63, None, "a" * 63),
        ("a" * 64, None, None),  # too long
        ("x" * 1_000_000, ON, None),  # huge
        ("team-a\n", ON, None),  # a trailing newline is not part of an id
        ("team\x00a", None, None),
        ("team a", None, None),
        ("-team", None, None),
        ("", ON, None),
        ("tëam", None, None),
        (7, None, None),
        (["team-a"], ON, None),
        (True, None, None),
    ],
)
def test_the_tenant_attribute_is_checked(
    value: Any, settings: TenantSettings | None, stored: str | None
) -> None:
    spans = request_spans(t0=T0, request_id="r", root_attributes={sc.TENANT: value})
    rec = assemble(spans, SLO, settings)
    assert rec is not None
    assert rec.tenant == stored
    assert rec.attributes.dropped == (() if stored is not None else (sc.TENANT,))
    plain = assemble(request_spans(t0=T0, request_id="r"), SLO, settings)
    assert plain is not None and plain.tenant is None and plain.attributes.dropped == ()
    # the tenant costs only itself
    assert (rec.status, rec.ttft_s, rec.slo_met) == (plain.status, plain.ttft_s, plain.slo_met)


def test_no_attribute_is_no_tenant_and_nothing_dropped() -> None:
    assert tenant_of({}, ON) == (None, ())


def test_the_sink_stores_the_tenant_and_counts_a_refused_one_once(store_url: str) -> None:
    upgrade(store_url)
    sink = StoreSink(session_factory(make_engine(store_url)), SLO, clock=lambda: T0 + 10, tenants=ON)
    good = request_spans(t0=T0, request_id="good", root_attributes={sc.TENANT: "team-a"})
    bad = request_spans(t0=T0 + 1, request_id="bad", root_attributes={sc.TENANT: "intruder"})
    root = [s for s in bad if s.name == sc.SPAN_REQUEST]
    result = sink.write(good + root)
    assert result.records == 2 and result.attributes_dropped == ((sc.TENANT, 1),)
    again = sink.write([s for s in bad if s.name != sc.SPAN_REQUEST])  # re-assembled, not recounted
    assert again.attributes_dropped == ()
    with sink.factory() as s:
        recs = {r.request_id: r for r in s.scalars(select(RequestRecord))}
    assert recs["good"].tenant == "team-a"
    assert recs["bad"].tenant is None and recs["bad"].attributes["dropped_attributes"] == [sc.TENANT]
