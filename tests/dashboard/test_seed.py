"""The seeded history: the PostgreSQL bulk load (COPY, indexes after) writes the same rows as the
insert path, and the dashboard's sampled reads keep exactly the rows they say they keep."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, select, text

from dashboard.queries import common, fleet, records
from devdata.seed import SeedSpec, bulk_seed_postgres, seed_store
from store.db import make_engine
from store.models import Base

SPEC_KW: dict[str, Any] = {"duration_s": 900.0, "rate_per_s": 3.0, "degrade_at": 0.3}


def _rows(engine: Engine, table: str) -> list[tuple[Any, ...]]:
    """Every row of ``table`` in id order, typed by the model (booleans, JSON) on either backend; not the
    change stamp, the database's own (migration 0017: a transaction id on PostgreSQL)."""
    t = Base.metadata.tables[table]
    cols = [c for c in t.c if c.name != "stamp"]
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(select(*cols).order_by(t.c.id))]


@pytest.mark.pg
def test_the_bulk_load_writes_what_the_insert_path_writes(pg_database: str, tmp_path: Path) -> None:
    import psycopg

    with psycopg.connect(pg_database, autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")
    spec = SeedSpec(end=time.time(), **SPEC_KW)
    lite = f"sqlite:///{tmp_path / 'store.db'}"
    want = seed_store(lite, spec)
    lines: list[str] = []
    got = bulk_seed_postgres(pg_database, spec, progress=lines.append)
    assert got == want
    assert any(line.startswith("requests ") for line in lines)
    a, b = make_engine(lite), make_engine(pg_database)
    try:
        for table in ("request_records", "snapshots", "instances", "decisions", "alerts"):
            left, right = _rows(a, table), _rows(b, table)
            assert len(left) == len(right) > 0, table
            assert right == left, table
        # keys and indexes are back after the load, and new rows get fresh ids
        with b.connect() as conn:
            names = set(
                conn.execute(
                    text(
                        "SELECT indexname FROM pg_indexes WHERE tablename IN ('request_records', 'snapshots')"
                    )
                ).scalars()
            )
            nxt = conn.execute(
                text("SELECT nextval(pg_get_serial_sequence('request_records', 'id'))")
            ).scalar()
        assert {
            "pk_request_records",
            "uq_request_records_request_id",
            "ix_request_records_window",
            "pk_snapshots",
            "ix_snapshots_instance_ts_id",
        } <= names
        assert nxt == want.requests + 1
    finally:
        a.dispose()
        b.dispose()


@pytest.fixture
def seeded_url(store_url: str) -> str:
    seed_store(store_url, SeedSpec(end=time.time(), **SPEC_KW))
    return store_url


def test_a_sampled_window_keeps_every_kth_id_in_time_order(seeded_url: str) -> None:
    engine = make_engine(seeded_url)
    try:
        end = (common.latest_ts(engine) or 0.0) + 1.0
        w = common.Window(end - 600.0, end)
        total = records.count(engine, w)
        frame, step = records.sample(engine, w, max_rows=300)
        assert step == math.ceil(total / 300) > 1
        with engine.connect() as conn:
            want = conn.execute(
                text(
                    "SELECT proxy_in FROM request_records WHERE proxy_in >= :s AND proxy_in < :e "
                    "AND id % :k = 0 ORDER BY proxy_in, id"
                ),
                {"s": w.start, "e": w.end, "k": step},
            ).scalars()
            assert list(frame["proxy_in"]) == list(want)
    finally:
        engine.dispose()


def test_a_long_snapshot_range_is_thinned_per_instance_and_keeps_the_newest(seeded_url: str) -> None:
    engine = make_engine(seeded_url)
    try:
        end = (common.latest_ts(engine) or 0.0) + 1.0
        w = common.Window(end - 900.0, end)
        full = fleet.snapshot_series(engine, w, max_points=10_000)
        thin = fleet.snapshot_series(engine, w, max_points=20)
        per = thin.groupby("instance").size()
        assert len(per) == full["instance"].nunique()
        assert per.max() <= 20 and per.min() >= 15
        assert list(thin["ts"]) == sorted(thin["ts"])
        newest = full.groupby("instance")["ts"].max()
        assert (thin.groupby("instance")["ts"].max() == newest).all()
        # every kept row is a real scrape, unchanged
        merged = thin.merge(full, on=["instance", "ts"], suffixes=("", "_full"))
        assert len(merged) == len(thin)
        assert (merged["num_running"] == merged["num_running_full"]).all()
    finally:
        engine.dispose()


@pytest.mark.pg
def test_a_large_window_on_postgresql_is_every_kth_id_of_its_span(
    pg_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psycopg

    with psycopg.connect(pg_database, autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")
    seed_store(pg_database, SeedSpec(end=time.time(), **SPEC_KW))
    monkeypatch.setattr(records, "COUNTED_MAX_ROWS", 500)  # this window counts as large
    monkeypatch.setattr(records, "EDGE_S", 60.0)
    engine = make_engine(pg_database)
    try:
        end = (common.latest_ts(engine) or 0.0) + 1.0
        w = common.Window(end - 600.0, end)
        total = records.count(engine, w)
        frame, step = records.sample(engine, w, max_rows=300)
        assert step == math.ceil(total / 300)  # the seeded ids are dense and in arrival order
        with engine.connect() as conn:
            want = conn.execute(
                text(
                    "SELECT proxy_in FROM request_records WHERE proxy_in >= :s AND proxy_in < :e "
                    "AND id % :k = 0 ORDER BY proxy_in, id"
                ),
                {"s": w.start, "e": w.end, "k": step},
            ).scalars()
            assert list(frame["proxy_in"]) == list(want)
        # the dashboard's sessions run without JIT, and stay so when the pool hands them out again
        for _ in range(2):
            with common.connect(engine) as conn:
                assert conn.exec_driver_sql("SHOW jit").scalar() == "off"
        # a window under the bound is counted exactly, as on SQLite
        small = common.Window(end - 60.0, end)
        assert records.sample(engine, small, max_rows=50)[1] == math.ceil(records.count(engine, small) / 50)
    finally:
        engine.dispose()


@pytest.mark.pg
def test_status_counts_of_a_large_window_estimate_only_the_statuses_over_the_bound(
    pg_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psycopg

    from dashboard.queries import requests as rq

    with psycopg.connect(pg_database, autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")
    seed_store(pg_database, SeedSpec(end=time.time(), **SPEC_KW))
    engine = make_engine(pg_database)
    try:
        end = (common.latest_ts(engine) or 0.0) + 1.0
        w = common.Window(end - 900.0, end)
        exact = rq.status_counts(engine, w)
        assert not exact["estimated"].any()
        with engine.connect() as conn:
            truth = dict(
                conn.execute(
                    text(
                        "SELECT status, count(*) FROM request_records "
                        "WHERE proxy_in >= :s AND proxy_in < :e GROUP BY status"
                    ),
                    {"s": w.start, "e": w.end},
                ).all()
            )
        assert dict(zip(exact["status"], exact["requests"], strict=True)) == truth
        monkeypatch.setattr(records, "COUNTED_MAX_ROWS", 500)  # "ok" is over it, the others are not
        got = rq.status_counts(engine, w)
        by = {r.status: r for r in got.itertuples()}
        assert by["ok"].estimated and not any(r.estimated for s, r in by.items() if s != "ok")
        assert {s: r.requests for s, r in by.items() if s != "ok"} == {
            s: n for s, n in truth.items() if s != "ok"
        }
        assert abs(by["ok"].requests - truth["ok"]) <= 0.1 * truth["ok"]
        assert list(got["requests"]) == sorted(got["requests"], reverse=True)
    finally:
        engine.dispose()


def test_the_seeded_prefix_cache_counters_add_up_the_seeded_records(seeded_url: str) -> None:
    """vLLM's prefix-cache counters in the snapshots are accumulated from the same requests the
    records hold: P's hits are the cached tokens P reported; decode-only records have no P."""
    engine = make_engine(seeded_url)
    try:
        with engine.connect() as conn:
            last, hits, queries = conn.execute(
                text(
                    "SELECT ts, prefix_cache_hits, prefix_cache_queries FROM snapshots"
                    " WHERE instance = 'prefill-0' ORDER BY ts DESC LIMIT 1"
                )
            ).one()
            reported, prompts = conn.execute(
                text(
                    "SELECT sum(p_cached_tokens), sum(prompt_tokens) FROM request_records"
                    " WHERE p_instance = 'prefill-0' AND p_done <= :last"
                ),
                {"last": last},
            ).one()
            paths = dict(
                conn.execute(
                    text("SELECT route_path, count(*) FROM request_records GROUP BY route_path")
                ).all()
            )
            stray = conn.execute(
                text(
                    "SELECT count(*) FROM request_records WHERE route_path = 'decode_only'"
                    " AND (p_instance IS NOT NULL OR p_sent IS NOT NULL OR p_cached_tokens IS NOT NULL)"
                )
            ).scalar()
    finally:
        engine.dispose()
    assert hits == reported > 0 and queries == prompts
    assert paths["pd"] > paths["decode_only"] > 0 and stray == 0
