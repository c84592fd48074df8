"""Issue 13, collector side: hostile or broken OTLP input, background-task faults, bounds.

Each test names the defect it pins down; each fails on the code before the fix.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import json
import logging
import math
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from collector.assemble import assemble
from collector.health import TaskHealth
from collector.ingest import SpanLimits, admit
from collector.otlp import SpanData, SpanEvent, inflate
from collector.receiver import ByteBudget, ReceiverConfig, SpanBatcher, build_app
from collector.retention import Retention
from collector.selfmetrics import CollectorMetrics
from collector.sink import StoreSink, WriteResult
from collector.spool import Spool
from pdscope import semconv as sc
from pdscope.config import ConfigError, LatencySLO, SLOSettings, parse_config
from store.db import make_engine, session_factory
from store.migrate import upgrade
from store.models import RequestRecord, RequestRollup, Snapshot, SnapshotRollup
from tests.collector.traces import request_spans, take, to_json, to_proto
from tests.support.waiting import async_wait_until

PROTO = "application/x-protobuf"
SLO = SLOSettings(ttft=LatencySLO(target_ms=600), tpot=LatencySLO(target_ms=150))


def _client(
    queue: Spool,
    metrics: CollectorMetrics,
    config: ReceiverConfig | None = None,
    health: TaskHealth | None = None,
) -> httpx.AsyncClient:
    app = build_app(queue, metrics, config, health=health)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://collector")


def _with(span: SpanData, **changes: Any) -> SpanData:
    return dataclasses.replace(span, **changes)


def _root_attrs(spans: list[SpanData], **attrs: Any) -> list[SpanData]:
    return [_with(s, attributes={**s.attributes, **attrs}) if s.name == sc.SPAN_REQUEST else s for s in spans]


def _metric(metrics: CollectorMetrics, line: str) -> bool:
    return line in metrics.exposition().decode()


# -- item 1: non-finite numbers; background tasks never die silently ------------------------


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, "inf", "nan", "-Infinity"])
def test_non_finite_numbers_are_absent_not_a_crash(bad: object) -> None:
    spans = _root_attrs(
        request_spans(), **{sc.KV_BLOCKS: bad, sc.KV_BYTES: bad, sc.HTTP_STATUS: bad, sc.RETRIES: bad}
    )
    spans = [
        _with(s, attributes={**s.attributes, sc.GEN_AI_QUEUE: bad, sc.GEN_AI_COMPLETION_TOKENS: bad})
        if s.name == sc.VLLM_SPAN
        else s
        for s in spans
    ]
    rec = assemble(spans, SLO)
    assert rec is not None
    v = rec.row()
    assert v["kv_blocks"] is None and v["kv_bytes"] is None and v["http_status"] is None and v["retries"] == 0
    assert v["d_queue_s"] is None and v["p_queue_s"] is None
    assert all(not isinstance(x, float) or math.isfinite(x) for x in v.values())


def test_integers_past_their_column_are_absent() -> None:
    v = assemble(_root_attrs(request_spans(), **{sc.KV_BLOCKS: 2**40, sc.KV_BYTES: 2**70}), SLO).row()  # type: ignore[union-attr]
    assert v["kv_blocks"] is None and v["kv_bytes"] is None


class FlakySink:
    """Raises on the first write (a bug in a sink), then works."""

    def __init__(self) -> None:
        self.calls = 0
        self.written: list[SpanData] = []

    def write(self, batch: Sequence[SpanData]) -> WriteResult:
        self.calls += 1
        if self.calls == 1:
            raise OverflowError("cannot convert float infinity to integer")
        self.written.extend(batch)
        return WriteResult(len(batch))


async def test_span_writer_survives_a_raising_sink_retries_and_counts_it() -> None:
    # a sink that raises once: counted, and the batch written on the next try (was: dropped)
    queue, metrics, sink = Spool.memory(1000), CollectorMetrics(), FlakySink()
    health = TaskHealth()
    batcher = SpanBatcher(queue, sink, metrics, batch_size=100, flush_s=0.01, health=health)
    stop = asyncio.Event()
    task = asyncio.create_task(batcher.run(stop))
    queue.append(request_spans())
    await async_wait_until("the sink to be called", lambda: sink.calls >= 1)
    queue.append(request_spans())  # the next traces are still stored
    await async_wait_until("the 14 spans written", lambda: len(sink.written) == 14)
    assert not task.done()
    stop.set()
    await asyncio.wait_for(task, timeout=5)
    assert _metric(
        metrics, 'pdscope_collector_task_errors_total{reason="OverflowError",task="span_writer"} 1.0'
    )
    assert not _metric(metrics, 'pdscope_collector_spans_dropped_total{reason="writer_error"}')
    ok, tasks = health.report()
    assert ok and tasks["span_writer"]["errors"] == 1


async def test_healthz_reports_a_dead_or_stuck_task_with_503() -> None:
    now = [1000.0]
    health = TaskHealth(clock=lambda: now[0])
    health.register("span_writer", 60.0)
    health.register("scraper", 30.0)
    queue, metrics = Spool.memory(10), CollectorMetrics()
    async with _client(queue, metrics, health=health) as client:
        assert (await client.get("/healthz")).status_code == 200
        now[0] += 45.0  # the scraper has not beaten for 45 s: stuck
        health.beat("span_writer")
        resp = await client.get("/healthz")
        assert resp.status_code == 503
        assert resp.json()["tasks"]["scraper"]["state"] == "stuck"
        health.beat("scraper")
        assert (await client.get("/healthz")).status_code == 200
        health.died("span_writer", "RuntimeError: boom")
        resp = await client.get("/healthz")
        assert resp.status_code == 503 and resp.json()["tasks"]["span_writer"]["state"] == "dead"


def _settings(tmp_path: Path, extra: str = "") -> Any:
    return parse_config(f"""
