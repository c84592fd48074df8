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
    The merge of a trace split over collectors (issue 16) is measured beside it, same run: the
    sink as it was before (no trace locks, stored spans read only for traces it wrote: one
    process), the sink alone (trace locks, the same shortcut: SQLite's default) and shared
    (trace locks, stored spans read for every trace of every batch: PostgreSQL's default).
(c) 1 vs 2 collectors on PostgreSQL: each collector a process with its own engine and shared
    sink; every trace split between the two (the proxy's spans to one, vLLM's to the other, so
    every record is merged across collectors), against one collector given all the same
    exports. Spans per wall second from the start of both to the end of the last, with the
    check that every trace ended as one whole record. ``--fleet-traces`` bounds it (21,000
    spans by default).

Usage: ``.venv/bin/python bench/collector.py [--targets 200] [--rounds 10] [--traces 3000]
[--parts a,b,c]``. Prints a table and writes ``bench/results/collector.json``; a run of only
some parts keeps the other parts' figures of the file it replaces.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from sqlalchemy import func, select  # noqa: E402
from sqlalchemy.orm import Session, sessionmaker  # noqa: E402

import collector.scraper as scraper_mod  # noqa: E402
from collector.fastparse import extract_signals  # noqa: E402
from collector.otlp import SpanData, decode  # noqa: E402
from collector.parse import Family, ParsedPage, Sample, parse_text  # noqa: E402
from collector.scraper import PerOriginTransport, Scraper, ScrapeResult  # noqa: E402
from collector.signals import Signals, from_page  # noqa: E402
from collector.sink import EVENTS_KEY, StoreSink, WriteResult, span_row  # noqa: E402
from collector.snapshot_store import SnapshotStore  # noqa: E402
from collector.targets import ScrapeTarget  # noqa: E402
from pdscope.config import SLOSettings  # noqa: E402
from store.db import make_engine, session_factory, transaction  # noqa: E402
from store.migrate import upgrade  # noqa: E402
from store.models import RequestRecord, SpanRow  # noqa: E402

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
        ScrapeTarget(
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
            self._lock(session, {s.trace_id for s in batch})
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
            records, _, _ = self._assemble(session, batch, stored)
        return WriteResult(len(batch), records=records)


class BeforeSink(StoreSink):
    """The sink before issue 16: no trace lock, stored spans read only for traces it wrote
    (correct for one collector process only)."""

    def __init__(self, factory: sessionmaker[Session], slo: SLOSettings) -> None:
        super().__init__(factory, slo, shared=False)

    def _lock(self, session: Session, traces: set[str]) -> None:
        return None


SinkMaker = Callable[[sessionmaker[Session]], StoreSink]
# (b): the sinks measured, by name: what each costs
INGEST_SINKS: dict[str, SinkMaker] = {
    "before": lambda f: BeforeSink(f, SLOSettings()),
    "alone": lambda f: StoreSink(f, SLOSettings(), shared=False),
    "shared": lambda f: StoreSink(f, SLOSettings(), shared=True),
    "orm": lambda f: OrmSink(f, SLOSettings(), shared=True),
}


def ingest_spans_per_s(
    url: str, exports: list[bytes], make_sink: SinkMaker, batch_size: int = 2000
) -> tuple[float, float, int]:
    """(spans per wall second, spans per second of this process's CPU, records assembled)."""
    upgrade(url)
    sink = make_sink(session_factory(make_engine(url)))
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


# -- (c) 1 vs 2 collectors on PostgreSQL ----------------------------------------------------------


def split_exports(
    n_traces: int, collectors: int, *, split: bool = True, per_export: int = 100
) -> list[list[bytes]]:
    """Each collector's exports. With 2 and ``split``, trace k's proxy spans go to collector k % 2
    and its vLLM spans to the other; not ``split``, trace k goes whole to collector k % 2. With 1,
    the one collector gets both lists, interleaved (the same work)."""
    from pdscope import semconv as sc
    from tests.collector.traces import request_spans, to_proto

    parts: list[list[list[SpanData]]] = [[], []]
    for i in range(n_traces):
        spans = request_spans(t0=1.8e9 + i * 0.01, request_id=f"f{i}")
        if split:
            parts[i % 2].append([s for s in spans if s.name != sc.VLLM_SPAN])
            parts[1 - i % 2].append([s for s in spans if s.name == sc.VLLM_SPAN])
        else:
            parts[i % 2].append(spans)
    per: list[list[bytes]] = [
        [
            to_proto([s for part in mine[k : k + per_export] for s in part])
            for k in range(0, len(mine), per_export)
        ]
        for mine in parts
    ]
    if collectors == 2:
        return per
    return [[body for pair in zip(per[0], per[1], strict=False) for body in pair]]


def _collector_process(url: str, exports: list[bytes], start: Any, out: Any, batch_size: int = 2000) -> None:
    """One collector: decode its exports and write them through its own shared sink."""
    engine = make_engine(url)
    with engine.connect():  # connected before the start
        pass
    sink = StoreSink(session_factory(engine), SLOSettings(), shared=True)
    start.wait()
    t0, cpu0 = time.monotonic(), time.process_time()
    written = failed = 0
    pending: list[SpanData] = []
    for k, body in enumerate(exports):
        pending.extend(decode(body, "application/x-protobuf"))
        while pending and (len(pending) >= batch_size or k == len(exports) - 1):
            res = sink.write(pending[:batch_size])
            written, failed = written + res.written, failed + res.failed
            del pending[:batch_size]
    out.put((t0, time.monotonic(), time.process_time() - cpu0, written, failed))
    engine.dispose()


def collectors_spans_per_s(
    url: str, n_traces: int, collectors: int, *, split: bool = True
) -> dict[str, float]:
    """Spans per wall second (and per collector-CPU second) of ``collectors`` processes."""
    reset_pg(url)
    upgrade(url)
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(collectors), ctx.Queue()
    procs = [
        ctx.Process(target=_collector_process, args=(url, exports, start, out), daemon=True)
        for exports in split_exports(n_traces, collectors, split=split)
    ]
    for p in procs:
        p.start()
    got: list[tuple[float, float, float, int, int]] = []
    deadline = time.monotonic() + 600
    while len(got) < len(procs):
        try:
            got.append(out.get(timeout=1.0))
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(
                    f"a collector process failed (exit codes {failed}) or ran past 600 s"
                ) from None
    for p in procs:
        p.join(60)
    t0, t1 = min(g[0] for g in got), max(g[1] for g in got)
    written, failed = sum(g[3] for g in got), sum(g[4] for g in got)
    factory = session_factory(make_engine(url))
    with factory() as s:
        records = s.scalar(select(func.count()).select_from(RequestRecord))
        whole = s.scalar(
            select(func.count())
            .select_from(RequestRecord)
            .where(RequestRecord.attributes["spans"].as_integer() == 7)
        )
    if failed or written != 7 * n_traces or records != n_traces or whole != n_traces:
        raise RuntimeError(
            f"{collectors} collectors: {written} spans written, {failed} failed, "
            f"{records} records, {whole} whole, for {n_traces} traces"
        )
    return {"spans_per_s": written / (t1 - t0), "spans_per_cpu_s": written / sum(g[2] for g in got)}


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


def _parse_ms(d_page: bytes) -> dict[str, float]:
    return {
        "prometheus_client": per_page_ms(lambda: list(text_string_to_metric_families(d_page.decode()))),
        "prometheus_client + signals": per_page_ms(lambda: prometheus_client_signals(d_page)),
        "collector.parse (general)": per_page_ms(lambda: parse_text(d_page)),
        "collector.fastparse (hot path)": per_page_ms(lambda: extract_signals(d_page)),
    }


def _scrape_store(args: argparse.Namespace) -> tuple[dict[str, float], dict[str, float]]:
    """The scrape+parse+store loop against a page server, with the hot path and with the baseline."""
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
    return fast, base


def part_a(args: argparse.Namespace) -> tuple[list[tuple[str, str, str]], dict[str, Any]]:
    """(a) parse, and scrape + parse + store: table rows and JSON keys."""
    parse_ms = _parse_ms((FIXTURES / "decode_metrics.txt").read_bytes())
    fast, base = _scrape_store(args)
    ipc = INTERVAL_S * 1000 / fast["cpu_ms_per_scrape"]
    ipc_base = INTERVAL_S * 1000 / base["cpu_ms_per_scrape"]
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
    ]
    result = {
        "instances_per_core": round(ipc),
        "instances_per_core_baseline_prometheus_client": round(ipc_base),
        "cpu_ms_per_instance_scrape": round(fast["cpu_ms_per_scrape"], 3),
        "cpu_ms_per_instance_scrape_baseline": round(base["cpu_ms_per_scrape"], 3),
        "parse_ms_per_page": {k: round(v, 3) for k, v in parse_ms.items()},
    }
    return rows, result


def _best(runs: list[tuple[float, float, int]], traces: int) -> tuple[float, float]:
    assert all(r[2] >= traces for r in runs), runs
    return max(r[0] for r in runs), max(r[1] for r in runs)


# store -> sink name -> (wall spans/s, spans per CPU second of this process)
_Ingest = dict[str, dict[str, tuple[float, float]]]
_DEFAULT_SINK = {"sqlite": "alone", "postgresql": "shared"}  # what the collector runs on each store


def _ingest(args: argparse.Namespace, exports: list[bytes]) -> _Ingest:
    """Every sink on SQLite, and on PostgreSQL with ``--pg-url``; the best of ``--repeat`` runs each."""
    got: _Ingest = {}
    # each round runs every sink once, so that a change in the machine's load hits them alike
    with tempfile.TemporaryDirectory() as tmp:
        runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in INGEST_SINKS}
        for k in range(args.repeat):
            for name, make in INGEST_SINKS.items():
                runs[name].append(ingest_spans_per_s(f"sqlite:///{tmp}/{name}{k}.db", exports, make))
        got["sqlite"] = {name: _best(r, args.traces) for name, r in runs.items()}
    if args.pg_url:
        url = pg_database(args.pg_url)
        try:
            runs = {name: [] for name in INGEST_SINKS}
            for _ in range(args.repeat):
                for name, make in INGEST_SINKS.items():
                    reset_pg(url)
                    runs[name].append(ingest_spans_per_s(url, exports, make))
            got["postgresql"] = {name: _best(r, args.traces) for name, r in runs.items()}
        finally:
            drop_pg_database(args.pg_url, url)
    else:
        print(
            "!! no PostgreSQL URL (--pg-url or $PDSCOPE_TEST_PG_URL): postgresql ingest not measured",
            file=sys.stderr,
        )
    return got


def _ingest_rows(db: str, got: _Ingest) -> list[tuple[str, str, str]]:
    """One store's rows of the (b) table."""
    if db not in got:
        return [(f"    {db}", "not measured", "")]
    orm, before = got[db]["orm"], got[db]["before"]
    mine = got[db][_DEFAULT_SINK[db]]
    rows = [
        (f"    {db}, baseline ORM objects: per CPU s / wall", f"{orm[1]:.0f} / {orm[0]:.0f}", "1.0x"),
        (
            f"    {db}, pdscope sink: per CPU s / wall",
            f"{mine[1]:.0f} / {mine[0]:.0f}",
            f"{mine[1] / orm[1]:.1f}x",
        ),
    ]
    for name, what in (
        ("before", "before issue 16 (no lock, one process)"),
        ("alone", "trace locks, one collector"),
        ("shared", "trace locks, shared (reads every trace)"),
    ):
        v = got[db][name]
        rows.append(
            (f"      {what}: per CPU s / wall", f"{v[1]:.0f} / {v[0]:.0f}", f"{v[0] / before[0]:.2f}x wall")
        )
    return rows


def part_b(args: argparse.Namespace) -> tuple[list[tuple[str, str, str]], dict[str, Any]]:
    """(b) OTLP ingest per store and sink: table rows and JSON keys."""
    got = _ingest(args, make_exports(args.traces))
    default = _DEFAULT_SINK
    rows = [(f"(b) OTLP ingest, {args.traces * 7} spans ({args.traces} traces)", "spans/s", "")]
    for db in ("sqlite", "postgresql"):
        rows += _ingest_rows(db, got)
    result = {
        # spans per second of the collector process's CPU (SQLite runs in-process, so that is
        # all of the work there; PostgreSQL's server CPU is not in it), and per wall second,
        # with the sink each store runs by default (SQLite: alone; PostgreSQL: shared)
        "spans_per_s": {db: (round(got[db][default[db]][1]) if db in got else None) for db in default},
        "spans_per_s_wall": {db: (round(got[db][default[db]][0]) if db in got else None) for db in default},
        "spans_per_s_baseline_orm": {db: (round(got[db]["orm"][1]) if db in got else None) for db in default},
        # the split-trace merge's cost (issue 16), same run: spans per CPU s and per wall s by sink
        "spans_per_s_by_sink": {
            db: {name: round(v[1]) for name, v in got[db].items() if name != "orm"} for db in got
        },
        "spans_per_s_wall_by_sink": {
            db: {name: round(v[0]) for name, v in got[db].items() if name != "orm"} for db in got
        },
    }
    return rows, result


def part_c(args: argparse.Namespace) -> tuple[list[tuple[str, str, str]], dict[str, Any]]:
    """(c) 1 vs 2 collectors on PostgreSQL: table rows and JSON keys."""
    if not args.pg_url:
        print("!! no PostgreSQL URL: 1 vs 2 collectors not measured", file=sys.stderr)
        return [("(c) 1 vs 2 collectors on PostgreSQL", "not measured", "")], {}
    url = pg_database(args.pg_url)
    best: dict[str, dict[str, float]] = {}
    try:
        for _ in range(args.repeat):
            for key, n, split in (("1", 1, True), ("2", 2, True), ("2_unsplit", 2, False)):
                run = collectors_spans_per_s(url, args.fleet_traces, n, split=split)
                if key not in best or run["spans_per_s"] > best[key]["spans_per_s"]:
                    best[key] = run
    finally:
        drop_pg_database(args.pg_url, url)
    one = best["1"]["spans_per_s"]
    rows = [
        (f"(c) {args.fleet_traces * 7} spans over collectors (PostgreSQL)", "spans/s wall", ""),
        ("    1 collector", f"{one:.0f}", "1.0x"),
        ("    2 collectors, every trace split over both", f"{best['2']['spans_per_s']:.0f}", ""),
        ("    2 collectors, each trace whole at one", f"{best['2_unsplit']['spans_per_s']:.0f}", ""),
    ]
    rows[2] = (*rows[2][:2], f"{best['2']['spans_per_s'] / one:.2f}x")
    rows[3] = (*rows[3][:2], f"{best['2_unsplit']['spans_per_s'] / one:.2f}x")
    result = {
        # "2": every trace split over the two collectors; "2_unsplit": each trace whole at one
        "collectors_spans_per_s": {k: round(v["spans_per_s"]) for k, v in best.items()},
        "collectors_spans_per_cpu_s": {k: round(v["spans_per_cpu_s"]) for k, v in best.items()},
        "collectors_speedup": round(best["2"]["spans_per_s"] / one, 2),
    }
    return rows, result


def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, set[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--traces", type=int, default=3000)
    ap.add_argument("--fleet-traces", type=int, default=3000, help="(c): traces, 7 spans each")
    ap.add_argument("--repeat", type=int, default=3, help="ingest runs per store; the best is reported")
    ap.add_argument(
        "--parts", default="a,b,c", help="which parts to run (a: scrape, b: ingest, c: collectors)"
    )
    ap.add_argument("--pg-url", default=os.environ.get("PDSCOPE_TEST_PG_URL"))
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "collector.json"))
    args = ap.parse_args(argv)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or parts - {"a", "b", "c"}:
        ap.error(f"--parts: a comma-separated subset of a,b,c, not {args.parts!r}")
    return args, parts


