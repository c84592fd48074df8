"""Collector benchmarks: (a) scrape + parse + store cost per instance, (b) OTLP ingest spans/s.

(a) A page server in a separate process serves the two real vLLM captures (P and D) to
    N targets over HTTP; the collector's scraper scrapes all of them each round and the
    snapshot store writes each round to SQLite. The collector process's CPU time per
    instance per scrape gives the instances one core sustains at a 5 s interval. The
    baseline is the same loop with the stock ``prometheus_client`` parser in place of the
    hot path, measured in the same run. Per-stage parse times are printed beside it.
(b) OTLP ingest: protobuf exports of 7-span P/D traces are decoded and written by the
    store sink (spans inserted, request records assembled), in the receiver's batch size,
    into SQLite and into PostgreSQL (``--pg-url`` or ``$PDSCOPE_TEST_PG_URL``). The baseline
    is the same pipeline writing spans as ORM objects (``session.add_all``). Each ingest
    runs ``--repeat`` times on a fresh store; the best run is reported (the machine is shared).

Usage: ``.venv/bin/python bench/collector.py [--targets 200] [--rounds 10] [--traces 3000]``.
Prints a table and writes ``bench/results/collector.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import collector.scraper as scraper_mod  # noqa: E402
from collector.fastparse import extract_signals  # noqa: E402
from collector.otlp import SpanData, decode  # noqa: E402
from collector.parse import Family, ParsedPage, Sample, parse_text  # noqa: E402
from collector.scraper import PerOriginTransport, Scraper, ScrapeResult  # noqa: E402
from collector.signals import Signals, from_page  # noqa: E402
from collector.sink import EVENTS_KEY, StoreSink, WriteResult, span_row  # noqa: E402
from collector.snapshot_store import SnapshotStore  # noqa: E402
from collector.targets import Target  # noqa: E402
from pdscope.config import SLOSettings  # noqa: E402
from store.db import make_engine, session_factory, transaction  # noqa: E402
from store.migrate import upgrade  # noqa: E402
from store.models import SpanRow  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures" / "vllm-0.32-cpu"  # the pages tests/captures.py names
INTERVAL_S = 5.0

SERVER = (
    r"""
import asyncio, sys
pages = {b"p": open(sys.argv[1], "rb").read(), b"d": open(sys.argv[2], "rb").read()}
async def handle(reader, writer):
    try:
        while True:
            req = await reader.readuntil(b"\r\n\r\n")
            body = pages[req.split(b" ", 2)[1][1:2]]
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"""
    r"""Content-Length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()
    except Exception:
        pass
    finally:
        writer.close()
async def main():
    servers = [await asyncio.start_server(handle, "127.0.0.1", 0) for _ in range(int(sys.argv[3]))]
    print(" ".join(str(srv.sockets[0].getsockname()[1]) for srv in servers), flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""
)


# -- (a) scrape + parse + store ---------------------------------------------------------------


def prometheus_client_signals(data: str | bytes) -> Signals:
    """The baseline extraction: prometheus_client's parser, then the same signal table."""
    text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
    families = {}
    for fam in text_string_to_metric_families(text):
        samples = tuple(Sample(s.name, dict(s.labels), s.value) for s in fam.samples)
        families[fam.name] = Family(fam.name, fam.type, fam.documentation, samples)
    return from_page(ParsedPage(families, []))


def per_page_ms(fn: Callable[[], object], reps: int = 50) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        for _ in range(reps):
            fn()
        best = min(best, (time.process_time() - start) / reps)
    return best * 1000


async def scrape_store_cpu(
    ports: list[int], n_targets: int, rounds: int, db_url: str, extractor: Callable[[bytes], Signals]
) -> dict[str, float]:
    """CPU seconds of this process per instance-scrape, for the full scrape+parse+store loop."""
    upgrade(db_url)
    store = SnapshotStore(session_factory(make_engine(db_url)))
    targets = [
        Target(
            f"i{i}",
            "pd",
            "decode" if i % 2 else "prefill",
            "http://x",
            f"http://127.0.0.1:{ports[i]}/{'d' if i % 2 else 'p'}/metrics",
        )
        for i in range(n_targets)
    ]
    store.ensure_instances(targets, time.time())
    original = scraper_mod.extract_signals
    scraper_mod.extract_signals = extractor  # type: ignore[assignment]
    try:
        async with httpx.AsyncClient(timeout=10.0, transport=PerOriginTransport()) as client:

            async def noop(_results: list[ScrapeResult]) -> None:
                return None

            scraper = Scraper(
                targets,
                client,
                interval_s=30.0,
                timeout_s=20.0,
                max_body_bytes=8 * 2**20,
                on_round=noop,
                jitter_s=0.0,
            )
            await scraper.scrape_round()  # warm: connections, imports
            cpu = wall = 0.0
            down = 0
            for _ in range(rounds):
                c0, w0 = time.process_time(), time.perf_counter()
                results = await scraper.scrape_round()
                store.write_round(results)
                cpu += time.process_time() - c0
                wall += time.perf_counter() - w0
                down += sum(1 for r in results if not r.up)
    finally:
        scraper_mod.extract_signals = original
    if down:
        raise RuntimeError(f"{down} scrapes failed during the benchmark")
    n = n_targets * rounds
    return {"cpu_ms_per_scrape": cpu / n * 1000, "wall_s_per_round": wall / rounds}


