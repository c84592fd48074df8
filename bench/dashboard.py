"""Dashboard query times on a large store: one million request records (and the
snapshots a 4P+8D fleet scraped every 5 s over the same 6 hours) in SQLite.

For each page it runs the reads that page makes (the same ``dashboard.data``
functions, caches cleared so every read hits the store) over several time ranges,
and reports the median of a few runs next to a baseline measured in the same run: a
full scan of ``request_records`` (count and sums over every row, no index). Target:
every page under 1 s for its default and 1 h ranges.

    .venv/bin/python bench/dashboard.py                 # seeds /tmp/pdscope-bench-dashboard.db once
    .venv/bin/python bench/dashboard.py --requests 200000 --repeat 3

Writes bench/results/dashboard.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import streamlit as st  # noqa: E402
from sqlalchemy import text  # noqa: E402

from dashboard import data, summaries  # noqa: E402
from dashboard.context import engine_for  # noqa: E402
from dashboard.queries.common import Window  # noqa: E402
from dashboard.seed import SeedSpec, seed_store  # noqa: E402

RANGES = {"15m": 900.0, "1h": 3600.0, "6h": 6 * 3600.0}
TARGET_S = 1.0


def _fleet(url: str, w: Window) -> None:
    data.presence(url)
    data.latest_ts(url)
    data.fleet_health(url, w.start, w.end)
    series = data.snapshot_series(url, w.start, w.end)
    summaries.interval_means(series, "nixl_xfer_time_sum", "nixl_xfer_time_count", 1000.0)
    data.pool_limits(url, w.end)
    data.active_overrides(url, w.end)


def _requests(url: str, w: Window) -> None:
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
    data.nixl_per_instance(url, w.start, w.end)
    series = data.snapshot_series(url, w.start, w.end)
    summaries.interval_rates(series, ("nixl_failed_transfers", "nixl_kv_expired_reqs"))
    data.handoff(url, w.start, w.end, "pair")


def _slos(url: str, w: Window) -> None:
    data.firing_alerts(url)
    data.request_sample(url, w.start, w.end)
    data.slo_summary(url, w.start, w.end)
    data.slo_buckets(url, w.start, w.end, w.bucket_s(60))
    data.recent_alerts(url, w.start, w.end)


def _controller(url: str, w: Window) -> None:
    data.latest_mode(url)
    data.decisions(url, w.start, w.end)
    data.weight_history(url, w.start, w.end)
    data.active_overrides(url, w.end)
    data.audit_trail(url, w.start, w.end)


def _capacity(url: str, w: Window) -> None:
    data.request_sample(url, w.start, w.end)
    data.slo_buckets(url, w.start, w.end, w.bucket_s(60))
    series = data.snapshot_series(url, w.start, w.end)
    summaries.interval_rates(series, ("prompt_tokens", "generation_tokens"))


PAGES: dict[str, Callable[[str, Window], None]] = {
    "fleet": _fleet,
    "requests": _requests,
    "kv_transfer": _kv,
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
    def scan() -> Any:
        with engine_for(url).connect() as conn:
            return conn.execute(
                text(
                    "SELECT count(*), sum(ttft_s), max(e2e_s), sum(prompt_tokens) "
                    "FROM request_records NOT INDEXED"
                )
            ).one()

    return scan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--hours", type=float, default=6.0, help="history the requests are spread over")
    parser.add_argument(
        "--db", type=Path, default=None, help="SQLite file (reused when it already holds the seed)"
    )
    parser.add_argument("--reseed", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "dashboard.json")
    args = parser.parse_args(argv)
    logging.getLogger("streamlit").setLevel(logging.ERROR)

    db = args.db or Path(f"/tmp/pdscope-bench-dashboard-{args.requests}.db")
    url = f"sqlite:///{db}"
    spec = SeedSpec(
        end=time.time(),
        duration_s=args.hours * 3600.0,
        requests=args.requests,
        prefill=tuple(f"prefill-{i}" for i in range(4)),
        decode=tuple(f"decode-{i}" for i in range(8)),
    )
    seed_s = None
    if args.reseed or not db.exists():
        for suffix in ("", "-wal", "-shm"):
            Path(f"{db}{suffix}").unlink(missing_ok=True)
        print(f"seeding {args.requests:,} request records into {db} ...", flush=True)
        t0 = time.perf_counter()
        summary = seed_store(url, spec)
        seed_s = time.perf_counter() - t0
        print(
            f"  {summary.requests:,} requests, {summary.snapshots:,} snapshots in {seed_s:.1f} s", flush=True
        )
    engine = engine_for(url)
    with engine.connect() as conn:
        n_req = conn.execute(text("SELECT count(*) FROM request_records")).scalar_one()
        n_snap = conn.execute(text("SELECT count(*) FROM snapshots")).scalar_one()
    latest = data.latest_ts(url) or time.time()
    end = latest + 1.0

    baseline, baseline_cpu = _timed(_baseline(url), args.repeat)
    rows: list[dict[str, Any]] = []
    for page, fn in PAGES.items():
        for label, seconds in RANGES.items():
            w = Window(end - seconds, end)
            t, cpu = _timed(lambda fn=fn, w=w: fn(url, w), args.repeat)
            rows.append(
                {
                    "page": page,
                    "range": label,
                    "seconds": round(t, 4),
                    "cpu_seconds": round(cpu, 4),
                    "ratio_to_full_scan": round(t / baseline, 3),
                    "cpu_ratio_to_full_scan": round(cpu / max(baseline_cpu, 1e-9), 3),
                    "under_target": t < TARGET_S,
                }
            )

    print(f"\nstore: {n_req:,} request records, {n_snap:,} snapshots (SQLite)")
    print(
        f"baseline: full scan of request_records = {baseline * 1000:.0f} ms wall, "
        f"{baseline_cpu * 1000:.0f} ms CPU "
        f"(median of {args.repeat})\n"
    )
    print(f"{'page':<12}" + "".join(f"{'range ' + r + ' wall / CPU':>34}" for r in RANGES))
    for page in PAGES:
        cells = []
        for label in RANGES:
            r = next(x for x in rows if x["page"] == page and x["range"] == label)
            mark = "" if r["under_target"] else " !"
            cells.append(
                f"{r['seconds'] * 1000:6.0f} / {r['cpu_seconds'] * 1000:5.0f} ms "
                f"({r['ratio_to_full_scan']:5.2f}x){mark}"
            )
        print(f"{page:<12}" + "".join(f"{c:>34}" for c in cells))
    print(f"\n(x = page wall time / full-scan baseline wall time; ! = over the {TARGET_S:g} s target)")

    result = {
        "benchmark": "dashboard page query time",
        "store": {"backend": "sqlite", "request_records": n_req, "snapshots": n_snap, "path": str(db)},
        "seed_seconds": None if seed_s is None else round(seed_s, 1),
        "baseline": {
            "what": "full scan of request_records (count, sums; NOT INDEXED)",
            "seconds": round(baseline, 4),
            "cpu_seconds": round(baseline_cpu, 4),
        },
        "target_seconds": TARGET_S,
        "repeat": args.repeat,
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "pages": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
