"""A trace whose spans reach different collectors becomes exactly one correct request record.

Several collectors share one store and any of them takes any span (issue 16), so one trace's
spans may be written by two ``StoreSink`` objects (two collectors), in any split and order, and
at the same moment. The record must then be the one assembled from all the trace's spans at
once, one row per trace, nothing lost. Each "collector" here has its own engine, as two
processes would; the last test runs two ``pdscope collect`` processes.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from collector.assemble import assemble
from collector.otlp import SpanData, decode
from collector.record import ASSEMBLED_COLUMNS, ASSEMBLY_KEYS
from collector.sink import TRACE_LOCK_CLASS, StoreSink, WriteResult, trace_lock_key
from pdscope import semconv as sc
from pdscope.config import LatencySLO, SLOSettings
from store.db import make_engine, session_factory
from store.migrate import upgrade
from store.models import RequestRecord, SpanRow
from tests.collector.traces import request_spans, to_proto
from tests.support.sockets import closed_port_url, free_ports
from tests.support.waiting import wait_until

T0 = 1_800_000_000.0
SLO = SLOSettings(ttft=LatencySLO(target_ms=600), tpot=LatencySLO(target_ms=150))
PROTOBUF = "application/x-protobuf"
GROUPS = ("root", "children", "p_vllm", "d_vllm")


def _sink(url: str, **kwargs: Any) -> StoreSink:
    """One collector's sink: its own engine, as another process would have."""
    return StoreSink(session_factory(make_engine(url)), SLO, clock=lambda: T0 + 10, **kwargs)


def _groups(spans: Sequence[SpanData]) -> dict[str, list[SpanData]]:
    vllm = [s for s in spans if s.name == sc.VLLM_SPAN]
    assert len(vllm) == 2 and len(spans) == 7
    return {
        "root": [s for s in spans if s.name == sc.SPAN_REQUEST],
        "children": [s for s in spans if s.name not in (sc.SPAN_REQUEST, sc.VLLM_SPAN)],
        "p_vllm": vllm[:1],
        "d_vllm": vllm[1:],
    }


def _proxy_and_vllm(spans: Sequence[SpanData]) -> tuple[list[SpanData], list[SpanData]]:
    return [s for s in spans if s.name != sc.VLLM_SPAN], [s for s in spans if s.name == sc.VLLM_SPAN]


def _columns(rec: RequestRecord) -> dict[str, Any]:
    """Assembly's part of a stored record, column by column (its keys of ``attributes`` only)."""
    out = {name: getattr(rec, name) for name in ASSEMBLED_COLUMNS}
    out["attributes"] = {k: v for k, v in (rec.attributes or {}).items() if k in ASSEMBLY_KEYS}
    return out


def _expected(spans: Sequence[SpanData]) -> dict[str, Any]:
    """The record one sink writes when given all of the trace's spans at once."""
    a = assemble(spans, SLO)
    assert a is not None
    return a.row()


def _records(factory: sessionmaker[Session]) -> dict[str, list[RequestRecord]]:
    """Every stored record, by trace."""
    out: dict[str, list[RequestRecord]] = {}
    with factory() as s:
        for rec in s.scalars(select(RequestRecord)):
            out.setdefault(rec.trace_id or "", []).append(rec)
    return out


def _check(factory: sessionmaker[Session], traces: Sequence[Sequence[SpanData]]) -> None:
    """Exactly one record per trace, equal column by column to the one from all its spans; every
    span stored."""
    by_trace = _records(factory)
    assert sorted(by_trace) == sorted(t[0].trace_id for t in traces)
    wrong = []
    for spans in traces:
        recs = by_trace[spans[0].trace_id]
        assert len(recs) == 1, f"{len(recs)} records for trace {spans[0].trace_id}"
        got, want = _columns(recs[0]), _expected(spans)
        diff = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
        if diff:
            wrong.append(diff)
        assert recs[0].lease_expiry_suspect is False
    assert not wrong, f"{len(wrong)} of {len(traces)} records differ, e.g. (stored, expected): {wrong[0]}"
    with factory() as s:
        assert s.scalar(select(func.count()).select_from(SpanRow)) == sum(len(t) for t in traces)


def _ok(result: WriteResult, n: int) -> None:
    assert (result.written, result.failed, result.error) == (n, 0, None), result


# -- every split and order, one batch after another --------------------------------------------

