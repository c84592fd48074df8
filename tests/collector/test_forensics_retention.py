"""Lease-expiry forensics (counter steps joined to handoffs) and retention with rollups."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from collector import forensics
from collector.forensics import overlaps
from collector.retention import Retention
from store.db import make_engine, session_factory
from store.migrate import upgrade
from store.models import RequestRecord, RequestRollup, Snapshot, SnapshotRollup, SpanRow, TickRecord
from store.queries import CounterStep

NOW = 1_800_000_000.0


@pytest.fixture
def factory(store_url: str) -> sessionmaker[Session]:
    upgrade(store_url)
    return session_factory(make_engine(store_url))


def _snap(instance: str, role: str, ts: float, **values: Any) -> Snapshot:
    s = Snapshot(
        instance=instance,
        pool=role[:3],
        role=role,
        ts=ts,
        up=True,
        histograms=values.pop("histograms", {}),
        extra={},
    )
    for k, v in values.items():
        setattr(s, k, v)
    return s


def _rec(
    rid: str,
    p_done: float,
    first_token: float | None,
    *,
    p: str = "p0",
    d: str = "d0",
    done: float | None = None,
    handoff: str | None = None,
) -> RequestRecord:
    return RequestRecord(
        request_id=rid,
        handoff=handoff,
        p_instance=p,
        d_instance=d,
        status="ok",
        retries=0,
        proxy_in=p_done - 0.2,
        p_done=p_done,
        first_token=first_token,
        done=done if done is not None else (first_token or p_done) + 1,
        ttft_s=None if first_token is None else first_token - p_done + 0.2,
        e2e_s=1.0,
        slo_met=True,
        lease_expiry_suspect=False,
        attributes={},
    )


def test_overlap_rule() -> None:
    step = CounterStep("p0", 100.0, 105.0, 1.0)
    assert overlaps(step, 99.0, 101.0)
    assert overlaps(step, 104.0, 130.0)
    assert overlaps(step, 90.0, None)  # handoff never ended
    assert not overlaps(step, 90.0, 100.0)  # ended at the step's start (exclusive)
    assert not overlaps(step, 105.5, 107.0)


def test_nixl_figures_are_linked_over_the_handoffs_scrape_window(factory: sessionmaker[Session]) -> None:
    t = NOW - 100
    with factory.begin() as s:
        for i, ts in enumerate([t, t + 5, t + 10, t + 15]):
            s.add(
                _snap(
                    "p0",
                    "prefill",
                    ts,
                    nixl_kv_expired_reqs=0.0,
                    nixl_failed_transfers=0.0,
                    nixl_notifications_after_expiry=[0.0, 0.0, 0.0, 1.0][i],
                )
            )
            s.add(
                _snap(
                    "d0",
                    "decode",
                    ts,
                    nixl_xfer_time_count=[0.0, 1.0, 1.0, 3.0][i],
                    nixl_xfer_time_sum=[0.0, 0.01, 0.01, 0.05][i],
                    nixl_bytes_sum=[0.0, 1e6, 1e6, 3e6][i],
                    nixl_failed_transfers=0.0,
                )
            )
        s.add(_rec("hit", t + 4, t + 12))
        s.add(_rec("before", t + 1, t + 3))
    with factory.begin() as s:
        result = forensics.run_pass(s, NOW - 300, NOW)
    assert result.linked == 2 and result.suspects == 0
    with factory() as s:
        recs = {r.request_id: r for r in s.scalars(select(RequestRecord))}
    # the NIXL figures of D over the scrape window covering the handoff [t+4, t+12]: snapshots t .. t+15
    nixl = recs["hit"].attributes["nixl"]
    assert nixl["d"]["from_ts"] == t and nixl["d"]["to_ts"] == t + 15
    assert nixl["d"]["nixl_xfer_time_count"] == 3.0 and nixl["d"]["nixl_bytes_sum"] == 3e6
    assert nixl["p"]["nixl_notifications_after_expiry"] == 1.0
    assert recs["before"].attributes["nixl"]["d"]["nixl_xfer_time_count"] == 1.0
    assert (nixl["transfers_on"], nixl["per_request"]) == ("d", False)  # the window's figures: an estimate
    with factory.begin() as s:
        assert forensics.run_pass(s, NOW - 300, NOW).linked == 0  # idempotent


def test_in_push_mode_the_transfer_figures_are_p_s(factory: sessionmaker[Session]) -> None:
    """P writes and records the transfers in push mode; D records only its failed registrations."""
    t = NOW - 100
    with factory.begin() as s:
        for i, ts in enumerate([t, t + 5, t + 10]):
            s.add(
                _snap(
                    "p0",
                    "prefill",
                    ts,
                    nixl_xfer_time_count=[0.0, 2.0, 4.0][i],
                    nixl_xfer_time_sum=[0.0, 0.02, 0.06][i],
                    nixl_bytes_sum=[0.0, 2e6, 4e6][i],
                    nixl_failed_transfers=0.0,
                    nixl_kv_expired_reqs=0.0,
                    nixl_notifications_after_expiry=0.0,
                )
            )
            s.add(
                _snap("d0", "decode", ts, nixl_xfer_time_count=0.0, nixl_failed_transfers=[0.0, 0.0, 1.0][i])
            )
        s.add(_rec("pushed", t + 4, t + 8, handoff="push_early"))
    with factory.begin() as s:
        assert forensics.run_pass(s, NOW - 300, NOW).linked == 1
    with factory() as s:
        nixl = s.scalars(select(RequestRecord)).one().attributes["nixl"]
    assert nixl["transfers_on"] == "p" and nixl["per_request"] is False
    assert nixl["p"]["nixl_xfer_time_count"] == 4.0 and nixl["p"]["nixl_bytes_sum"] == 4e6
    assert nixl["d"]["nixl_failed_transfers"] == 1.0 and "nixl_xfer_time_count" not in nixl["d"]


def test_a_re_assembly_committed_during_a_pass_is_kept(
    factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sink re-assembles a record (D's vLLM span arrived) after forensics read it and before it
    writes: both parts are in the row after, and a second conflicting pass changes nothing."""
    t = NOW - 100
    with factory.begin() as s:
        for i, ts in enumerate([t, t + 15]):
            s.add(_snap("d0", "decode", ts, nixl_xfer_time_count=[0.0, 1.0][i], nixl_failed_transfers=0.0))
        rec = _rec("late", t + 4, t + 12)
        rec.attributes = {"spans": 4, "p_vllm_request_id": "cmpl-p"}
        s.add(rec)
    real_series = forensics._series

    def sink_writes_between(session: Session, *args: Any) -> Any:
        with factory.begin() as other:  # a commit of its own, as the sink's
            row = other.scalars(select(RequestRecord)).one()
            row.attributes = {**row.attributes, "spans": 6, "d_vllm_request_id": "cmpl-d"}
            row.d_queue_s = 0.01
        return real_series(session, *args)

    monkeypatch.setattr(forensics, "_series", sink_writes_between)
    with factory.begin() as s:
        assert forensics.run_pass(s, NOW - 300, NOW).linked == 1
    with factory() as s:
        row = s.scalars(select(RequestRecord)).one()
    assert row.attributes["d_vllm_request_id"] == "cmpl-d" and row.attributes["spans"] == 6
    assert row.attributes["p_vllm_request_id"] == "cmpl-p" and row.d_queue_s == 0.01
    assert row.attributes["nixl"]["d"]["nixl_xfer_time_count"] == 1.0
    with factory.begin() as s:  # linked already: nothing of forensics' changes, the sink's write stays
        assert forensics.run_pass(s, NOW - 300, NOW).linked == 0
    with factory() as s:
        assert s.scalars(select(RequestRecord)).one().attributes == row.attributes