model: {{name: tiny, kv_bytes_per_token: 1024}}
pools:
  prefill: {{role: prefill, instances: [{{name: p0, url: "http://127.0.0.1:9"}}]}}
  decode: {{role: decode, instances: [{{name: d0, url: "http://127.0.0.1:9"}}]}}
store: {{url: "sqlite:///{tmp_path / "c.db"}"}}
collector: {{scrape_interval_s: 0.5, scrape_timeout_s: 0.3{extra}}}
""")


async def test_a_background_task_that_ends_while_running_is_reported_dead(tmp_path: Path) -> None:
    from collector.service import CollectorService

    upgrade(f"sqlite:///{tmp_path / 'c.db'}")
    service = CollectorService(_settings(tmp_path), port=0)
    try:
        service.health.register("x", 60.0)

        async def boom() -> None:
            raise RuntimeError("boom")

        stop = asyncio.Event()
        task = service._supervise("x", boom(), stop)
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)  # done callbacks run on the next turn
        ok, tasks = service.health.report()
        assert not ok and tasks["x"]["state"] == "dead" and "boom" in tasks["x"]["died"]
        assert _metric(service.metrics, 'pdscope_collector_task_errors_total{reason="died",task="x"} 1.0')
    finally:
        service.sock.close()
        await service.client.aclose()


async def test_maintenance_survives_a_non_store_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from collector.service import MAINTENANCE, CollectorService

    upgrade(f"sqlite:///{tmp_path / 'c.db'}")
    service = CollectorService(_settings(tmp_path), port=0)
    calls = []

    def broken() -> None:
        calls.append(1)
        raise ValueError("cannot convert")

    monkeypatch.setattr(service, "maintenance", broken)
    stop = asyncio.Event()
    task = asyncio.create_task(service._maintenance_loop(stop))
    try:
        await async_wait_until("a second call", lambda: len(calls) >= 2)  # it went on after the first failure
        assert not task.done()
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=5)
        service.sock.close()
        await service.client.aclose()
    assert service.health.report()[1][MAINTENANCE]["errors"] >= 2


# -- item 4: one malformed span costs only itself -------------------------------------------


def _json_export(spans: list[dict[str, Any]]) -> bytes:
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}).encode()


def _good_json_spans() -> list[dict[str, Any]]:
    return json.loads(to_json(request_spans()))["resourceSpans"][0]["scopeSpans"][0]["spans"]  # type: ignore[no-any-return]


async def test_malformed_json_span_is_dropped_alone_and_counted() -> None:
    good = _good_json_spans()
    bad = [
        dict(good[0], name={"a": "map"}),
        dict(good[0], traceId=["x"]),
        dict(good[0], kind={"k": 1}),
        dict(good[0], startTimeUnixNano={"n": 1}),
        dict(good[0], attributes={"not": "a list"}),
        "not a span",
    ]
    queue, metrics = Spool.memory(100), CollectorMetrics()
    async with _client(queue, metrics) as client:
        resp = await client.post(
            "/v1/traces", content=_json_export(bad + good), headers={"content-type": "application/json"}
        )
    assert resp.status_code == 200
    assert resp.json()["partialSuccess"]["rejectedSpans"] == len(bad)
    assert len(queue) == len(good)
    assert _metric(metrics, 'pdscope_collector_spans_dropped_total{reason="malformed"} 5.0')
    assert _metric(metrics, 'pdscope_collector_spans_dropped_total{reason="invalid_trace_id"} 1.0')


def test_wrong_typed_attributes_do_not_lose_the_batch(store_url: str) -> None:
    """A map where a string is expected: the record is stored without that field, the other traces too."""
    upgrade(store_url)
    sink = StoreSink(session_factory(make_engine(store_url)), SLO)
    bad = _root_attrs(
        request_spans(request_id="bad"),
        **{sc.ENDPOINT: {"a": 1}, sc.P_INSTANCE: ["p"], sc.ERROR_TYPE: {"x": 1}, sc.OUTCOME: {"o": 1}},
    )
    good = request_spans(request_id="good")
    res = sink.write(bad + good)
    assert res.written == 14 and res.records == 2 and res.failed == 0
    with sink.factory() as s:
        recs = {r.request_id: r for r in s.scalars(select(RequestRecord))}
    assert recs["bad"].endpoint is None and recs["bad"].error is None and recs["bad"].p_instance == "p0"
    assert recs["good"].endpoint == "/v1/completions"


def test_a_value_the_driver_refuses_costs_only_its_trace(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    upgrade(url)
    sink = StoreSink(session_factory(make_engine(url)), SLO)
    bad = [
        _with(s, kind=2**70) if s.name == sc.SPAN_ADMISSION else s for s in request_spans(request_id="bad")
    ]
    good = request_spans(request_id="good")
    res = sink.write(bad + good)
    assert res.written == 7 and res.failed == 7
    with sink.factory() as s:
        assert [r.request_id for r in s.scalars(select(RequestRecord))] == ["good"]


# -- item 5: gzip bombs --------------------------------------------------------------------


async def test_gzip_bomb_is_refused_with_413_without_inflating_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import collector.receiver as receiver

    threads: list[int] = []
    real = receiver.inflate

    def spy(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(receiver, "inflate", spy)
    bomb = gzip.compress(b"\0" * (8 * 2**20))  # 8 MiB of zeros in ~8 KiB
    cfg = ReceiverConfig(max_body_bytes=2**20, max_inflated_bytes=2**20, inflight_bytes=4 * 2**20)
    queue, metrics = Spool.memory(100), CollectorMetrics()
    async with _client(queue, metrics, cfg) as client:
        resp = await client.post(
            "/v1/traces", content=bomb, headers={"content-type": PROTO, "content-encoding": "gzip"}
        )
    assert resp.status_code == 413 and "decompressed body larger than 1048576" in resp.json()["error"]
    assert _metric(metrics, 'pdscope_collector_otlp_requests_total{result="inflated_too_large"} 1.0')
    assert threads and threads[0] != threading.get_ident()  # inflated off the event loop


def test_inflate_stops_at_the_cap_chunk_by_chunk() -> None:
    reserved: list[int] = []
    with pytest.raises(Exception, match="larger than"):
        inflate(gzip.compress(b"\0" * (64 * 2**20)), "gzip", 2**20, lambda n: reserved.append(n) is None)
    assert sum(reserved) <= 2**20


def test_inflate_keeps_multi_member_gzip_and_refuses_truncated() -> None:
    assert inflate(gzip.compress(b"ab") + gzip.compress(b"cd"), "gzip") == b"abcd"
    with pytest.raises(ValueError, match="truncated"):
        inflate(gzip.compress(b"x" * 1000)[:20], "gzip")


# -- item 10: bounded memory across concurrent posts ---------------------------------------


def test_byte_budget_leases() -> None:
    budget = ByteBudget(100)
    a, b = budget.lease(), budget.lease()
    assert a.acquire(60) and not b.acquire(50) and b.acquire(40)
    a.close()
    assert budget.used == 40 and not a.acquire(1)  # a closed lease takes nothing more
    b.close()
    assert budget.used == 0


async def test_past_the_in_flight_budget_a_post_gets_429_with_retry_after() -> None:
    cfg = ReceiverConfig(
        max_body_bytes=4 * 2**20, max_inflated_bytes=4 * 2**20, inflight_bytes=2 * 2**20, retry_after_s=3
    )
    queue, metrics = Spool.memory(1000), CollectorMetrics()
    release = asyncio.Event()
    sent = asyncio.Event()

    async def slow_body() -> AsyncIterator[bytes]:
        yield b"\0" * (2**20)
        yield b"\0" * (2**20 - 10)
        sent.set()
        await release.wait()
        yield b""

    async with _client(queue, metrics, cfg) as client:
        first = asyncio.create_task(
            client.post("/v1/traces", content=slow_body(), headers={"content-type": PROTO})
        )
        await asyncio.wait_for(sent.wait(), timeout=10)
        resp = await client.post(
            "/v1/traces", content=to_proto(request_spans()), headers={"content-type": PROTO}
        )
        release.set()
        await first
    assert resp.status_code == 429 and resp.headers["retry-after"] == "3"
    assert _metric(metrics, 'pdscope_collector_otlp_requests_total{result="over_budget"} 1.0')


async def test_content_length_past_the_cap_is_413_before_reading() -> None:
    cfg = ReceiverConfig(max_body_bytes=1000, max_inflated_bytes=1000, inflight_bytes=2000)
    queue, metrics = Spool.memory(10), CollectorMetrics()
    async with _client(queue, metrics, cfg) as client:
        resp = await client.post("/v1/traces", content=b"\0" * 2000, headers={"content-type": PROTO})
    assert resp.status_code == 413


# -- item 13 and low items: implausible timestamps, zero ids, attribute bounds ------------------


LIMITS = SpanLimits(max_age_s=6 * 3600.0, max_future_s=300.0)
NOW = 1_800_000_000.0


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"start_ts": 0.0, "end_ts": 0.0}, "too_old"),
        ({"start_ts": 18_446_744_073.0, "end_ts": 18_446_744_074.0}, "in_future"),  # year 2554
        ({"end_ts": NOW + 3600}, "in_future"),
        ({"start_ts": math.nan}, "bad_timestamp"),
        ({"trace_id": "0" * 32}, "invalid_trace_id"),
        ({"span_id": "0" * 16}, "invalid_span_id"),
    ],
)
def test_implausible_spans_are_refused_with_a_reason(changes: dict[str, Any], reason: str) -> None:
    span = _with(request_spans(t0=NOW - 10)[0], **changes)
    verdict = admit(span, NOW, LIMITS)
    assert verdict.span is None and verdict.reason == reason


async def test_refused_spans_are_counted_and_reported_partial_success() -> None:
    spans = request_spans()
    bad = [
        _with(spans[1], start_ts=0.0, end_ts=0.0),
        _with(spans[2], span_id="0" * 16),
        _with(spans[3], trace_id="0" * 32),
        _with(spans[4], start_ts=18_446_744_073.0),
    ]
    queue, metrics = Spool.memory(100), CollectorMetrics()
    async with _client(queue, metrics) as client:
        resp = await client.post(
            "/v1/traces", content=to_proto([spans[0], *bad]), headers={"content-type": PROTO}
        )
    assert resp.status_code == 200 and len(queue) == 1
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    answer = ExportTraceServiceResponse.FromString(resp.content)
    assert answer.partial_success.rejected_spans == 4
    for reason in ("too_old", "invalid_span_id", "invalid_trace_id", "in_future"):
        assert _metric(metrics, f'pdscope_collector_spans_dropped_total{{reason="{reason}"}} 1.0')


def test_zero_parent_means_no_parent_and_future_events_are_left_out() -> None:
    span = request_spans(t0=NOW - 10)[4]  # decode, with a first_token event
    span = _with(span, parent_span_id="0" * 16, events=(*span.events, SpanEvent("late", NOW + 10**9, {})))
    verdict = admit(span, NOW, LIMITS)
    assert verdict.span is not None and verdict.span.parent_span_id is None
    assert [e[0] for e in verdict.span.events] == [sc.EVENT_FIRST_TOKEN] and verdict.truncated


def test_attribute_keys_and_sizes_are_bounded() -> None:
    base = request_spans(t0=NOW - 10)[0]
    many = admit(_with(base, attributes={f"k{i}": i for i in range(10_000)}), NOW, LIMITS)
    assert many.span is not None and len(many.span.attributes) == LIMITS.max_attributes and many.truncated
    big = admit(_with(base, attributes={f"k{i}": "x" * 2000 for i in range(100)}), NOW, LIMITS)
    assert big.span is not None and big.truncated
    assert len(json.dumps(big.span.attributes)) < LIMITS.max_attribute_chars + 4096
    nested = admit(
        _with(base, attributes={"n": math.inf, "i": 2**80, "l": ["y" * 10**5] * 1000}), NOW, LIMITS
    )
    assert nested.span is not None
    assert nested.span.attributes["n"] is None and nested.span.attributes["i"] is None
    assert len(nested.span.attributes["l"]) <= 64 and all(
        len(x) <= LIMITS.max_value_chars for x in nested.span.attributes["l"]
    )
    plain = admit(base, NOW, LIMITS)
    assert plain.span is base and not plain.truncated  # the common case is not rebuilt


async def test_oversized_attributes_are_counted_as_truncated() -> None:
    spans = request_spans()
    spans[0] = _with(spans[0], attributes={**spans[0].attributes, **{f"k{i}": i for i in range(5000)}})
    queue, metrics = Spool.memory(100), CollectorMetrics()
    async with _client(queue, metrics) as client:
        assert (
            await client.post("/v1/traces", content=to_proto(spans), headers={"content-type": PROTO})
        ).status_code == 200
    root = next(s for s in take(queue, 100) if s.name == sc.SPAN_REQUEST)
    assert len(root.attributes) == 128
    assert _metric(metrics, "pdscope_collector_spans_truncated_total 1.0")


@pytest.fixture
def factory(store_url: str) -> sessionmaker[Session]:
    upgrade(store_url)
    return session_factory(make_engine(store_url))


def _snap(ts: float) -> Snapshot:
    return Snapshot(
        instance="d0", pool="dec", role="decode", ts=ts, up=True, histograms={}, extra={}, num_running=1.0
    )


def _record(rid: str, proxy_in: float) -> RequestRecord:
    return RequestRecord(
        request_id=rid, status="ok", retries=0, proxy_in=proxy_in, lease_expiry_suspect=False, attributes={}
    )


def test_a_record_dated_zero_does_not_stall_retention(factory: sessionmaker[Session]) -> None:
    now = NOW
    with factory.begin() as s:
        s.add(_record("epoch", 0.0))
        for k in range(24):  # the last two minutes before the lag, every 5 s
            s.add(_snap(now - 300 + 5 * k))
    retention = Retention(factory, raw_s=3600.0, rollup_s=86400.0, lag_s=60.0)
    retention.run(now)
    with factory() as s:
        minutes = sorted(r.minute for r in s.scalars(select(SnapshotRollup)))
        old = s.scalar(select(RequestRecord).where(RequestRecord.request_id == "epoch"))
    first = math.floor((now - 300) / 60) * 60
    assert minutes == [first, first + 60]  # caught up in one run (not walking from 1970)
    assert old is None  # and the record dated 0 is gone


def test_a_rollup_dated_2554_does_not_stop_rollups(factory: sessionmaker[Session]) -> None:
    now = NOW
    with factory.begin() as s:
        s.add(
            RequestRollup(
                minute=18_446_744_040.0,
                p_instance="p",
                d_instance="d",
                requests=1,
                ok=1,
                slo_met=1,
                lease_suspects=0,
                ttft_sum_s=0.0,
                handoff_sum_s=0.0,
                handoff_count=0,
                e2e_sum_s=0.0,
            )
        )
        for k in range(24):
            s.add(_snap(now - 300 + 5 * k))
            s.add(_record(f"r{k}", now - 300 + 5 * k))
    Retention(factory, raw_s=3600.0, rollup_s=86400.0, lag_s=60.0).run(now)
    with factory() as s:
        recent = [r.minute for r in s.scalars(select(RequestRollup)) if r.minute < now]
    assert recent  # minutes before now are still rolled up


# -- item 7: OTLP authentication and sender identity ----------------------------------------


TOKENS = {"s3cret-proxy": "proxy", "s3cret-vllm": "vllm-p0"}


async def test_otlp_bearer_token_401_before_the_body_and_sender_kept() -> None:
    cfg = ReceiverConfig(tokens=TOKENS)
    queue, metrics = Spool.memory(100), CollectorMetrics()
    read = []

    async def body() -> AsyncIterator[bytes]:
        read.append(1)
        yield to_proto(request_spans())

    async with _client(queue, metrics, cfg) as client:
        resp = await client.post("/v1/traces", content=body(), headers={"content-type": PROTO})
        assert resp.status_code == 401 and resp.headers["www-authenticate"].startswith("Bearer")
        resp = await client.post(
            "/v1/traces",
            content=to_proto(request_spans()),
            headers={"content-type": PROTO, "authorization": "Bearer wrong"},
        )
        assert resp.status_code == 401
        resp = await client.post(
            "/v1/traces",
            content=to_proto(request_spans()),
            headers={"content-type": PROTO, "authorization": "Bearer s3cret-proxy"},
        )
        assert resp.status_code == 200
    assert {s.sender for s in take(queue, 100)} == {"proxy"}
    assert _metric(metrics, 'pdscope_collector_otlp_requests_total{result="unauthorized"} 2.0')
    assert not read or len(queue) == 0  # the refused body was not read (ASGITransport may pre-read nothing)


def test_record_gets_the_sender_of_its_proxy_root(store_url: str) -> None:
    upgrade(store_url)
    sink = StoreSink(session_factory(make_engine(store_url)), SLO)
    spans = request_spans(request_id="who")
    proxy = [_with(s, sender="proxy") for s in spans if s.name != sc.VLLM_SPAN]
    vllm = [_with(s, sender="vllm-p0") for s in spans if s.name == sc.VLLM_SPAN]
    sink.write(proxy)
    sink.write(vllm)  # a later export: the record is re-assembled from stored spans
    with sink.factory() as s:
        rec = s.scalars(select(RequestRecord)).one()
    assert rec.sender == "proxy" and rec.d_queue_s == 0.25
    unauth = StoreSink(sink.factory, SLO).write(request_spans(request_id="anon"))
    assert unauth.records == 1
    with sink.factory() as s:
        assert s.scalars(select(RequestRecord.sender).where(RequestRecord.request_id == "anon")).one() is None


def test_otlp_tokens_from_the_environment(tmp_path: Path) -> None:
    cs = _settings(tmp_path).collector
    assert cs.otlp_tokens({}) == {}
    assert cs.otlp_tokens({"PDSCOPE_OTLP_TOKENS": "proxy:abc, vllm-p0:def"}) == {
        "abc": "proxy",
        "def": "vllm-p0",
    }
    for bad in ("proxy", "proxy:", ":abc", "bad name:abc", "a:x,b:x"):
        with pytest.raises(ConfigError, match="PDSCOPE_OTLP_TOKENS"):
            cs.otlp_tokens({"PDSCOPE_OTLP_TOKENS": bad})


def test_non_loopback_bind_without_tokens_refuses_to_start(tmp_path: Path) -> None:
    from collector.service import CollectorService, InsecureBind, check_bind

    check_bind("127.0.0.1", {}, "X")
    check_bind("0.0.0.0", TOKENS, "X")
    with pytest.raises(InsecureBind, match=r"\$PDSCOPE_OTLP_TOKENS"):
        CollectorService(_settings(tmp_path, ", host: 0.0.0.0"), otlp_tokens={})


def test_pdscope_collect_refuses_a_non_loopback_bind_without_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdscope.cli import main

    monkeypatch.delenv("PDSCOPE_OTLP_TOKENS", raising=False)
    cfg = tmp_path / "pdscope.yaml"
    cfg.write_text(f"""