# How one trace's spans are split into batches: each tuple is one batch, batch j going to
# collector j % 2. Every order of the four groups one at a time, and the usual splits.
SPLITS: list[tuple[tuple[str, ...], ...]] = [
    *(tuple((g,) for g in order) for order in itertools.permutations(GROUPS)),
    (("root", "children"), ("p_vllm", "d_vllm")),  # the proxy's export first, vLLM's later
    (("p_vllm", "d_vllm"), ("root", "children")),  # vLLM's first (the root comes last)
    (("root",), ("children",), ("p_vllm", "d_vllm")),  # vLLM's in a third batch
    (("p_vllm",), ("root", "children", "d_vllm")),
]


def test_a_trace_split_over_two_collectors_in_every_order_is_one_whole_record(store_url: str) -> None:
    upgrade(store_url)
    sinks = (_sink(store_url, shared=True), _sink(store_url, shared=True))
    traces = [request_spans(t0=T0 + k, request_id=f"split-{k}") for k in range(len(SPLITS))]
    whole = request_spans(t0=T0 + 100, request_id="whole")  # the control: one sink, all spans
    _ok(sinks[0].write(whole), 7)
    for step in range(max(len(split) for split in SPLITS)):  # every trace's batch ``step``
        batch = [
            s
            for spans, split in zip(traces, SPLITS, strict=True)
            if step < len(split)
            for g in split[step]
            for s in _groups(spans)[g]
        ]
        _ok(sinks[step % 2].write(batch), len(batch))
    _check(sinks[0].factory, [*traces, whole])


def test_alone_the_sink_still_merges_a_trace_over_its_own_batches(store_url: str) -> None:
    """One collector (``shared=False``, SQLite's default): the ``_seen`` shortcut still finds
    the trace's earlier spans, in every order."""
    upgrade(store_url)
    sink = _sink(store_url, shared=False)
    traces = [request_spans(t0=T0 + k, request_id=f"alone-{k}") for k in range(len(SPLITS))]
    for spans, split in zip(traces, SPLITS, strict=True):
        for part in split:
            batch = [s for g in part for s in _groups(spans)[g]]
            _ok(sink.write(batch), len(batch))
    _check(sink.factory, traces)


def test_sqlite_sink_is_alone_by_default_and_postgresql_is_shared(store_url: str) -> None:
    sink = _sink(store_url)
    assert sink.shared is (not store_url.startswith("sqlite"))


def test_a_resent_span_is_counted_once(store_url: str) -> None:
    upgrade(store_url)
    a, b = _sink(store_url, shared=True), _sink(store_url, shared=True)
    spans = request_spans(t0=T0, request_id="resent")
    proxy, vllm = _proxy_and_vllm(spans)
    _ok(a.write(proxy), len(proxy))
    _ok(b.write([*vllm, *vllm]), 4)  # the same export twice in one batch (an exporter's retry)
    _ok(a.write(vllm), 2)  # and once more, to the other collector
    with a.factory() as s:
        rec = s.scalars(select(RequestRecord)).one()
    assert _columns(rec) == _expected(spans) and rec.attributes["spans"] == 7


def test_a_reused_request_id_keeps_its_first_record_across_collectors(store_url: str) -> None:
    """A second trace under the same X-Request-Id never takes over the first one's record, even
    when its vLLM spans arrive later through the other collector."""
    upgrade(store_url)
    a, b = _sink(store_url, shared=True), _sink(store_url, shared=True)
    first = request_spans(t0=T0, request_id="dup", tokens=11)
    second = request_spans(t0=T0 + 5, request_id="dup", tokens=3, d="d1")
    first_proxy, first_vllm = _proxy_and_vllm(first)
    second_proxy, second_vllm = _proxy_and_vllm(second)
    _ok(a.write(first_proxy), 5)
    _ok(b.write(second_proxy), 5)  # the id is taken: no second record
    _ok(b.write(first_vllm), 2)  # the first trace's vLLM spans complete the first record
    _ok(a.write(second_vllm), 2)  # the second trace assembled again, last: still not its record
    with a.factory() as s:
        recs = list(s.scalars(select(RequestRecord)))
    assert len(recs) == 1
    assert _columns(recs[0]) == _expected(first)


# -- two transactions on one trace at the same moment ------------------------------------------