# -- (b) OTLP ingest ---------------------------------------------------------------------------


class OrmSink(StoreSink):
    """Baseline: the same sink, spans written as ORM objects (``session.add_all``)."""

    def write(self, batch: Sequence[SpanData]) -> WriteResult:
        now = self.clock()
        with transaction(self.factory) as session:
            stored = self._stored_spans(session, {s.trace_id for s in batch})
            objs = []
            for s in batch:
                row = span_row(s, now)
                attrs = dict(s.attributes)
                if s.events:
                    attrs[EVENTS_KEY] = [{"name": n, "ts": ts} for n, ts, _ in s.events]
                row["attributes"] = attrs
                objs.append(SpanRow(**row))
            session.add_all(objs)
            session.flush()
            records = self._assemble(session, batch, stored)
        return WriteResult(len(batch), records=records)


def ingest_spans_per_s(
    url: str, exports: list[bytes], sink_cls: type[StoreSink], batch_size: int = 2000
) -> tuple[float, float, int]:
    """(spans per wall second, spans per second of this process's CPU, records assembled)."""
    upgrade(url)
    sink = sink_cls(session_factory(make_engine(url)), SLOSettings())
    pending: list[SpanData] = []
    total = records = 0
    start, cpu0 = time.perf_counter(), time.process_time()
    for body in exports:
        pending.extend(decode(body, "application/x-protobuf"))
        while len(pending) >= batch_size:
            res = sink.write(pending[:batch_size])
            total += res.written
            records += res.records
            del pending[:batch_size]
    if pending:
        res = sink.write(pending)
        total += res.written
        records += res.records
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu0
    return total / elapsed, total / cpu, records


def make_exports(n_traces: int, per_export: int = 100) -> list[bytes]:
    from tests.collector.traces import request_spans, to_proto

    exports = []
    for start in range(0, n_traces, per_export):
        spans = [
            s
            for i in range(start, min(start + per_export, n_traces))
            for s in request_spans(t0=1.8e9 + i * 0.01, request_id=f"b{i}")
        ]
        exports.append(to_proto(spans))
    return exports


def reset_pg(url: str) -> None:
    import psycopg

    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")


def pg_database(admin_url: str) -> str:
    import psycopg

    name = f"pdscope_bench_{os.getpid()}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"{admin_url.rsplit('/', 1)[0]}/{name}"


def drop_pg_database(admin_url: str, url: str) -> None:
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)')