model: {{name: tiny, kv_bytes_per_token: 1024}}
pools:
  prefill: {{role: prefill, instances: [{{name: p0, url: "http://127.0.0.1:9"}}]}}
  decode: {{role: decode, instances: [{{name: d0, url: "http://127.0.0.1:9"}}]}}
store: {{url: "sqlite:///{tmp_path / "cli.db"}"}}
collector: {{scrape_interval_s: 0.5, scrape_timeout_s: 0.2}}
""")
    assert (
        main(["--config", str(cfg), "collect", "--host", "0.0.0.0", "--port", "0", "--duration", "0.1"]) == 1
    )
    assert "not loopback" in capsys.readouterr().err


# -- log noise ---------------------------------------------------------------------------------


async def test_refused_otlp_requests_log_no_info_line_each(caplog: pytest.LogCaptureFixture) -> None:
    queue, metrics = Spool.memory(10), CollectorMetrics()
    caplog.set_level(logging.DEBUG, logger="collector")
    async with _client(queue, metrics) as client:
        for _ in range(20):
            assert (
                await client.post("/v1/traces", content=b"junk", headers={"content-type": PROTO})
            ).status_code == 400
    infos = [r for r in caplog.records if r.name.startswith("collector") and r.levelno >= logging.INFO]
    assert len(infos) <= 1  # at most the per-minute summary
    assert sum(1 for r in caplog.records if r.levelno == logging.DEBUG) == 20


async def test_scrape_rounds_log_info_only_when_the_down_set_changes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from collector.scraper import Scraper, ScrapeResult
    from collector.targets import ScrapeTarget

    target = ScrapeTarget(
        name="d0",
        pool="decode",
        role="decode",
        url="http://127.0.0.1:9",
        metrics_url="http://127.0.0.1:9/metrics",
    )
    scraper = Scraper(
        [target],
        httpx.AsyncClient(),
        interval_s=1.0,
        timeout_s=0.5,
        max_body_bytes=100,
        on_round=lambda _r: asyncio.sleep(0),
    )
    caplog.set_level(logging.INFO, logger="collector")
    down = [ScrapeResult(target, 0.0, 0.0, None, "timeout")]
    for _ in range(10):
        scraper._log_round(down)
    assert len([r for r in caplog.records if r.levelno >= logging.INFO]) == 1
    await scraper.client.aclose()


def test_collector_quiets_httpx_request_lines(tmp_path: Path) -> None:
    from collector.service import CollectorService

    logging.getLogger("httpx").setLevel(logging.NOTSET)
    service = CollectorService(_settings(tmp_path), port=0)
    try:
        assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
    finally:
        service.sock.close()
        asyncio.run(service.client.aclose())


# -- duplicated series on a /metrics page (fast scrape path) ---------------------------------


CAPTURE = (
    Path(__file__).resolve().parents[1]
    / "fixtures"
    / "vllm-0.32.0-cpu"
    / "decode-metrics-after.vllm-0.32.0.txt"
)


def _duplicate(page: str, prefix: str, reorder: bool = False) -> str:
    lines = page.split("\n")
    i = next(n for n, line in enumerate(lines) if line.startswith(prefix))
    dup = lines[i]
    if reorder:  # the same series with its labels in another order
        name, rest = dup.split("{", 1)
        labels, value = rest.rsplit("}", 1)
        dup = name + "{" + ",".join(reversed(labels.split(","))) + "}" + value
    return "\n".join([*lines[: i + 1], dup, *lines[i + 1 :]])


@pytest.mark.parametrize("reorder", [False, True])
@pytest.mark.parametrize(
    "prefix",
    [
        "vllm:prompt_tokens_total{",
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1"',
        "vllm:time_to_first_token_seconds_count{",
        "vllm:request_success_total{",
    ],
)
def test_a_duplicated_series_is_kept_once_never_summed(prefix: str, reorder: bool) -> None:
    from collector.fastparse import extract_signals
    from collector.signals import from_text

    page = CAPTURE.read_text()
    clean = extract_signals(page)
    doubled = _duplicate(page, prefix, reorder)
    fast = extract_signals(doubled)
    assert fast.values == clean.values and fast.histograms == clean.histograms
    assert any("duplicate series" in e for e in fast.errors)
    assert from_text(doubled).values == fast.values  # the reference parser agrees


# -- held already: parameterised SQL ----------------------------------------------------------


def test_sql_in_span_values_is_stored_verbatim(store_url: str) -> None:
    upgrade(store_url)
    sink = StoreSink(session_factory(make_engine(store_url)), SLO)
    evil = "x'); DROP TABLE spans; --"
    spans = _root_attrs(request_spans(request_id=evil), **{sc.ENDPOINT: evil, sc.P_INSTANCE: evil})
    spans = [_with(s, name=evil, service=evil) if s.name == sc.SPAN_ADMISSION else s for s in spans]
    assert sink.write(spans).written == 7
    with sink.factory() as s:
        rec = s.scalars(select(RequestRecord)).one()
        from store.models import SpanRow

        assert s.scalars(select(SpanRow.service).where(SpanRow.name == evil)).one() == evil
    assert rec.request_id == evil and rec.endpoint == evil[:64] and rec.p_instance == evil


def test_healthz_says_the_store_is_failing_while_writes_fail() -> None:
    from collector.health import TaskHealth

    t = [100.0]
    h = TaskHealth(clock=lambda: t[0])
    assert h.store_report() == {"state": "ok"}
    h.store(False, "connection refused")
    t[0] = 103.0
    h.store(False, "server closed the connection")
    assert h.store_report() == {
        "state": "failing",
        "for_s": 3.0,
        "last_error": "server closed the connection",
    }
    h.store(True)
    assert h.store_report() == {"state": "ok"}