def test_a_collector_that_commits_second_reads_what_the_first_wrote(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Collector A has read the trace's stored spans (none) and not committed its root yet when
    collector B writes the trace's vLLM spans: B must wait for A, then read A's root and write
    the whole record. Without the lock B reads nothing, A writes a record of the root alone."""
    upgrade(store_url)
    a, b = _sink(store_url, shared=True), _sink(store_url, shared=True)
    spans = request_spans(t0=T0, request_id="race")
    proxy, vllm = _proxy_and_vllm(spans)
    a_read, release, b_locking = threading.Event(), threading.Event(), threading.Event()
    stored_spans, lock = a._stored_spans, b._lock

    def a_reads_then_waits(session: Session, traces: set[str]) -> dict[str, list[SpanData]]:
        out = stored_spans(session, traces)
        a_read.set()
        assert release.wait(30), "the test never released collector A"
        return out

    def b_locks(session: Session, traces: set[str]) -> None:
        b_locking.set()
        lock(session, traces)

    monkeypatch.setattr(a, "_stored_spans", a_reads_then_waits)
    monkeypatch.setattr(b, "_lock", b_locks)
    with ThreadPoolExecutor(2) as pool:
        a_done = pool.submit(a.write, proxy)
        wait_until("collector A to have read the stored spans", a_read.is_set)
        b_done = pool.submit(b.write, vllm)
        # B now waits for A's transaction (it locks the same trace), or, without a lock, ends
        wait_until("collector B to reach the trace's lock", lambda: b_locking.is_set() or b_done.done())
        release.set()
        _ok(a_done.result(timeout=30), 5)
        _ok(b_done.result(timeout=30), 2)
    _check(a.factory, [spans])


@pytest.mark.parametrize("store_url", [pytest.param("postgresql", marks=pytest.mark.pg)], indirect=True)
def test_trace_locks_are_transaction_advisory_locks_of_their_own_class(store_url: str) -> None:
    upgrade(store_url)
    sink = _sink(store_url)
    traces = {"ab" * 16, "cd" * 16}
    with sink.factory() as s, s.begin():
        sink._lock(s, traces)
        held = s.execute(
            text(
                "SELECT classid::int, objid::int, objsubid FROM pg_locks "
                "WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted"
            )
        ).all()
    # classid/objid are oids (unsigned); the two-int form is objsubid 2, apart from bigint keys
    assert sorted(held) == sorted((TRACE_LOCK_CLASS, trace_lock_key(t), 2) for t in traces)
    with sink.factory() as s:  # gone with the transaction
        assert s.scalar(text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'")) == 0


@pytest.mark.parametrize("store_url", [pytest.param("postgresql", marks=pytest.mark.pg)], indirect=True)
def test_a_collector_stopped_inside_its_transaction_stalls_the_others_only_so_long(store_url: str) -> None:
    """Collector A took a trace's lock and stopped (SIGSTOP) before it committed: PostgreSQL ends
    its session after ``lock_idle_s`` idle in the transaction, and B's batch of the trace goes on."""
    upgrade(store_url)
    a, b = _sink(store_url), _sink(store_url)
    a.lock_idle_s = 0.5
    spans = request_spans(t0=T0, request_id="stopped")
    proxy, vllm = _proxy_and_vllm(spans)
    held = a.factory()
    pool = ThreadPoolExecutor(1)
    try:
        held.begin()
        a._lock(held, {spans[0].trace_id})  # A holds the trace and goes quiet
        b_done = pool.submit(b.write, proxy)
        wait_until("collector B's batch", b_done.done, timeout_s=30)
        _ok(b_done.result(), 5)
        with pytest.raises(DBAPIError, match="idle-in-transaction timeout"):
            held.execute(text("SELECT 1"))
    finally:
        held.close()  # (after a failure: A's lock goes, B's batch ends)
        pool.shutdown(wait=True)
    _ok(a.write(vllm), 2)  # A's next batch is a new transaction on a fresh connection
    _check(b.factory, [spans])


def _split_between(
    traces: Sequence[Sequence[SpanData]],
) -> tuple[list[list[SpanData]], list[list[SpanData]]]:
    """Per trace, what collector A and collector B get: the proxy's spans to one, vLLM's to the
    other, alternating (so each collector gets roots first for half the traces, last for the rest)."""
    to_a, to_b = [], []
    for k, spans in enumerate(traces):
        proxy, vllm = _proxy_and_vllm(spans)
        to_a.append(proxy if k % 2 == 0 else vllm)
        to_b.append(vllm if k % 2 == 0 else proxy)
    return to_a, to_b


@pytest.mark.parametrize("store_url", [pytest.param("postgresql", marks=pytest.mark.pg)], indirect=True)
@pytest.mark.parametrize("order", ["same", "reverse"])
def test_two_collectors_writing_the_same_traces_at_once_on_postgresql(store_url: str, order: str) -> None:
    """300 traces, each split between two collectors that write at the same moment, batch by batch
    (in the same order of traces, or B in reverse): one whole record per trace, nothing lost."""
    upgrade(store_url)
    n, per_batch = 300, 10
    traces = [request_spans(t0=T0 + k * 0.01, request_id=f"{order}-{k}") for k in range(n)]
    to_a, to_b = _split_between(traces)
    if order == "reverse":
        to_b.reverse()
    sinks = (_sink(store_url), _sink(store_url))
    assert all(s.shared for s in sinks)
    start = threading.Barrier(2, timeout=30)

    def run(sink: StoreSink, parts: list[list[SpanData]]) -> list[WriteResult]:
        start.wait()
        return [
            sink.write([s for part in parts[i : i + per_batch] for s in part])
            for i in range(0, len(parts), per_batch)
        ]

    with ThreadPoolExecutor(2) as pool:
        results = [pool.submit(run, sinks[0], to_a), pool.submit(run, sinks[1], to_b)]
        done = [r for f in results for r in f.result(timeout=120)]
    assert sum(r.written for r in done) == 7 * n
    assert not [r for r in done if r.failed or r.error or r.assemble_errors]
    _check(sinks[0].factory, traces)


# -- two collector processes over OTLP/HTTP ------------------------------------------------------


@contextlib.contextmanager
def _collector_process(cfg: Path, port: int, log: Path) -> Iterator[str]:
    """``pdscope collect`` in its own process on ``port``; yields its base URL once it answers."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "pdscope.cli", "--config", str(cfg)),
                *("collect", "--port", str(port), "--no-migrate"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=out,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until(
                f"the collector on port {port} to answer /healthz",
                lambda: proc.poll() is not None or httpx.get(f"{url}/healthz", timeout=2).status_code > 0,
                timeout_s=60,
                every_s=0.1,
                ignore=(httpx.HTTPError,),
            )
            assert proc.poll() is None, log.read_text(errors="replace")[-2000:]
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _post_all(url: str, parts: list[list[SpanData]], per_export: int) -> None:
    with httpx.Client(base_url=url, timeout=30) as client:
        for i in range(0, len(parts), per_export):
            body = to_proto([s for part in parts[i : i + per_export] for s in part])
            r = client.post("/v1/traces", content=body, headers={"Content-Type": PROTOBUF})
            assert r.status_code == 200, r.text


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("store_url", [pytest.param("postgresql", marks=pytest.mark.pg)], indirect=True)
def test_two_collector_processes_on_postgresql_make_one_record_per_split_trace(
    store_url: str, tmp_path: Path
) -> None:
    upgrade(store_url)
    cfg = tmp_path / "pdscope.yaml"
    cfg.write_text(f"""
model: {{name: tiny, kv_bytes_per_token: 1024}}
pools:
  prefill: {{role: prefill, instances: [{{name: p0, url: "{closed_port_url()}"}}]}}
  decode: {{role: decode, instances: [{{name: d0, url: "{closed_port_url()}"}}]}}
store: {{url: "{store_url}"}}
slo: {{ttft: {{target_ms: 600}}, tpot: {{target_ms: 150}}}}
collector: {{scrape_interval_s: 1.0, scrape_timeout_s: 0.5}}
""")
    n = 120
    # as the collectors decode them (the expected records are assembled from these)
    traces = [decode(to_proto(request_spans(request_id=f"proc-{k}")), PROTOBUF) for k in range(n)]
    to_a, to_b = _split_between(traces)
    port_a, port_b = free_ports(2)
    factory = session_factory(make_engine(store_url))

    def whole() -> int:
        """Records built from all 7 spans of their trace."""
        return sum(1 for recs in _records(factory).values() for r in recs if r.attributes.get("spans") == 7)

    with (
        _collector_process(cfg, port_a, tmp_path / "a.log") as url_a,
        _collector_process(cfg, port_b, tmp_path / "b.log") as url_b,
        ThreadPoolExecutor(2) as pool,
    ):
        sent = [pool.submit(_post_all, url_a, to_a, 10), pool.submit(_post_all, url_b, to_b, 10)]
        for f in sent:
            f.result(timeout=60)
        seen = wait_until(f"{n} whole records", whole, done=lambda k: k >= n, timeout_s=60)
    assert seen == n
    _check(factory, traces)
