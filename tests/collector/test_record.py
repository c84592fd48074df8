"""The request record's type: one owner per column, and SLO verdicts recomputed under a changed SLO."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from collector.assemble import assemble
from collector.record import (
    ASSEMBLED_COLUMNS,
    FORENSICS_COLUMNS,
    RECORD_COLUMNS,
    OwnershipError,
    check_owners,
    flag_lease_expiry,
    note_forensics,
)
from collector.sink import StoreSink
from pdscope import semconv as sc
from pdscope.config import LatencySLO, SLOSettings
from pdscope.slo import SLOVerdict, slo_verdict
from store.db import make_engine, session_factory
from store.migrate import upgrade
from store.models import RequestRecord
from store.queries import slo_met_clause, slo_summary
from tests.collector.traces import request_spans

T0 = 1_800_000_000.0
SLO = SLOSettings(ttft=LatencySLO(target_ms=600), tpot=LatencySLO(target_ms=150))


def _sink(url: str) -> StoreSink:
    upgrade(url)
    return StoreSink(session_factory(make_engine(url)), SLO, clock=lambda: T0 + 10)


def test_every_record_column_has_exactly_one_owner() -> None:
    check_owners(RECORD_COLUMNS)
    assert set(ASSEMBLED_COLUMNS) | FORENSICS_COLUMNS == RECORD_COLUMNS
    with pytest.raises(OwnershipError, match="unowned"):
        check_owners(RECORD_COLUMNS | {"a_new_column"})
    with pytest.raises(OwnershipError, match="not in the table"):
        check_owners(RECORD_COLUMNS - {"lease_expiry_suspect"})
    with pytest.raises(KeyError, match="not a forensics key"):
        note_forensics(RequestRecord(attributes={}), "spans", 3)  # type: ignore[arg-type]


def test_reassembly_keeps_what_forensics_wrote(store_url: str) -> None:
    sink = _sink(store_url)
    spans = request_spans(t0=T0, request_id="kept")
    sink.write([s for s in spans if s.name != sc.VLLM_SPAN])
    with sink.factory.begin() as s:  # the forensics pass's part
        rec = s.scalars(select(RequestRecord)).one()
        assert rec.lease_expiry_suspect is False and "d_vllm_request_id" not in rec.attributes
        note_forensics(rec, "nixl", {"d": {"instance": "d0"}})
        flag_lease_expiry(rec, {"p_instance": "p0", "to_ts": T0 + 5})
    sink.write([s for s in spans if s.name == sc.VLLM_SPAN])  # the record is re-assembled and updated
    with sink.factory() as s:
        rec = s.scalars(select(RequestRecord)).one()
    assert rec.d_queue_s == 0.25 and rec.attributes["d_vllm_request_id"] == "cmpl-kept-0"
    assert rec.lease_expiry_suspect is True
    assert rec.attributes["nixl"] == {"d": {"instance": "d0"}}
    assert rec.attributes["lease_expiry"] == [{"p_instance": "p0", "to_ts": T0 + 5}]


def test_a_stored_verdict_is_recomputed_under_a_changed_slo(store_url: str) -> None:
    sink = _sink(store_url)
    spans = request_spans(t0=T0, request_id="slo")  # TTFT 0.51 s, TPOT 0.101 s
    sink.write(spans)
    with sink.factory() as s:
        row = s.scalars(select(RequestRecord)).one()

    def recompute_verdict(r: RequestRecord, slo: SLOSettings) -> SLOVerdict:
        return slo_verdict(r.status, r.ttft_s, r.tpot_s, slo)

    stored = SLOVerdict(row.slo_ttft_met, row.slo_tpot_met, bool(row.slo_met))
    assert stored == SLOVerdict(True, True, True) == recompute_verdict(row, SLO)
    tight_ttft = SLOSettings(ttft=LatencySLO(target_ms=500), tpot=LatencySLO(target_ms=150))
    tight_tpot = SLOSettings(ttft=LatencySLO(target_ms=600), tpot=LatencySLO(target_ms=100))
    assert recompute_verdict(row, tight_ttft) == SLOVerdict(False, True, False)
    assert recompute_verdict(row, tight_tpot) == SLOVerdict(True, False, False)
    for slo in (tight_ttft, tight_tpot):  # what assembly under that SLO would have stored
        a = assemble(spans, slo)
        assert a is not None
        assert recompute_verdict(row, slo) == SLOVerdict(a.slo_ttft_met, a.slo_tpot_met, a.slo_met)
    # the readers: the controller's SLO summary and the dashboard's SQL count follow the SLO they are given
    with sink.factory() as s:
        for slo, met in ((SLO, 1), (tight_ttft, 0), (tight_tpot, 0)):
            summary = slo_summary(s, T0 - 60, T0 + 60, slo=slo)["all"]
            assert summary.completed == 1 and summary.slo_met == met
            counted = s.scalar(select(func.count()).select_from(RequestRecord).where(slo_met_clause(slo)))
            assert counted == met
        assert slo_summary(s, T0 - 60, T0 + 60)["all"].slo_met == 1  # without one: the stored verdict


def test_slo_verdict_without_timings() -> None:
    assert slo_verdict("ok", 0.1, None, SLO) == SLOVerdict(True, True, True)  # one token: no TPOT to miss
    assert slo_verdict("ok", None, None, SLO) == SLOVerdict(None, None, False)  # never got a first token
    assert slo_verdict("error", 0.1, 0.01, SLO) == SLOVerdict(True, True, False)
