"""Shared derived-signal queries: rates with resets, histogram quantiles, request aggregates."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from pdscope.stats import counter_increase, histogram_quantile, percentile
from store.db import make_engine, session_factory
from store.families import HIST_TTFT
from store.migrate import upgrade
from store.models import RequestRecord, Snapshot
from store.queries import (
    FiguresMemo,
    counter_steps,
    handoff_stats,
    histogram_quantiles,
    histogram_window,
    instance_signals,
    pool_scrape_figures,
    signals_of_rows,
    slo_summary,
    snapshot_window,
)

LE = [0.1, 0.5, 1.0]


def _snap(instance: str, pool: str, role: str, ts: float, **values: Any) -> Snapshot:
    hist = values.pop("ttft_buckets", None)
    snap = Snapshot(
        instance=instance, pool=pool, role=role, ts=ts, up=values.pop("up", True), histograms={}, extra={}
    )
    for k, v in values.items():
        setattr(snap, k, v)
    if hist is not None:
        snap.histograms = {
            HIST_TTFT: {"le": LE, "counts": hist, "sum": values.get("ttft_sum", 0.0), "count": hist[-1]}
        }
    return snap


@pytest.fixture
def factory(store_url: str) -> sessionmaker[Session]:
    upgrade(store_url)
    return session_factory(make_engine(store_url))


def test_counter_increase_handles_resets_and_gaps() -> None:
    assert counter_increase([10, 15, 20]) == 10
    assert counter_increase([10, 15, 3, 8]) == 5 + 3 + 5  # restart after 15: counts from zero
    assert counter_increase([10, None, 12]) == 2
    assert counter_increase([10]) is None
    assert counter_increase([None, float("nan"), 4]) is None


def test_bucket_quantile_matches_prometheus() -> None:
    # 10 obs: 5 in (0, 0.1], 3 in (0.1, 0.5], 2 in (0.5, 1.0]
    counts = [5.0, 8.0, 10.0, 10.0]
    assert histogram_quantile(0.5, LE, counts) == pytest.approx(0.1)
    assert histogram_quantile(0.25, LE, counts) == pytest.approx(0.05)
    assert histogram_quantile(0.9, LE, counts) == pytest.approx(0.75)
    assert histogram_quantile(0.99, LE, [0.0, 0.0, 0.0, 4.0]) == 1.0  # all in +Inf: highest finite bound
    assert histogram_quantile(0.5, LE, [0.0, 0.0, 0.0, 0.0]) is None


def test_instance_and_pool_rates_with_a_restart(factory: sessionmaker[Session]) -> None:
    with factory.begin() as s:
        s.add_all(
            [
                _snap(
                    "d0",
                    "dec",
                    "decode",
                    100.0,
                    generation_tokens=1000.0,
                    nixl_xfer_time_count=10.0,
                    nixl_bytes_sum=1e6,
                    nixl_kv_expired_reqs=0.0,
                    requests_length=5.0,
                    kv_cache_usage=0.2,
                ),
                _snap(
                    "d0",
                    "dec",
                    "decode",
                    110.0,
                    generation_tokens=1500.0,
                    nixl_xfer_time_count=20.0,
                    nixl_bytes_sum=3e6,
                    nixl_kv_expired_reqs=0.0,
                    requests_length=10.0,
                    kv_cache_usage=0.3,
                ),
                # restart: counters start again
                _snap(
                    "d0",
                    "dec",
                    "decode",
                    120.0,
                    generation_tokens=100.0,
                    nixl_xfer_time_count=2.0,
                    nixl_bytes_sum=0.5e6,
                    nixl_kv_expired_reqs=0.0,
                    requests_length=1.0,
                    kv_cache_usage=0.4,
                ),
                _snap("d1", "dec", "decode", 100.0, generation_tokens=0.0, kv_cache_usage=0.6),
                _snap("d1", "dec", "decode", 120.0, generation_tokens=200.0, kv_cache_usage=0.8),
                _snap("p0", "pre", "prefill", 100.0, nixl_kv_expired_reqs=1.0),
                _snap("p0", "pre", "prefill", 110.0, up=False),
                _snap("p0", "pre", "prefill", 120.0, nixl_kv_expired_reqs=3.0),
            ]
        )
    with factory() as s:
        inst = instance_signals(s, 90.0, 130.0)
        pools = pool_scrape_figures(s, 90.0, 130.0)
        only_dec = instance_signals(s, 90.0, 130.0, pool="dec")
    d0 = inst["d0"]
    assert d0.seconds == 20.0
    assert d0.generation_tokens_per_s == pytest.approx((500 + 100) / 20)
    assert d0.transfers_per_s == pytest.approx((10 + 2) / 20)
    assert d0.kv_mb_per_s == pytest.approx((2.0 + 0.5) / 20)
    assert d0.requests_per_s == pytest.approx((5 + 1) / 20)
    assert d0.kv_cache_usage == 0.4 and d0.kv_headroom == pytest.approx(0.6)
    p0 = inst["p0"]
    assert p0.expired_leases_per_min == pytest.approx(2 / 20 * 60)
    assert p0.up_ratio == pytest.approx(2 / 3)
    assert inst["d1"].transfers_per_s is None  # not scraped: None, never zero
    dec = pools["dec"]
    assert dec.instances == 2 and dec.up == 2
    assert dec.generation_tokens_per_s == pytest.approx(30.0 + 10.0)
    assert dec.kv_cache_usage == pytest.approx(0.6)
    assert set(only_dec) == {"d0", "d1"}
    # one read, several windows (the controller's window and its tail): the same as reading each
    with factory() as s:
        rows = snapshot_window(s, 90.0, 130.0)
        tail = instance_signals(s, 105.0, 130.0)
    assert signals_of_rows(rows) == inst
    assert signals_of_rows(rows, since=105.0) == tail
    assert tail["d0"].seconds == 10.0 and tail["d0"].generation_tokens_per_s == pytest.approx(100 / 10)
    assert signals_of_rows(rows, since=125.0) == {}


def test_a_memo_works_out_again_only_the_instances_whose_rows_are_other_rows(
    factory: sessionmaker[Session],
) -> None:
    with factory.begin() as s:
        s.add_all(
            [
                _snap(name, "dec", "decode", ts, generation_tokens=ts)
                for name in ("d0", "d1", "d2")
                for ts in (100, 110)
            ]
        )
        s.add_all([_snap("d1", "dec", "decode", 105.0, generation_tokens=40.0)])  # d1's middle row
    with factory() as s:
        rows = snapshot_window(s, 90.0, 130.0)
    memo: FiguresMemo = {}
    held = {"d0": rows["d0"], "d1": [rows["d1"][0], rows["d1"][2]], "d2": rows["d2"]}
    first = signals_of_rows(held, memo=memo)
    again = signals_of_rows({k: list(v) for k, v in held.items()}, memo=memo)  # new lists, the same rows
    assert again == first and all(again[k] is first[k] for k in held)
    later = signals_of_rows({"d0": rows["d0"][1:], "d1": rows["d1"]}, memo=memo)  # one row less; one more
    assert later == signals_of_rows({"d0": rows["d0"][1:], "d1": rows["d1"]})
    assert later["d1"] is not first["d1"] and later["d1"].scrapes == 3
    assert later["d0"].scrapes == 1 and set(memo) == {"d0", "d1"}  # d2 is gone from the memo too


def test_histogram_window_and_quantiles(factory: sessionmaker[Session]) -> None:
    with factory.begin() as s:
        s.add_all(
            [
                _snap("d0", "dec", "decode", 100.0, ttft_buckets=[1.0, 1.0, 1.0, 1.0], ttft_sum=0.05),
                _snap("d0", "dec", "decode", 110.0, ttft_buckets=[6.0, 9.0, 11.0, 11.0], ttft_sum=3.0),
                _snap("d1", "dec", "decode", 100.0, ttft_buckets=[0.0, 0.0, 0.0, 0.0]),
                _snap("d1", "dec", "decode", 105.0, ttft_buckets=[0.0, 0.0, 5.0, 5.0]),
                _snap("d1", "dec", "decode", 110.0, ttft_buckets=[0.0, 0.0, 2.0, 2.0]),  # restart
            ]
        )
    with factory() as s:
        d0 = histogram_window(s, HIST_TTFT, 90.0, 120.0, instance="d0")
        both = histogram_window(s, HIST_TTFT, 90.0, 120.0, pool="dec")
        qs = histogram_quantiles(s, HIST_TTFT, [0.5, 0.9], 90.0, 120.0)
        by_pool = histogram_quantiles(s, HIST_TTFT, [0.5], 90.0, 120.0, by="pool")
    assert d0 is not None and d0.counts == (5.0, 8.0, 10.0, 10.0) and d0.count == 10.0
    assert d0.quantile(0.5) == pytest.approx(0.1)
    assert both is not None and both.counts == (5.0, 8.0, 17.0, 17.0)
    assert qs["d0"][0.9] == pytest.approx(0.75)
    assert qs["d1"][0.5] == pytest.approx(0.75)
    assert by_pool["dec"][0.5] == both.quantile(0.5)


def _rec(
    rid: str,
    p: str,
    d: str,
    t: float,
    handoff: float,
    *,
    ok: bool = True,
    met: bool = True,
    suspect: bool = False,
) -> RequestRecord:
    return RequestRecord(
        request_id=rid,
        p_instance=p,
        d_instance=d,
        p_pool="pre",
        d_pool="dec",
        status="ok" if ok else "error",
        retries=0,
        proxy_in=t,
        p_done=t + 0.1,
        first_token=t + 0.1 + handoff,
        done=t + 1,
        ttft_s=0.1 + handoff,
        tpot_s=0.01,
        e2e_s=1.0,
        slo_met=met and ok,
        lease_expiry_suspect=suspect,
        attributes={},
    )


def test_request_aggregates(factory: sessionmaker[Session]) -> None:
    with factory.begin() as s:
        s.add_all([_rec(f"a{i}", "p0", "d0", 100.0 + i, 0.1 * (i + 1)) for i in range(10)])
        s.add_all([_rec(f"b{i}", "p0", "d1", 100.0 + i, 1.0, met=i < 5, suspect=i == 0) for i in range(10)])
        s.add(_rec("c0", "p0", "d1", 100.0, 1.0, ok=False))
        s.add(_rec("old", "p0", "d0", 10.0, 9.0))
    with factory() as s:
        pairs = handoff_stats(s, 90.0, 120.0)
        per_d = handoff_stats(s, 90.0, 120.0, by="d_instance")
        slo = slo_summary(s, 90.0, 120.0)
        slo_d = slo_summary(s, 90.0, 120.0, by="d_instance")
    assert pairs["p0->d0"].requests == 10
    assert pairs["p0->d0"].p50_s == pytest.approx(0.55)
    assert pairs["p0->d1"].lease_suspects == 1
    assert per_d["d1"].requests == 11 and per_d["d1"].p99_s == pytest.approx(1.0)
    all_ = slo["all"]
    assert all_.requests == 21 and all_.completed == 20 and all_.slo_met == 15
    assert all_.attainment == pytest.approx(0.75)
    assert all_.goodput_per_s == pytest.approx(15 / 30)
    assert all_.statuses == {"ok": 20, "error": 1}
    assert slo_d["d0"].attainment == 1.0 and slo_d["d1"].attainment == 0.5


def test_counter_steps(factory: sessionmaker[Session]) -> None:
    with factory.begin() as s:
        s.add_all(
            [
                _snap("p0", "pre", "prefill", 100.0, nixl_kv_expired_reqs=0.0),
                _snap("p0", "pre", "prefill", 105.0, nixl_kv_expired_reqs=2.0),
                _snap("p0", "pre", "prefill", 110.0, nixl_kv_expired_reqs=2.0),
                _snap("p0", "pre", "prefill", 115.0, nixl_kv_expired_reqs=1.0),  # restart with one expiry
                _snap("d0", "dec", "decode", 105.0, nixl_kv_expired_reqs=0.0),
            ]
        )
    with factory() as s:
        steps = counter_steps(s, "nixl_kv_expired_reqs", 0.0, 200.0, role="prefill")
    assert [(st.start_ts, st.end_ts, st.increase) for st in steps] == [
        (100.0, 105.0, 2.0),
        (110.0, 115.0, 1.0),
    ]


def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