def _expiry_world(s: Session, t: float, expired: list[float]) -> None:
    """p0's expired-lease counter over scrapes every 5 s from t; p1's stays 0."""
    for i, v in enumerate(expired):
        s.add(_snap("p0", "prefill", t + 5 * i, nixl_kv_expired_reqs=v))
        s.add(_snap("p1", "prefill", t + 5 * i, nixl_kv_expired_reqs=0.0))


def test_an_expired_lease_is_charged_to_the_waiting_handoff_not_to_what_finished_in_the_window(
    factory: sessionmaker[Session],
) -> None:
    """Finding 2: one D stops pulling; P's lease for the request sent there expires a lease (30 s) later,
    in a scrape step in which healthy handoffs to other Ds finish. Only the waiting one is charged."""
    t = NOW - 200
    with factory.begin() as s:
        _expiry_world(s, t, [0.0] * 7 + [1.0] * 4)  # one expiry counted in (t+30, t+35]
        s.add(_rec("stuck", t + 3, None, d="d-stuck", done=t + 8))  # the proxy timed out; P's lease ran on
        for k in range(6):  # healthy handoffs from the same P finishing inside the expiry step and around it
            s.add(_rec(f"in-step-{k}", t + 30 + k * 0.8, t + 30.2 + k * 0.8, d=f"d{k % 3}"))
            s.add(_rec(f"early-{k}", t + 2 + k, t + 2.1 + k, d=f"d{k % 3}"))
        s.add(_rec("other-p", t + 3, None, p="p1", d="d-other", done=t + 8))  # waiting, but on another P
    with factory.begin() as s:
        result = forensics.run_pass(s, NOW - 300, NOW, lease_s=30.0)
    assert result.suspects == 1 and result.unattributed == 0
    with factory() as s:
        recs = {r.request_id: r for r in s.scalars(select(RequestRecord))}
    assert [n for n, r in recs.items() if r.lease_expiry_suspect] == ["stuck"]
    entry = recs["stuck"].attributes["lease_expiry"][0]
    assert entry["d_instance"] == "d-stuck" and entry["p_instance"] == "p0" and entry["to_ts"] == t + 35
    with factory.begin() as s:  # idempotent: the step's expiry is assigned already
        again = forensics.run_pass(s, NOW - 300, NOW, lease_s=30.0)
    assert again.suspects == 1 and again.unattributed == 0
    with factory() as s:
        assert (
            len(
                s.scalars(select(RequestRecord).where(RequestRecord.request_id == "stuck"))
                .one()
                .attributes["lease_expiry"]
            )
            == 1
        )