def _print_table(rows: list[tuple[str, str, str]]) -> None:
    width = max(len(r[0]) for r in rows)
    print(f"{'collector benchmark':<{width}}  {'value':>16}  {'vs baseline':>11}")
    for name, value, ratio in rows:
        print(f"{name:<{width}}  {value:>16}  {ratio:>11}")


def _merged(
    args: argparse.Namespace, parts: set[str], previous: dict[str, Any], result: dict[str, Any], load: float
) -> dict[str, Any]:
    """This run's figures over those of the file it replaces (the parts not run keep theirs)."""
    params = {
        "targets": args.targets,
        "rounds": args.rounds,
        "traces": args.traces,
        "fleet_traces": args.fleet_traces,
        "interval_s": INTERVAL_S,
    }
    earlier = previous.get("load_average_by_part") or {
        p: previous["load_average"] for p in "abc" if "load_average" in previous
    }
    loads = {**earlier, **{p: round(load, 1) for p in sorted(parts)}}
    return {
        **previous,
        **result,
        "load_average": round(load, 1),  # this run's
        "load_average_by_part": loads,  # the run each part's figures come from
        "params": {**previous.get("params", {}), **params},
    }


def main(argv: Sequence[str] | None = None) -> int:
    args, parts = _parse(argv)
    out = Path(args.out)
    previous: dict[str, Any] = {}
    if parts != {"a", "b", "c"} and out.exists():  # keep the figures of the parts not run
        previous = json.loads(out.read_text())
    rows: list[tuple[str, str, str]] = []
    result: dict[str, Any] = {}
    for name, part in (("a", part_a), ("b", part_b), ("c", part_c)):
        if name in parts:
            part_rows, part_result = part(args)
            rows += part_rows
            result.update(part_result)
    load = os.getloadavg()[0]
    rows.append((f"(machine: {os.cpu_count()} CPUs, load average {load:.1f} during the run)", "", ""))
    _print_table(rows)
    result = _merged(args, parts, previous, result, load)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
