"""Dashboard query times on a large store: by default one million request records (and the
snapshots a 4P+8D fleet scraped every 5 s over the same 6 hours) in SQLite; with
``--store-url postgresql://...`` the same history in PostgreSQL, bulk-loaded.

For each page it runs the reads that page makes (the same ``dashboard.data``
functions, caches cleared so every read hits the store) and the frames it computes from them (the
same ``dashboard.summaries`` functions; only the controller's routing table, read over HTTP from
the controller, is left out) over 15 min, 1 h, 6 h and 24 h,
and reports the median of a few runs next to a baseline measured in the same run: a
full scan of ``request_records`` (count and sums over every row, no index). Target:
every page under 1 s.

    .venv/bin/python bench/dashboard.py                 # seeds a SQLite file under /tmp once
    .venv/bin/python bench/dashboard.py --requests 200000 --repeat 3
    # a day of an 8P+16D fleet on PostgreSQL (seeded once into its own database on that server):
    .venv/bin/python bench/dashboard.py --store-url postgresql://postgres@127.0.0.1:5432/postgres \\
        --requests 10000000 --hours 24 --prefill 8 --decode 16

On PostgreSQL the seed goes into a database named after it (``pdscope_bench_dashboard_<requests>r_
<hours>h_<P>p<D>d``) on the server of ``--store-url``, loaded with COPY by a child process at
niceness 10 (indexes built after the load, then VACUUM ANALYZE); the database's comment records
the seed, so a later run with the same sizes reuses it (``--reseed`` drops it first).

Writes bench/results/dashboard.json (SQLite) or bench/results/dashboard-pg.json (PostgreSQL).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Streamlit's "no runtime" warning comes once per cached function, at import.
logging.getLogger("streamlit.runtime.caching.cache_data_api").setLevel(logging.ERROR)

import streamlit as st  # noqa: E402
from sqlalchemy import text  # noqa: E402

from dashboard import data, prefix, summaries  # noqa: E402
from dashboard.context import engine_for  # noqa: E402
from dashboard.queries.common import Window  # noqa: E402
from devdata.seed import SeedSpec, bulk_seed_postgres, seed_store  # noqa: E402
from pdscope.config import SLOSettings  # noqa: E402
from store.db import make_engine  # noqa: E402
from store.migrate import upgrade  # noqa: E402

RANGES = {"15m": 900.0, "1h": 3600.0, "6h": 6 * 3600.0, "24h": 24 * 3600.0}
SEED_NICE = 10
# The pages pass the config's SLOs (verdicts recomputed under them); the defaults here.
SLO = SLOSettings()
# Bumped when the seed's content changes, so an older seeded PostgreSQL database is reseeded.
SEED_FORMAT = 2  # 2: the KV-aware routing columns (migration 0009) and vLLM's prefix-cache counters
TARGET_S = 1.0


def _opening(url: str) -> None:
    """What every page reads before its own (``dashboard.views.opening.open_page``)."""
    data.presence(url)
    data.latest_ts(url)


def _fleet(url: str, w: Window) -> None:
    _opening(url)
    summaries.pool_totals(data.fleet_health(url, w.start, w.end))
    series = data.snapshot_series(url, w.start, w.end)
    summaries.interval_means(series, "nixl_xfer_time_sum", "nixl_xfer_time_count", 1000.0)
    data.pool_limits(url, w.end)
    data.active_overrides(url, w.end)


def _requests(url: str, w: Window) -> None:
    _opening(url)
    data.status_counts(url, w.start, w.end)
    found = data.search_requests(url, w.start, w.end, "", "", "", False, False, 200)
    data.search_requests(url, w.start, w.end, "", "", "", True, False, 200)
    data.search_requests(url, w.start, w.end, "", "ok", "decode-3", False, False, 200)
    data.search_requests(url, w.start, w.end, "", "", "", False, True, 50)
    if not found.empty:
        rec = data.get_request(url, str(found["request_id"].iloc[0]))
        if rec and rec.get("d_instance"):
            data.nixl_around(
                url, rec["d_instance"], rec["d_sent"] or rec["proxy_in"], rec["done"] or rec["proxy_in"]
            )


def _kv(url: str, w: Window) -> None:
    _opening(url)
    data.nixl_per_instance(url, w.start, w.end)
    series = data.snapshot_series(url, w.start, w.end)
    decode = series[series["role"] == "decode"]
    summaries.interval_means(decode, "nixl_xfer_time_sum", "nixl_xfer_time_count", 1000.0)
    summaries.interval_rates(series, ("nixl_failed_transfers", "nixl_kv_expired_reqs"))
    summaries.handoff_effects(data.handoff(url, w.start, w.end, "pair"))
    sample, step = data.request_sample(url, w.start, w.end)
    summaries.stranded_kv(series, sample, step)
    data.firing_alerts(url)


def _slos(url: str, w: Window) -> None:
    _opening(url)
    data.firing_alerts(url)
    data.request_sample(url, w.start, w.end, slo=SLO)
    data.slo_summary(url, w.start, w.end, SLO)
    data.slo_buckets(url, w.start, w.end, w.bucket_s(60), SLO)
    data.recent_alerts(url, w.start, w.end)


def _prefix(url: str, w: Window) -> None:
    _opening(url)
    series = data.prefix_series(url, w.start, w.end)
    rates = prefix.window_hit_rates(series)
    prefix.hit_rates(series, w.start, w.bucket_s(60))
    sample, step = data.prefix_sample(url, w.start, w.end)
    routed = sample[sample["route_path"].notna()]
    compared = prefix.predicted_vs_reported(routed, step)
    prefix.hot_prefixes(routed, step)
    prefix.decode_only_share(routed, w.start, w.bucket_s(60))
    prefix.headline(rates, compared, routed)


def _controller(url: str, w: Window) -> None:
    _opening(url)
    data.latest_mode(url)
    data.decisions(url, w.start, w.end)
    data.weight_history(url, w.start, w.end)
    data.active_overrides(url, w.end)
    data.audit_trail(url, w.start, w.end)


def _capacity(url: str, w: Window) -> None:
    _opening(url)
    data.request_sample(url, w.start, w.end, slo=SLO)
    data.slo_buckets(url, w.start, w.end, w.bucket_s(60), SLO)
    series = data.snapshot_series(url, w.start, w.end)
    rates = summaries.interval_rates(series, ("prompt_tokens", "generation_tokens"))
    summaries.rate_per_instance(rates, "prefill", "prompt_tokens")
    summaries.rate_per_instance(rates, "decode", "generation_tokens")


PAGES: dict[str, Callable[[str, Window], None]] = {
    "fleet": _fleet,
    "requests": _requests,
    "kv_transfer": _kv,
    "prefix_cache": _prefix,
    "slos": _slos,
    "controller": _controller,
    "capacity": _capacity,
}


def _timed(fn: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """Median wall and CPU seconds of ``repeat`` cold runs (SQLite runs in-process, so CPU
    time includes the queries; it is the figure to trust on a busy machine)."""
    wall, cpu = [], []
    for _ in range(repeat):
        st.cache_data.clear()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def _baseline(url: str) -> Callable[[], Any]:
    # SQLite: NOT INDEXED forces the table scan; PostgreSQL scans the table for this anyway.
    hint = " NOT INDEXED" if url.startswith("sqlite") else ""

    def scan() -> Any:
        with engine_for(url).connect() as conn:
            return conn.execute(
                text(
                    f"SELECT count(*), sum(ttft_s), max(e2e_s), sum(prompt_tokens) FROM request_records{hint}"
                )
            ).one()

    return scan


def _spec(args: argparse.Namespace) -> SeedSpec:
    return SeedSpec(
        end=time.time(),
        duration_s=args.hours * 3600.0,
        requests=args.requests,
        prefill=tuple(f"prefill-{i}" for i in range(args.prefill)),
        decode=tuple(f"decode-{i}" for i in range(args.decode)),
    )


def _seed_key(args: argparse.Namespace) -> dict[str, Any]:
    """What makes two seeds the same (everything but the time they end at)."""
    return {
        "format": SEED_FORMAT,
        "requests": args.requests,
        "hours": args.hours,
        "prefill": args.prefill,
        "decode": args.decode,
        "scrape_interval_s": SeedSpec(end=0.0).scrape_interval_s,
    }


def _pg_seed_child(url: str, spec: SeedSpec) -> None:
    os.nice(SEED_NICE)
    bulk_seed_postgres(url, spec, progress=lambda m: print(f"  {m}", flush=True), backend_nice=SEED_NICE)


def _pg_store(args: argparse.Namespace) -> tuple[str, float | None]:
    """The seeded PostgreSQL database for these sizes (seeded now unless already there) and the
    seed's wall seconds (None when reused)."""
    from sqlalchemy.engine import make_url

    server = make_url(args.store_url)
    name = f"pdscope_bench_dashboard_{args.requests}r_{args.hours:g}h_{args.prefill}p{args.decode}d"
    name = name.replace(".", "_")
    url = server.set(database=name).render_as_string(hide_password=False)
    key = json.dumps(_seed_key(args), sort_keys=True)
    admin = make_engine(args.store_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            found = conn.execute(
                text("SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = :n"),
                {"n": name},
            ).first()
            seeded = _seed_note(found[0] if found is not None else None)
            if seeded is not None and seeded.get("key") == json.loads(key) and not args.reseed:
                print(f"reusing the seeded database {name} (seeded in {seeded.get('seed_s')} s)", flush=True)
                return url, seeded.get("seed_s")
            if found is not None:
                conn.exec_driver_sql(f'DROP DATABASE "{name}" WITH (FORCE)')
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        print(f"seeding {args.requests:,} request records into PostgreSQL database {name} ...", flush=True)
        t0 = time.perf_counter()
        child = multiprocessing.get_context("fork").Process(target=_pg_seed_child, args=(url, _spec(args)))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise SystemExit(f"seeding failed (exit {child.exitcode}); the database {name} is left unmarked")
        seed_s = time.perf_counter() - t0
        note = json.dumps({"key": json.loads(key), "seed_s": round(seed_s, 1)}, sort_keys=True)
        with admin.connect() as conn:
            conn.exec_driver_sql(f"COMMENT ON DATABASE \"{name}\" IS '{note}'")
        print(f"  seeded in {seed_s:.1f} s", flush=True)
        return url, seed_s
    finally:
        admin.dispose()


def _seed_note(comment: str | None) -> dict[str, Any] | None:
    """The seed a bench database's comment records: {"key": what was seeded, "seed_s": seconds}."""
    try:
        note = json.loads(comment) if comment else None
    except ValueError:
        return None
    return note if isinstance(note, dict) else None


def _sqlite_store(args: argparse.Namespace) -> tuple[str, float | None]:
    fleet = "" if (args.prefill, args.decode) == (4, 8) else f"-{args.prefill}p{args.decode}d"
    hours = "" if args.hours == 6.0 else f"-{args.hours:g}h"
    db = args.db or Path(f"/tmp/pdscope-bench-dashboard-{args.requests}{hours}{fleet}.db")
    url = f"sqlite:///{db}"
    if not args.reseed and db.exists():
        return url, None
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    print(f"seeding {args.requests:,} request records into {db} ...", flush=True)
    t0 = time.perf_counter()
    summary = seed_store(url, _spec(args))
    seed_s = time.perf_counter() - t0
    print(f"  {summary.requests:,} requests, {summary.snapshots:,} snapshots in {seed_s:.1f} s", flush=True)
    return url, seed_s


def _server_settings(url: str) -> dict[str, Any]:
    if not url.startswith("postgresql"):
        return {}
    names = ("server_version", "shared_buffers", "work_mem", "max_parallel_workers_per_gather", "jit")
    engine = make_engine(url)  # a fresh session: the server's settings, not the dashboard's
    try:
        with engine.connect() as conn:
            return {n: conn.exec_driver_sql(f"SHOW {n}").scalar() for n in names}
    finally:
        engine.dispose()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--hours", type=float, default=6.0, help="history the requests are spread over")
    parser.add_argument(
        "--db", type=Path, default=None, help="SQLite file (reused when it already holds the seed)"
    )
    parser.add_argument(
        "--store-url", default=None, help="a PostgreSQL server URL: seed (once) and measure there instead"
    )
    parser.add_argument("--prefill", type=int, default=4, help="prefill instances")
    parser.add_argument("--decode", type=int, default=8, help="decode instances")
    parser.add_argument("--reseed", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pages", default=",".join(PAGES), help="comma-separated pages to time")
    parser.add_argument("--ranges", default=",".join(RANGES), help="comma-separated ranges to time")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


@dataclass(frozen=True)
class _Store:
    """The measured store: where, what it holds, and its full-scan baseline (median wall, CPU s)."""

    backend: str
    url: str
    seed_s: float | None
    n_req: int
    n_snap: int
    baseline: float
    baseline_cpu: float


def _store(args: argparse.Namespace) -> _Store:
    """The seeded store (seeded now unless reused), migrated, counted and its baseline timed."""
    backend = "postgresql" if args.store_url else "sqlite"
    url, seed_s = _pg_store(args) if args.store_url else _sqlite_store(args)
    upgrade(url)  # a store seeded before a newer migration gets its indexes now
    engine = engine_for(url)
    with engine.connect() as conn:
        n_req = conn.execute(text("SELECT count(*) FROM request_records")).scalar_one()
        n_snap = conn.execute(text("SELECT count(*) FROM snapshots")).scalar_one()
    return _Store(backend, url, seed_s, n_req, n_snap, *_timed(_baseline(url), args.repeat))


def _time_pages(
    store: _Store,
    end: float,
    pages: dict[str, Callable[[str, Window], None]],
    ranges: dict[str, float],
    repeat: int,
) -> list[dict[str, Any]]:
    """Each page's reads over each range ending at ``end``: one row each."""
    rows: list[dict[str, Any]] = []
    for page, fn in pages.items():
        for label, seconds in ranges.items():
            w = Window(end - seconds, end)
            t, cpu = _timed(lambda fn=fn, w=w: fn(store.url, w), repeat)
            rows.append(
                {
                    "page": page,
                    "range": label,
                    "seconds": round(t, 4),
                    "cpu_seconds": round(cpu, 4),
                    "ratio_to_full_scan": round(t / store.baseline, 3),
                    "cpu_ratio_to_full_scan": round(cpu / max(store.baseline_cpu, 1e-9), 3),
                    "under_target": t < TARGET_S,
                }
            )
    return rows


def _print_table(
    store: _Store, rows: list[dict[str, Any]], pages: list[str], ranges: list[str], repeat: int
) -> None:
    print(f"\nstore: {store.n_req:,} request records, {store.n_snap:,} snapshots ({store.backend})")
    print(
        f"baseline: full scan of request_records = {store.baseline * 1000:.0f} ms wall, "
        f"{store.baseline_cpu * 1000:.0f} ms CPU "
        f"(median of {repeat})\n"
    )
    print(f"{'page':<12}" + "".join(f"{'range ' + r + ' wall / CPU':>34}" for r in ranges))
    for page in pages:
        cells = []
        for label in ranges:
            r = next(x for x in rows if x["page"] == page and x["range"] == label)
            mark = "" if r["under_target"] else " !"
            cells.append(
                f"{r['seconds'] * 1000:6.0f} / {r['cpu_seconds'] * 1000:5.0f} ms "
                f"({r['ratio_to_full_scan']:5.2f}x){mark}"
            )
        print(f"{page:<12}" + "".join(f"{c:>34}" for c in cells))
    print(f"\n(x = page wall time / full-scan baseline wall time; ! = over the {TARGET_S:g} s target)")


def _result(args: argparse.Namespace, store: _Store, rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "benchmark": "dashboard page query time",
        "store": {
            "backend": store.backend,
            "request_records": store.n_req,
            "snapshots": store.n_snap,
            "where": store.url.split("@")[-1],
            "seed": _seed_key(args),
            "server": _server_settings(store.url),
        },
        "seed_seconds": None if store.seed_s is None else round(store.seed_s, 1),
        "seed_note": "wall seconds of the seeding run (child process at niceness 10); on PostgreSQL "
        "recorded in the seeded database and reported again when it is reused",
        "baseline": {
            "what": "full scan of request_records (count, sums; NOT INDEXED)",
            "seconds": round(store.baseline, 4),
            "cpu_seconds": round(store.baseline_cpu, 4),
        },
        "cpu_note": "cpu_seconds is this process's CPU time: all of a query on SQLite (in-process), "
        "only the client's share on PostgreSQL (the server's CPU is not counted)",
        "target_seconds": TARGET_S,
        "repeat": args.repeat,
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "pages": rows,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.getLogger("streamlit").setLevel(logging.ERROR)
    logging.getLogger("streamlit.runtime.caching.cache_data_api").setLevel(logging.ERROR)
    store = _store(args)
    out = args.out or REPO / "bench" / "results" / (
        "dashboard-pg.json" if store.backend == "postgresql" else "dashboard.json"
    )
    latest = data.latest_ts(store.url) or time.time()
    end = latest + 1.0
    pages = {p: PAGES[p] for p in args.pages.split(",")}
    ranges = {r: RANGES[r] for r in args.ranges.split(",")}
    rows = _time_pages(store, end, pages, ranges, args.repeat)
    _print_table(store, rows, list(pages), list(ranges), args.repeat)
    result = _result(args, store, rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
