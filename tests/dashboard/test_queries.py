"""Dashboard queries against a seeded store (SQLite always, PostgreSQL in the pg tier)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import func, select, text

from dashboard.context import ReadOnlyViolation, _refuse_writes
from dashboard.queries import common, control, fleet, records
from dashboard.queries import requests as rq
from dashboard.summaries import instance_health, nixl_per_instance
from devdata.seed import SeedSpec, request_id, seed_store
from store.db import make_engine
from store.migrate import upgrade
from store.models import RequestRecord


@pytest.fixture
def small(store_url: str):  # type: ignore[no-untyped-def]
    spec = SeedSpec(end=time.time(), duration_s=600.0, rate_per_s=2.0, degrade_at=0.3)
    summary = seed_store(store_url, spec)
    engine = make_engine(store_url)
    yield engine, spec, summary
    engine.dispose()


def test_presence_and_latest_on_an_empty_and_a_missing_schema(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    engine = make_engine(url)
    assert common.presence(engine) == common.Presence(False, False, False, False)
    upgrade(url)
    assert common.presence(engine) == common.Presence(True, False, False, False)
    assert common.latest_ts(engine) is None


def test_slo_buckets_count_every_request_once(small) -> None:  # type: ignore[no-untyped-def]
    engine, spec, summary = small
    window = common.Window(spec.end - spec.duration_s, spec.end + 1)
    buckets = records.slo_buckets(engine, window, 60.0)
    assert buckets["arrivals"].sum() == summary.requests
    assert buckets["completed"].sum() == summary.counts["ok"]
    assert buckets["rejected"].sum() == summary.counts.get("rejected", 0)
    assert (buckets["met"] <= buckets["completed"]).all()
    assert buckets["t"].is_monotonic_increasing and buckets["t"].iloc[0] >= window.start


def test_search_filters_and_orders_newest_first(small) -> None:  # type: ignore[no-untyped-def]
    engine, spec, summary = small
    window = common.Window(spec.end - spec.duration_s, spec.end + 1)
    everything = rq.search(engine, window, rq.RequestFilter(limit=10_000))
    assert len(everything) == summary.requests
    assert everything["proxy_in"].is_monotonic_decreasing
    misses = rq.search(engine, window, rq.RequestFilter(slo_miss=True, limit=10_000))
    assert len(misses) > 0 and (misses["slo_met"] == False).all()  # noqa: E712
    on_d2 = rq.search(engine, window, rq.RequestFilter(instance="decode-2", status="ok", limit=50))
    assert len(on_d2) == 50 and set(on_d2["d_instance"]) == {"decode-2"} and set(on_d2["status"]) == {"ok"}
    one = rq.search(engine, window, rq.RequestFilter(request_id=summary.slow_request_id or ""))
    assert list(one["request_id"]) == [summary.slow_request_id]
    prefix = rq.search(engine, window, rq.RequestFilter(request_id=request_id(3, spec.seed)[:12]))
    assert request_id(3, spec.seed) in set(prefix["request_id"])
    leases = rq.lease_expiry_suspects(engine, window)
    assert len(leases) > 0 and leases["lease_expiry_suspect"].all()


def test_get_request_and_nixl_around(small) -> None:  # type: ignore[no-untyped-def]
    engine, _spec, summary = small
    rec = rq.get_request(engine, summary.slow_request_id)
    assert rec is not None and rec["request_id"] == summary.slow_request_id and rec["d_instance"]
    snaps = rq.nixl_around(engine, rec["d_instance"], rec["d_sent"], rec["done"])
    assert len(snaps) >= 2 and snaps["ts"].is_monotonic_increasing
    assert rq.get_request(engine, "no-such-request") is None


def test_fleet_health_shows_the_degraded_decode(small) -> None:  # type: ignore[no-untyped-def]
    engine, spec, _ = small
    window = common.Window(spec.end - spec.duration_s, spec.end + 1)
    latest = fleet.latest_snapshots(engine, window.end)
    assert sorted(latest["instance"]) == sorted((*spec.prefill, *spec.decode))
    edges = fleet.histogram_edges(engine, window, list(latest["instance"]))
    series = fleet.snapshot_series(engine, window)
    health = instance_health(series, latest, edges, fleet.current_weights(engine, window.end)).set_index(
        "instance"
    )
    assert health.loc["decode-2", "weight"] == pytest.approx(0.25)
    assert health.loc["decode-2", "nixl_xfer_mean_ms"] > 3 * health.loc["decode-0", "nixl_xfer_mean_ms"]
    assert health.loc["decode-0", "ttft_p99_ms"] > health.loc["decode-0", "ttft_p50_ms"] > 0
    nixl = nixl_per_instance(series, edges).set_index("instance")
    assert nixl.loc["decode-2", "xfer_p99_ms"] > nixl.loc["decode-0", "xfer_p99_ms"]
    assert nixl.loc["decode-0", "MB_per_transfer"] > 0
    assert nixl.loc[list(spec.prefill), "expired_leases"].sum() >= 0


def test_controller_reads(small) -> None:  # type: ignore[no-untyped-def]
    engine, spec, _ = small
    window = common.Window(spec.end - spec.duration_s, spec.end + 1)
    decisions = control.decisions(engine, window)
    assert "NixlSlowTransfers" in set(decisions["reason"])
    history = control.weight_history(engine, window)
    d2 = history[history["subject"] == "decode-2"].sort_values("ts")
    assert d2["weight"].iloc[0] == 1.0 and d2["weight"].iloc[-1] == pytest.approx(0.25)
    assert d2["ts"].iloc[-1] == window.end
    assert control.latest_mode(engine) == "enforce"
    assert set(control.firing_alerts(engine)["rule"]) == {"NixlTransferSlow", "TTFTSLOBurn"}
    assert "InstanceDown" in set(control.recent_alerts(engine, window)["rule"])
    assert len(control.audit_trail(engine, window)) == 3
    limits = fleet.pool_limits(engine, window.end).set_index("pool")
    assert limits.loc["decode", "max_inflight_kv_bytes"] == 48 * 2**30
    overrides = fleet.active_overrides(engine, window.end)
    assert list(overrides["subject"]) == ["decode-0"]  # the expired/cleared drain is not in force


def test_pair_handoff_and_sample(small) -> None:  # type: ignore[no-untyped-def]
    engine, spec, summary = small
    window = common.Window(spec.end - spec.duration_s, spec.end + 1)
    pairs = records.pair_handoff(engine, window)
    assert len(pairs) == len(spec.prefill) * len(spec.decode)
    slow = pairs[pairs["d_instance"] == "decode-2"]["mean_ms"].min()
    fast = pairs[pairs["d_instance"] != "decode-2"]["mean_ms"].max()
    assert slow > fast
    full, step = records.sample(engine, window)
    assert step == 1 and len(full) == summary.requests
    part, step = records.sample(engine, window, max_rows=100)
    assert step > 1 and len(part) <= summary.requests / step + 1


def test_the_dashboard_engine_refuses_writes(tmp_path: Path) -> None:
    from sqlalchemy import event

    url = f"sqlite:///{tmp_path / 'ro.db'}"
    upgrade(url)
    engine = make_engine(url)
    event.listen(engine, "before_cursor_execute", _refuse_writes)
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(RequestRecord)).scalar() == 0
        with pytest.raises(ReadOnlyViolation):
            conn.execute(text("DELETE FROM request_records"))


def test_slo_and_handoff_figures_agree_with_the_shared_store_queries(small) -> None:  # type: ignore[no-untyped-def]
    """The dashboard computes these from bounded reads; they must match store.queries exactly."""
    from sqlalchemy.orm import Session

    from dashboard.summaries import handoff_by, slo_figures
    from store import queries as shared

    engine, spec, _ = small
    window = common.Window(spec.end - spec.duration_s, spec.end + 1)
    sample, step = records.sample(engine, window)
    assert step == 1
    mine = slo_figures(sample, records.slo_buckets(engine, window, window.bucket_s(60)), window.seconds)
    with Session(engine) as session:
        theirs = shared.slo_summary(session, window.start, window.end)["all"]
        pairs = shared.handoff_stats(session, window.start, window.end, by="pair")
    assert mine is not None
    assert (mine["requests"], mine["completed"], mine["slo_met"]) == (
        theirs.requests,
        theirs.completed,
        theirs.slo_met,
    )
    assert mine["attainment"] == pytest.approx(theirs.attainment)
    assert mine["goodput_per_s"] == pytest.approx(theirs.goodput_per_s)
    assert mine["ttft_p99_s"] == pytest.approx(theirs.ttft_p99_s)
    assert mine["tpot_p99_s"] == pytest.approx(theirs.tpot_p99_s)
    by_pair = handoff_by(sample, "pair").set_index("key")
    assert set(by_pair.index) == set(pairs)
    for key, stats in pairs.items():
        assert by_pair.loc[key, "requests"] == stats.requests
        assert by_pair.loc[key, "p99_ms"] == pytest.approx(stats.p99_s * 1000.0)
        assert by_pair.loc[key, "mean_ms"] == pytest.approx(stats.mean_s * 1000.0)
        assert by_pair.loc[key, "lease_suspects"] == stats.lease_suspects


def test_a_changed_slo_moves_the_dashboard_and_the_controller_figures_alike(small) -> None:  # type: ignore[no-untyped-def]
    """Verdicts are recomputed under the SLO in force: a tighter TTFT target means fewer met, the same
    number in the dashboard's bounded reads and in the shared query the controller uses."""
    from sqlalchemy.orm import Session

    from dashboard.summaries import slo_figures
    from pdscope.config import LatencySLO, SLOSettings
    from store import queries as shared

    engine, spec, _ = small
    window = common.Window(spec.end - spec.duration_s, spec.end + 1)
    with Session(engine) as session:
        stored = shared.slo_summary(session, window.start, window.end)["all"]
        ttfts = sorted(
            r
            for (r,) in session.execute(
                select(RequestRecord.ttft_s).where(
                    RequestRecord.status == "ok", RequestRecord.ttft_s.is_not(None)
                )
            )
        )
    tight = SLOSettings(
        ttft=LatencySLO(target_ms=1000.0 * ttfts[len(ttfts) // 2]), tpot=LatencySLO(target_ms=10_000.0)
    )
    sample, _ = records.sample(engine, window, slo=tight)
    mine = slo_figures(
        sample, records.slo_buckets(engine, window, window.bucket_s(60), tight), window.seconds
    )
    with Session(engine) as session:
        theirs = shared.slo_summary(session, window.start, window.end, slo=tight)["all"]
    assert mine is not None and mine["slo_met"] == theirs.slo_met
    assert 0 < theirs.slo_met < stored.completed and theirs.slo_met != stored.slo_met
    assert theirs.slo_met == sum(1 for t in ttfts if t <= ttfts[len(ttfts) // 2])


def test_loose_index_scan_walks_the_distinct_values_and_ends_on_null() -> None:
    sql = common.loose_index_scan("names", "n", "snapshots", "instance")
    assert sql.startswith("WITH RECURSIVE names(n) AS (\n")
    assert "WHERE instance > names.n ORDER BY instance LIMIT 1" in sql
    assert "FROM names WHERE names.n IS NOT NULL" in sql
    assert fleet._SLICES_SQL.startswith(sql) and rq._STATUS_COUNTS_SQL.startswith(
        common.loose_index_scan("statuses", "v", "request_records", "status")
    )