def test_a_first_token_after_the_lease_counts_as_waiting(factory: sessionmaker[Session]) -> None:
    t = NOW - 200
    with factory.begin() as s:
        _expiry_world(s, t, [0.0] * 7 + [1.0] * 4)
        s.add(_rec("late", t + 3, t + 40, d="d-slow"))  # first token 37 s after P done: past the lease
        s.add(_rec("in-time", t + 3, t + 19, d="d0"))  # 16 s: within two thirds of the lease
    with factory.begin() as s:
        forensics.run_pass(s, NOW - 300, NOW, lease_s=30.0)
    with factory() as s:
        recs = {r.request_id: r for r in s.scalars(select(RequestRecord))}
    assert recs["late"].lease_expiry_suspect and not recs["in-time"].lease_expiry_suspect


def test_expiries_no_waiting_handoff_explains_stay_unattributed(factory: sessionmaker[Session]) -> None:
    t = NOW - 200
    with factory.begin() as s:
        _expiry_world(s, t, [0.0] * 7 + [3.0] * 4)  # three expiries, one candidate
        s.add(_rec("stuck", t + 3, None, d="d-stuck", done=t + 8))
        s.add(_rec("healthy", t + 31, t + 31.1, d="d0"))
    with factory.begin() as s:
        result = forensics.run_pass(s, NOW - 300, NOW, lease_s=30.0)
    assert result.suspects == 1 and result.unattributed == 2


def _span(trace: str, sid: str, name: str, start: float, end: float, **attrs: Any) -> SpanRow:
    return SpanRow(
        trace_id=trace, span_id=sid, name=name, start_ts=start, end_ts=end, attributes=attrs, received_ts=end
    )


def test_a_retried_attempt_is_read_back_from_the_spans_and_its_d_charged(
    factory: sessionmaker[Session],
) -> None:
    """The proxy timed the first D out and retried with a new prefill on p1 and d0 (the record shows only
    those): p0's lease for the first attempt expires a lease later and is charged to the first D."""
    t = NOW - 200
    tr = "a" * 32
    with factory.begin() as s:
        _expiry_world(s, t, [0.0] * 7 + [1.0] * 4)
        rec = _rec("retried", t + 9, t + 9.5, p="p1", d="d0")
        rec.retries, rec.trace_id = 1, tr
        s.add(rec)
        s.add_all(
            [
                _span(
                    tr,
                    "1" * 16,
                    "pdscope.prefill",
                    t + 2.5,
                    t + 3,
                    **{"pdscope.instance": "p0", "pdscope.attempt": 0},
                ),
                _span(
                    tr,
                    "2" * 16,
                    "pdscope.decode",
                    t + 3,
                    t + 7,
                    **{"pdscope.instance": "d-stuck", "pdscope.attempt": 0, "error.type": "timeout"},
                ),
                _span(
                    tr,
                    "3" * 16,
                    "pdscope.prefill",
                    t + 7,
                    t + 9,
                    **{"pdscope.instance": "p1", "pdscope.attempt": 0},
                ),
                _span(
                    tr,
                    "4" * 16,
                    "pdscope.decode",
                    t + 9,
                    t + 10,
                    **{"pdscope.instance": "d0", "pdscope.attempt": 0},
                ),
            ]
        )
    with factory.begin() as s:
        result = forensics.run_pass(s, NOW - 300, NOW, lease_s=30.0)
    assert result.attempts == 1 and result.suspects == 1
    with factory() as s:
        r = s.scalars(select(RequestRecord)).one()
    assert r.attributes["failed_attempts"] == [
        {
            "stage": "decode",
            "instance": "d-stuck",
            "kind": "timeout",
            "start": t + 3,
            "end": t + 7,
            "p_instance": "p0",
            "p_done": t + 3,
        }
    ]
    assert r.attributes["lease_expiry"][0]["d_instance"] == "d-stuck"


