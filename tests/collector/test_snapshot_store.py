"""Snapshot rows in the store: one per instance per round, down rows, restarts noticed."""

from __future__ import annotations

from sqlalchemy import select

from collector.fastparse import extract_signals
from collector.scraper import ScrapeResult
from collector.snapshot_store import (
    COUNTER_RESET,
    PROCESS_START,
    SnapshotStore,
    counter_reset,
    restart_signals,
)
from collector.targets import ScrapeTarget
from store.db import make_engine, session_factory
from store.migrate import upgrade
from store.models import InstanceRow, Snapshot
from tests.captures import SCRAPE_PAGES

FIXTURES = SCRAPE_PAGES
DECODE = (FIXTURES / "decode_metrics.txt").read_text()
D0 = ScrapeTarget("d0", "decode", "decode", "http://d0", "http://d0/metrics")
P0 = ScrapeTarget("p0", "prefill", "prefill", "http://p0", "http://p0/metrics")


def test_counter_reset_rule() -> None:
    prev = {"up": True, "process_start_ts": 100.0, "requests_length": 10.0}
    assert not counter_reset(None, prev)
    assert not counter_reset(prev, {"up": True, "process_start_ts": 100.0, "requests_length": 12.0})
    assert counter_reset(prev, {"up": True, "process_start_ts": 100.0, "requests_length": 3.0})
    assert counter_reset(prev, {"up": True, "process_start_ts": 500.0, "requests_length": 30.0})
    assert not counter_reset(prev, {"up": False})


def test_write_rounds(store_url: str) -> None:
    upgrade(store_url)
    store = SnapshotStore(session_factory(make_engine(store_url)))
    store.ensure_instances([D0, P0], 1.0)
    store.ensure_instances([D0, P0], 2.0)  # idempotent
    page = extract_signals(DECODE)
    restarted = extract_signals(
        DECODE.replace(
            'finished_reason="length",model_name="tiny"} 23.0',
            'finished_reason="length",model_name="tiny"} 2.0',
        ).replace(
            "process_start_time_seconds 1.79594402402e+09", "process_start_time_seconds 1.79594500000e+09"
        )
    )
    assert (
        store.write_round(
            [ScrapeResult(D0, 10.0, 0.01, page, None), ScrapeResult(P0, 10.0, 3.0, None, "timeout after 3s")]
        )
        == 2
    )
    assert store.write_round([ScrapeResult(D0, 15.0, 0.01, restarted, None)]) == 1
    assert store.resets == {"d0": 1}
    with store.factory() as s:
        snaps = list(s.scalars(select(Snapshot).order_by(Snapshot.ts, Snapshot.instance)))
        inst = {i.name: i for i in s.scalars(select(InstanceRow))}
    d_first, p_down, d_second = snaps
    assert d_first.up and d_first.nixl_xfer_time_count == 23.0 and d_first.engines == 1
    assert d_first.histograms["vllm:nixl_xfer_time_seconds"]["counts"][-1] == 23.0
    assert d_first.extra == {}
    assert not p_down.up and p_down.error == "timeout after 3s" and p_down.requests_length is None
    assert d_second.requests_length == 2.0
    assert inst["d0"].last_seen == 15.0 and inst["p0"].last_seen == 1.0 and inst["p0"].role == "prefill"
    # both signals: the restart is confirmed and stored with the time it was seen back (the scrape at 15.0),
    # not the process's start time (1.795945e9): a vLLM loads for a minute or more before it serves
    assert inst["d0"].restarted_at == 15.0 and inst["p0"].restarted_at is None


def test_a_restart_is_confirmed_by_two_signals_never_by_one() -> None:
    prev = {"up": True, "process_start_ts": 100.0, "requests_length": 10.0}
    both = {"up": True, "process_start_ts": 500.0, "requests_length": 3.0}
    assert restart_signals(prev, both) == (PROCESS_START, COUNTER_RESET)
    assert restart_signals(prev, {"up": True, "process_start_ts": 100.0, "requests_length": 3.0}) == (
        COUNTER_RESET,
    )
    assert restart_signals(prev, {"up": True, "process_start_ts": 500.0, "requests_length": 30.0}) == (
        PROCESS_START,
    )
    assert restart_signals(prev, {"up": True, "process_start_ts": None, "requests_length": 3.0}) == (
        COUNTER_RESET,
    )
    assert restart_signals(prev, {"up": False}) == () and restart_signals(None, both) == ()


def test_one_signal_alone_stores_no_restart(store_url: str) -> None:
    upgrade(store_url)
    store = SnapshotStore(session_factory(make_engine(store_url)))
    store.ensure_instances([D0], 1.0)
    page = extract_signals(DECODE)
    dropped = extract_signals(  # a counter went down, the start time did not move
        DECODE.replace(
            'finished_reason="length",model_name="tiny"} 23.0',
            'finished_reason="length",model_name="tiny"} 2.0',
        )
    )
    store.write_round([ScrapeResult(D0, 10.0, 0.01, page, None)])
    store.write_round([ScrapeResult(D0, 15.0, 0.01, dropped, None)])
    assert store.resets == {"d0": 1}  # counted
    with store.factory() as s:
        assert s.scalars(select(InstanceRow)).one().restarted_at is None  # never confirmed


def test_an_instances_identity_is_stored_when_an_up_scrape_finds_it_changed(store_url: str) -> None:
    upgrade(store_url)
    store = SnapshotStore(session_factory(make_engine(store_url)))
    store.ensure_instances([D0, P0], 1.0)

    def identities() -> dict[str, object]:
        with store.factory() as s:
            return {i.name: i.kv_identity for i in s.scalars(select(InstanceRow))}

    page = extract_signals(DECODE)
    store.write_round(
        [ScrapeResult(D0, 10.0, 0.01, page, None), ScrapeResult(P0, 10.0, 3.0, None, "timeout")]
    )
    assert identities() == {"d0": {"block_size": "128", "cache_dtype": "auto", "model": "tiny"}, "p0": None}
    resized = extract_signals(DECODE.replace('block_size="128"', 'block_size="64"'))
    store.write_round([ScrapeResult(D0, 15.0, 0.01, resized, None), ScrapeResult(P0, 15.0, 3.0, None, "x")])
    assert identities()["d0"] == {"block_size": "64", "cache_dtype": "auto", "model": "tiny"}
    assert identities()["p0"] is None  # a failed scrape says nothing of it
