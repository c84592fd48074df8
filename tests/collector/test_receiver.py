"""OTLP/HTTP receiver: protobuf, JSON, gzip, garbage -> 400, bounded queue, batches into a Sink."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import Sequence

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from collector.otlp import SpanData, decode
from collector.receiver import SpanBatcher, build_app
from collector.selfmetrics import CollectorMetrics
from collector.sink import WriteResult
from collector.spool import Spool
from tests.collector.traces import request_spans, take, to_json, to_proto
from tests.support.waiting import async_wait_until

PROTO = "application/x-protobuf"


class FakeSink:
    def __init__(self, fail: bool = False) -> None:
        self.batches: list[list[SpanData]] = []
        self.fail = fail

    def write(self, batch: Sequence[SpanData]) -> WriteResult:
        self.batches.append(list(batch))
        if self.fail:
            return WriteResult(0, failed=len(batch), error="store down")
        return WriteResult(len(batch))


def _client(queue: Spool, metrics: CollectorMetrics) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=build_app(queue, metrics)), base_url="http://collector"
    )


def _key(s: SpanData) -> tuple[object, ...]:
    return (
        s.trace_id,
        s.span_id,
        s.parent_span_id,
        s.name,
        s.service,
        round(s.start_ts, 6),
        round(s.end_ts, 6),
        s.attributes,
        tuple((n, round(t, 6)) for n, t, _ in s.events),
    )


@pytest.mark.parametrize("encoding", ["proto", "json"])
@pytest.mark.parametrize("gz", [False, True])
async def test_accepts_protobuf_and_json_plain_and_gzip(encoding: str, gz: bool) -> None:
    spans = request_spans()
    body = to_proto(spans) if encoding == "proto" else to_json(spans)
    headers = {"content-type": PROTO if encoding == "proto" else "application/json"}
    if gz:
        body = gzip.compress(body)
        headers["content-encoding"] = "gzip"
    queue, metrics = Spool.memory(100), CollectorMetrics()
    async with _client(queue, metrics) as client:
        resp = await client.post("/v1/traces", content=body, headers=headers)
    assert resp.status_code == 200
    got = take(queue, 100)
    assert sorted(map(_key, got)) == sorted(map(_key, spans))


@pytest.mark.parametrize(
    ("body", "headers", "reason"),
    [
        (b"\xff\x00garbage", {"content-type": PROTO}, "not an OTLP protobuf"),
        (b"{not json", {"content-type": "application/json"}, "not JSON"),
        (b'{"resourceSpans": 5}', {"content-type": "application/json"}, "no resourceSpans"),
        (b"plain text", {"content-type": PROTO, "content-encoding": "gzip"}, "not valid gzip"),
        (b"x", {"content-type": PROTO, "content-encoding": "br"}, "unsupported Content-Encoding"),
        (b"x", {"content-type": "text/plain"}, "unsupported Content-Type"),
    ],
)
async def test_garbage_gets_400_with_a_reason(body: bytes, headers: dict[str, str], reason: str) -> None:
    queue, metrics = Spool.memory(100), CollectorMetrics()
    async with _client(queue, metrics) as client:
        resp = await client.post("/v1/traces", content=body, headers=headers)
    assert resp.status_code == 400
    assert reason in resp.json()["error"]
    assert len(queue) == 0
    assert 'pdscope_collector_otlp_requests_total{result="bad_request"} 1.0' in metrics.exposition().decode()


def test_short_ids_in_protobuf_cost_only_their_span() -> None:
    # was: the whole export refused (OTLPDecodeError); now the bad span is dropped, counted by reason
    from collector.otlp import decode_export

    req = ExportTraceServiceRequest()
    spans = req.resource_spans.add().scope_spans.add().spans
    bad = spans.add()
    bad.trace_id = b"\x01\x02"
    bad.span_id = b"\x01" * 8
    good = spans.add()
    good.trace_id = b"\x01" * 16
    good.span_id = b"\x02" * 8
    out = decode_export(req.SerializeToString(), PROTO)
    assert [s.span_id for s in out.spans] == ["02" * 8]
    assert out.dropped == {"invalid_trace_id": 1}


async def test_full_queue_answers_503_with_retry_after_and_keeps_what_it_has() -> None:
    # was: 200 and the oldest queued spans dropped; now the sender is told to retry (OTLP: 503 is retryable)
    queue, metrics = Spool.memory(10), CollectorMetrics()
    first, second = request_spans(), request_spans()  # 7 spans each
    async with _client(queue, metrics) as client:
        resp = await client.post("/v1/traces", content=to_proto(first), headers={"content-type": PROTO})
        assert resp.status_code == 200
        resp = await client.post("/v1/traces", content=to_proto(second), headers={"content-type": PROTO})
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert [s.span_id for s in take(queue, 100)] == [s.span_id for s in first]
    text = metrics.exposition().decode()
    assert 'pdscope_collector_otlp_requests_total{result="spool_full"} 1.0' in text
    assert 'pdscope_collector_spool_refused_spans_total{reason="spool_full"} 7.0' in text
    assert "pdscope_collector_spans_received_total 7.0" in text


async def test_an_export_larger_than_the_whole_spool_is_kept_whole_when_it_is_empty() -> None:
    # was: the oldest spans dropped to make room (200, then lost); an empty spool takes any one batch
    queue, metrics = Spool.memory(5), CollectorMetrics()
    spans = request_spans()  # 7 spans
    async with _client(queue, metrics) as client:
        resp = await client.post("/v1/traces", content=to_proto(spans), headers={"content-type": PROTO})
    assert resp.status_code == 200
    assert [s.span_id for s in take(queue, 100)] == [s.span_id for s in spans]
    assert "pdscope_collector_spans_dropped_total" not in metrics.exposition().decode().replace(
        "# HELP pdscope_collector_spans_dropped_total", ""
    ).replace("# TYPE pdscope_collector_spans_dropped_total", "")


async def test_batcher_writes_in_batches_and_flushes_at_stop() -> None:
    queue, metrics, sink = Spool.memory(1000), CollectorMetrics(), FakeSink()
    batcher = SpanBatcher(queue, sink, metrics, batch_size=10, flush_s=0.05)
    stop = asyncio.Event()
    task = asyncio.create_task(batcher.run(stop))
    for _ in range(5):
        queue.append(request_spans())  # 35 spans
    await async_wait_until(
        "the 35 spans written while running", lambda: sum(len(b) for b in sink.batches) == 35
    )
    queue.append(request_spans()[:3])
    stop.set()
    await asyncio.wait_for(task, timeout=5)
    assert sum(len(b) for b in sink.batches) == 38
    assert max(len(b) for b in sink.batches) <= 10
    assert "pdscope_collector_spans_written_total 38.0" in metrics.exposition().decode()


async def test_sink_failure_is_counted_not_raised() -> None:
    queue, metrics, sink = Spool.memory(100), CollectorMetrics(), FakeSink(fail=True)
    queue.append(request_spans())
    await SpanBatcher(queue, sink, metrics).flush()
    text = metrics.exposition().decode()
    assert 'pdscope_collector_spans_dropped_total{reason="store_error"} 7.0' in text


async def test_metrics_and_healthz() -> None:
    queue, metrics = Spool.memory(10), CollectorMetrics()
    async with _client(queue, metrics) as client:
        assert (await client.get("/healthz")).json()["status"] == "ok"
        resp = await client.get("/metrics")
    assert resp.status_code == 200 and "pdscope_collector_span_queue" in resp.text


def test_json_enum_names_and_odd_attribute_values() -> None:
    body = (
        b'{"resourceSpans":[{"resource":{"attributes":[{"key":"service.name","value":{"stringValue":"p0"}}]},'
        b'"scopeSpans":[{"spans":[{"traceId":"0af7651916cd43dd8448eb211c80319c","spanId":"b7ad6b7169203331",'
        b'"name":"llm_request","kind":"SPAN_KIND_SERVER","startTimeUnixNano":1800000000000000000,'
        b'"endTimeUnixNano":"1800000001000000000","status":{"code":"STATUS_CODE_ERROR"},'
        b'"attributes":[{"key":"n","value":{"intValue":"7"}},{"key":"l","value":{"arrayValue":{"values":'
        b'[{"stringValue":"a"},{"doubleValue":1.5}]}}},{"key":"e","value":{}}]}]}]}]}'
    )
    (span,) = decode(body, "application/json")
    assert span.kind == 2 and span.status_code == 2 and span.service == "p0"
    assert span.attributes == {"n": 7, "l": ["a", 1.5], "e": None}
    assert span.end_ts - span.start_ts == pytest.approx(1.0)


def test_non_finite_and_huge_attributes_are_stored_safely(tmp_path: object) -> None:
    import json
    import math

    from collector.sink import MAX_ATTR_CHARS, span_row

    spans = request_spans()
    odd = SpanData(
        **{
            **{f: getattr(spans[0], f) for f in SpanData.__dataclass_fields__},
            "attributes": {"nan": math.nan, "big": "x" * 10_000, "n": 1},
        }
    )
    attrs = json.loads(span_row(odd, 0.0)["attributes"])
    assert attrs["nan"] is None and len(attrs["big"]) == MAX_ATTR_CHARS and attrs["n"] == 1


async def test_large_export_is_decoded_off_the_event_loop() -> None:
    from collector.receiver import THREAD_DECODE_BYTES

    spans = [s for _ in range(400) for s in request_spans()]
    body = to_proto(spans)
    assert len(body) > THREAD_DECODE_BYTES
    queue, metrics = Spool.memory(10_000), CollectorMetrics()
    async with _client(queue, metrics) as client:
        resp = await client.post("/v1/traces", content=body, headers={"content-type": PROTO})
    assert resp.status_code == 200 and len(queue) == len(spans)