# -- main --------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--traces", type=int, default=3000)
    ap.add_argument("--repeat", type=int, default=3, help="ingest runs per store; the best is reported")
    ap.add_argument("--pg-url", default=os.environ.get("PDSCOPE_TEST_PG_URL"))
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "collector.json"))
    args = ap.parse_args(argv)

    d_page = (FIXTURES / "decode_metrics.txt").read_bytes()
    parse_ms = {
        "prometheus_client": per_page_ms(lambda: list(text_string_to_metric_families(d_page.decode()))),
        "prometheus_client + signals": per_page_ms(lambda: prometheus_client_signals(d_page)),
        "collector.parse (general)": per_page_ms(lambda: parse_text(d_page)),
        "collector.fastparse (hot path)": per_page_ms(lambda: extract_signals(d_page)),
    }

    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SERVER,
            str(FIXTURES / "prefill_metrics.txt"),
            str(FIXTURES / "decode_metrics.txt"),
            str(args.targets),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        ports = [int(p) for p in server.stdout.readline().split()]
        with tempfile.TemporaryDirectory() as tmp:
            fast = asyncio.run(
                scrape_store_cpu(
                    ports, args.targets, args.rounds, f"sqlite:///{tmp}/fast.db", extract_signals
                )
            )
            base = asyncio.run(
                scrape_store_cpu(
                    ports, args.targets, args.rounds, f"sqlite:///{tmp}/base.db", prometheus_client_signals
                )
            )
    finally:
        server.terminate()
        server.wait(timeout=10)
    ipc = INTERVAL_S * 1000 / fast["cpu_ms_per_scrape"]
    ipc_base = INTERVAL_S * 1000 / base["cpu_ms_per_scrape"]

    exports = make_exports(args.traces)
    n_spans = args.traces * 7
    # (wall spans/s, spans per CPU second of this process) per store, pdscope sink and baseline
    spans: dict[str, tuple[float, float] | None] = {}
    baseline_spans: dict[str, tuple[float, float] | None] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, sink_cls, into in (("spans", StoreSink, spans), ("orm", OrmSink, baseline_spans)):
            runs = [
                ingest_spans_per_s(f"sqlite:///{tmp}/{name}{k}.db", exports, sink_cls)
                for k in range(args.repeat)
            ]
            assert all(r[2] >= args.traces for r in runs), runs
            into["sqlite"] = (max(r[0] for r in runs), max(r[1] for r in runs))
    if args.pg_url:
        url = pg_database(args.pg_url)
        try:
            for sink_cls, into in ((StoreSink, spans), (OrmSink, baseline_spans)):
                runs = []
                for _ in range(args.repeat):
                    reset_pg(url)
                    runs.append(ingest_spans_per_s(url, exports, sink_cls))
                into["postgresql"] = (max(r[0] for r in runs), max(r[1] for r in runs))
        finally:
            drop_pg_database(args.pg_url, url)
    else:
        spans["postgresql"] = baseline_spans["postgresql"] = None
        print(
            "!! no PostgreSQL URL (--pg-url or $PDSCOPE_TEST_PG_URL): postgresql ingest not measured",
            file=sys.stderr,
        )

    rows = [("(a) parse one 60 KiB vLLM page", "ms CPU", "")]
    for k, v in parse_ms.items():
        rows.append((f"    {k}", f"{v:.2f}", f"{parse_ms['prometheus_client'] / v:.1f}x"))
    rows += [
        (f"(a) scrape+parse+store, {args.targets} targets x {args.rounds} rounds", "ms CPU/instance", ""),
        ("    baseline: prometheus_client parser", f"{base['cpu_ms_per_scrape']:.2f}", "1.0x"),
        (
            "    pdscope hot path",
            f"{fast['cpu_ms_per_scrape']:.2f}",
            f"{base['cpu_ms_per_scrape'] / fast['cpu_ms_per_scrape']:.1f}x",
        ),
        ("    instances per core at 5 s (baseline)", f"{ipc_base:.0f}", ""),
        ("    instances per core at 5 s (pdscope)", f"{ipc:.0f}", f"{ipc / ipc_base:.1f}x"),
        (f"(b) OTLP ingest, {n_spans} spans ({args.traces} traces)", "spans/s", ""),
    ]
    for db in ("sqlite", "postgresql"):
        got, base_db = spans[db], baseline_spans[db]
        if got is None or base_db is None:
            rows.append((f"    {db}", "not measured", ""))
            continue
        rows.append(
            (
                f"    {db}, baseline ORM objects: per CPU s / wall",
                f"{base_db[1]:.0f} / {base_db[0]:.0f}",
                "1.0x",
            )
        )
        rows.append(
            (
                f"    {db}, pdscope sink: per CPU s / wall",
                f"{got[1]:.0f} / {got[0]:.0f}",
                f"{got[1] / base_db[1]:.1f}x",
            )
        )
    load = os.getloadavg()[0]
    rows.append((f"(machine: {os.cpu_count()} CPUs, load average {load:.1f} during the run)", "", ""))
    width = max(len(r[0]) for r in rows)
    print(f"{'collector benchmark':<{width}}  {'value':>16}  {'vs baseline':>11}")
    for name, value, ratio in rows:
        print(f"{name:<{width}}  {value:>16}  {ratio:>11}")

    result = {
        "instances_per_core": round(ipc),
        "instances_per_core_baseline_prometheus_client": round(ipc_base),
        "cpu_ms_per_instance_scrape": round(fast["cpu_ms_per_scrape"], 3),
        "cpu_ms_per_instance_scrape_baseline": round(base["cpu_ms_per_scrape"], 3),
        "parse_ms_per_page": {k: round(v, 3) for k, v in parse_ms.items()},
        # spans per second of the collector process's CPU (SQLite runs in-process, so that is
        # all of the work there; PostgreSQL's server CPU is not in it), and per wall second
        "spans_per_s": {k: (round(v[1]) if v else None) for k, v in spans.items()},
        "spans_per_s_wall": {k: (round(v[0]) if v else None) for k, v in spans.items()},
        "spans_per_s_baseline_orm": {k: (round(v[1]) if v else None) for k, v in baseline_spans.items()},
        "load_average": round(load, 1),
        "params": {
            "targets": args.targets,
            "rounds": args.rounds,
            "traces": args.traces,
            "interval_s": INTERVAL_S,
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