def test_retention_rolls_up_then_deletes_and_stays_bounded(factory: sessionmaker[Session]) -> None:
    raw_s, rollup_s = 600.0, 3600.0
    start = (NOW // 60) * 60 - 1200  # 20 minutes of history

    def hist(n: int) -> dict[str, object]:
        return {"vllm:nixl_xfer_time_seconds": {"le": [0.1], "counts": [n, n], "sum": n / 100, "count": n}}

    with factory.begin() as s:
        for k in range(0, 240):  # a scrape every 5 s for 20 minutes
            ts = start + 5 * k
            count = float(k if k < 120 else k - 120)  # restart at minute 10
            s.add(
                _snap(
                    "d0",
                    "decode",
                    ts,
                    nixl_xfer_time_count=count,
                    generation_tokens=count * 10,
                    kv_cache_usage=0.5,
                    histograms=hist(count),
                )
            )
            s.add(
                SpanRow(
                    trace_id="t" * 32,
                    span_id=f"{k:016x}",
                    name="x",
                    start_ts=ts,
                    end_ts=ts,
                    attributes={},
                    received_ts=ts,
                )
            )
        for k in range(20):
            s.add(_rec(f"r{k}", start + 60 * k + 1, start + 60 * k + 2))
            s.add(
                TickRecord(
                    ts=start + 60 * k,
                    tick=k,
                    leader_epoch=1,
                    policy="v1:x",
                    policy_version=1,
                    format=1,
                    codec="json+zlib",
                    payload=b"",
                )
            )
    retention = Retention(factory, raw_s=raw_s, rollup_s=rollup_s, lag_s=60.0)
    result = retention.run(NOW)
    assert result.minutes_rolled >= 18
    with factory() as s:
        rollups = {r.minute: r for r in s.scalars(select(SnapshotRollup))}
        req_rollups = list(s.scalars(select(RequestRollup)))
        oldest_snap = s.scalar(select(func.min(Snapshot.ts)))
        spans = s.scalar(select(func.count()).select_from(SpanRow))
        recs = s.scalar(select(func.count()).select_from(RequestRecord))
        oldest_tick = s.scalar(select(func.min(TickRecord.ts)))
        ticks = s.scalar(select(func.count()).select_from(TickRecord))
    assert oldest_tick is not None and oldest_tick >= NOW - raw_s and ticks == 10, (
        "tick records: the raw window"
    )
    first = rollups[start]
    assert first.scrapes == 12
    assert first.increases["nixl_xfer_time_count"] == 11.0  # no baseline before the first minute
    second = rollups[start + 60]
    assert second.increases["nixl_xfer_time_count"] == 12.0  # baseline: the last snapshot of minute 1
    assert second.increases["generation_tokens"] == 120.0
    assert second.histograms["vllm:nixl_xfer_time_seconds"]["count"] == 12.0
    assert second.gauges["kv_cache_usage"] == {"avg": 0.5, "max": 0.5}
    restart = rollups[start + 600]
    assert restart.increases["nixl_xfer_time_count"] == 11.0  # 0 after 119 is a reset: counts from 0
    assert sum(r.requests for r in req_rollups) >= 18
    assert oldest_snap is not None and oldest_snap >= NOW - raw_s
    assert spans is not None and spans < 240 and recs is not None and recs < 20
    # a second run rolls nothing twice; rollups older than retention_rollup_s go
    assert retention.run(NOW).minutes_rolled == 0
    later = Retention(factory, raw_s=raw_s, rollup_s=60.0, lag_s=60.0).run(NOW + 3600)
    assert later.rollups_deleted > 0
