"""The collector's HTTP face: ``POST /v1/traces`` (OTLP/HTTP), ``GET /metrics``, ``GET /healthz``.

``POST /v1/traces``, in order, each refusal counted in ``pdscope_collector_otlp_requests_total``:

1. with OTLP tokens configured, no ``Authorization: Bearer <token>`` matching one: 401,
   before a byte of the body is read; the token's sender name goes with every span;
2. a ``Content-Length`` or a body past ``otlp_max_body_bytes``: 413;
3. the in-flight byte budget (``otlp_inflight_bytes``, shared by all requests, body as
   sent plus inflated) has no room: 429 with ``Retry-After``;
4. gzip/deflate is inflated chunk by chunk in a worker thread, never past
   ``otlp_max_inflated_bytes`` (413);
5. a body that is not an OTLP trace export: 400 with the reason; one malformed or
   implausible span costs only itself (``collector.ingest``; dropped spans counted by
   reason and reported to the sender as an OTLP partial success);
6. a span queue without room for the export: 503 with ``Retry-After`` (OTLP senders
   retry it later; nothing of it is queued).

A ``SpanBatcher`` task drains the queue in batches, on size or every ``flush_s``, into a
``Sink`` in a worker thread, and flushes once more at shutdown; a failing turn is
caught, counted and logged (rate-limited), and the loop goes on. ``/healthz`` answers
503 when a background task is dead or stuck (``collector.health``); with ``collectors`` given
it also says who this collector is, which collectors are live and its share of the instances
(``collector.membership``; informational: it never makes /healthz fail).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceResponse,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from collector.health import RateLimitedLog, Tally, TaskHealth
from collector.ingest import SpanLimits, admit
from collector.otlp import (
    BodyTooLarge,
    Decoded,
    OTLPDecodeError,
    OverBudget,
    SpanData,
    decode_export,
    inflate,
)
from collector.selfmetrics import CollectorMetrics
from collector.sink import Sink

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 16 * 2**20
THREAD_DECODE_BYTES = 256 * 2**10
EMPTY_PROTO_RESPONSE = b""  # an empty ExportTraceServiceResponse encodes to zero bytes
SPAN_WRITER = "span_writer"


@dataclass(frozen=True)
class ReceiverConfig:
    max_body_bytes: int = MAX_REQUEST_BYTES
    max_inflated_bytes: int = 64 * 2**20
    inflight_bytes: int = 128 * 2**20
    retry_after_s: int = 1
    limits: SpanLimits = field(default_factory=SpanLimits)
    tokens: Mapping[str, str] = field(default_factory=dict)  # token -> sender; empty: no auth


class ByteBudget:
    """Bytes held by all in-flight OTLP requests together (thread-safe: inflation runs in threads)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._lock = threading.Lock()

    def lease(self) -> Lease:
        return Lease(self)


class Lease:
    """One request's share of a ByteBudget; ``close`` gives it all back, later asks get nothing."""

    def __init__(self, budget: ByteBudget) -> None:
        self.budget = budget
        self.held = 0
        self.closed = False

    def acquire(self, n: int) -> bool:
        b = self.budget
        with b._lock:
            if self.closed or b.used + n > b.capacity:
                return False
            b.used += n
            self.held += n
            return True

    def close(self) -> None:
        b = self.budget
        with b._lock:
            b.used -= self.held
            self.held = 0
            self.closed = True


class SpanQueue:
    """A bounded FIFO of spans that drops the oldest when full."""

    def __init__(self, maxlen: int) -> None:
        self._q: deque[SpanData] = deque(maxlen=maxlen)
        self.maxlen = maxlen
        self.dropped = 0
        self.ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._q)

    def has_room(self, n: int) -> bool:
        """Room for ``n`` more spans (an export larger than the whole queue fits an empty one)."""
        return not self._q or len(self._q) + n <= self.maxlen

    def put(self, spans: Sequence[SpanData]) -> int:
        """Enqueue; returns how many older spans were dropped to make room."""
        overflow = max(0, len(self._q) + len(spans) - self.maxlen)
        self._q.extend(spans)
        self.dropped += overflow
        if spans:
            self.ready.set()
        return overflow

    def take(self, n: int) -> list[SpanData]:
        out = [self._q.popleft() for _ in range(min(n, len(self._q)))]
        if not self._q:
            self.ready.clear()
        return out


class SpanBatcher:
    def __init__(
        self,
        queue: SpanQueue,
        sink: Sink,
        metrics: CollectorMetrics,
        *,
        batch_size: int = 2000,
        flush_s: float = 0.25,
        health: TaskHealth | None = None,
    ) -> None:
        self.queue = queue
        self.sink = sink
        self.metrics = metrics
        self.batch_size = batch_size
        self.flush_s = flush_s
        self.health = health or TaskHealth()
        self.health.register(SPAN_WRITER, max(60.0, 40 * flush_s))
        self._warn = RateLimitedLog(log)

    async def _write(self, batch: list[SpanData]) -> None:
        """One batch into the sink; whatever goes wrong costs this batch only (counted, logged)."""
        try:
            result = await asyncio.to_thread(self.sink.write, batch)
        except Exception as exc:  # a sink must not raise; if one does, the writer goes on
            self.metrics.task_errors.labels(SPAN_WRITER, type(exc).__name__).inc()
            self.metrics.spans_dropped.labels("writer_error").inc(len(batch))
            self.health.error(SPAN_WRITER, exc)
            self._warn.warning(SPAN_WRITER, "span batch of %d lost: %r", len(batch), exc, exc_info=exc)
            return
        self.metrics.spans_written.inc(result.written)
        self.metrics.records.inc(result.records)
        if result.assemble_errors:
            self.metrics.records_failed.labels("assemble_error").inc(result.assemble_errors)
        for key, n in result.attributes_dropped:
            self.metrics.record_attributes_dropped.labels(key).inc(n)
        if result.failed:
            self.metrics.spans_dropped.labels("store_error").inc(result.failed)
            self.metrics.store_errors.labels("spans").inc()
        self.health.store(not result.failed or bool(result.written), result.error or "")

    async def flush(self) -> None:
        while len(self.queue):
            await self._write(self.queue.take(self.batch_size))
            self.metrics.queue.set(len(self.queue))
            self.health.beat(SPAN_WRITER)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.health.beat(SPAN_WRITER)
            try:
                await asyncio.wait_for(self.queue.ready.wait(), timeout=self.flush_s)
            except TimeoutError:
                continue
            if len(self.queue) < self.batch_size:
                await asyncio.sleep(self.flush_s)  # let a batch build up
            await self.flush()
        await self.flush()


def _sender(tokens: Mapping[str, str], header: str | None) -> str | None:
    """The sender whose token the ``Authorization`` header carries, or None."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    given = value.strip().encode()
    found = None
    for token, sender in tokens.items():  # compare with every token, in constant time each
        if hmac.compare_digest(given, token.encode()):
            found = sender
    return found


def _content_length(request: Request) -> int | None:
    raw = request.headers.get("content-length")
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def _admit_all(decoded: Decoded, now: float, limits: SpanLimits) -> tuple[list[SpanData], Counter[str], int]:
    kept: list[SpanData] = []
    dropped = Counter(decoded.dropped)
    truncated = 0
    for span in decoded.spans:
        verdict = admit(span, now, limits)
        if verdict.span is None:
            dropped[verdict.reason or "invalid"] += 1
            continue
        truncated += verdict.truncated
        kept.append(verdict.span)
    return kept, dropped, truncated


class _Refused(Exception):
    def __init__(self, response: Response) -> None:
        self.response = response


class _TracesEndpoint:
    """``POST /v1/traces``: authorize, read the body within its bounds, decode off the loop when large,
    queue the admitted spans and answer OTLP's (partial) success. Every refusal is counted and logged."""

    def __init__(
        self, queue: SpanQueue, metrics: CollectorMetrics, cfg: ReceiverConfig, clock: Callable[[], float]
    ) -> None:
        self.queue, self.metrics, self.cfg, self.clock = queue, metrics, cfg, clock
        self.budget = ByteBudget(cfg.inflight_bytes)
        self.refused = Tally(log, "OTLP requests refused")
        self.spans_refused = Tally(log, "OTLP spans dropped")
        self.retry_after = {"Retry-After": str(cfg.retry_after_s)}

    def refuse(
        self, result: str, status: int, reason: str, headers: Mapping[str, str] | None = None
    ) -> _Refused:
        self.metrics.otlp_requests.labels(result).inc()
        self.refused.note(result, reason)
        return _Refused(JSONResponse({"error": reason}, status_code=status, headers=headers))

    def busy(self) -> _Refused:
        return self.refuse(
            "over_budget", 429, "collector busy: in-flight byte budget exhausted", self.retry_after
        )

    def too_large(self) -> _Refused:
        return self.refuse("too_large", 413, f"body larger than {self.cfg.max_body_bytes} bytes")

    async def handle(self, request: Request) -> Response:
        try:
            sender = self._sender(request)
            spans, dropped, truncated = await self._decoded(request, sender)
            if not self.queue.has_room(len(spans)):
                raise self.refuse("queue_full", 503, "span queue full: retry later", self.retry_after)
        except _Refused as refusal:
            return refusal.response
        self._enqueue(spans, dropped, truncated)
        return self._answer(dropped, request.headers.get("content-type"))

    def _sender(self, request: Request) -> str | None:
        if not self.cfg.tokens:
            return None
        sender = _sender(self.cfg.tokens, request.headers.get("authorization"))
        if sender is None:
            raise self.refuse(
                "unauthorized",
                401,
                "missing or unknown bearer token",
                {"WWW-Authenticate": 'Bearer realm="pdscope-otlp"'},
            )
        return sender

    async def _decoded(
        self, request: Request, sender: str | None
    ) -> tuple[list[SpanData], Counter[str], int]:
        cfg, budget = self.cfg, self.budget
        length = _content_length(request)
        if length is not None and length > cfg.max_body_bytes:
            raise self.too_large()
        if length is not None and budget.used + length > budget.capacity:
            raise self.busy()
        lease = budget.lease()
        try:
            body = bytearray()
            async for chunk in request.stream():
                if len(body) + len(chunk) > cfg.max_body_bytes:
                    raise self.too_large()
                if not lease.acquire(len(chunk)):
                    raise self.busy()
                body.extend(chunk)
                self.metrics.inflight_bytes.set(budget.used)
            ctype = request.headers.get("content-type")
            encoding = request.headers.get("content-encoding")

            def work() -> tuple[list[SpanData], Counter[str], int]:
                raw = inflate(body, encoding, cfg.max_inflated_bytes, lease.acquire)
                return _admit_all(decode_export(raw, ctype, sender), self.clock(), cfg.limits)

            compressed = (encoding or "").strip().lower() not in ("", "identity")
            try:
                if compressed or len(body) > THREAD_DECODE_BYTES:  # never inflate or parse much on the loop
                    return await asyncio.to_thread(work)
                return work()
            except OverBudget:
                raise self.busy() from None
            except BodyTooLarge as exc:
                raise self.refuse("inflated_too_large", 413, str(exc)) from None
            except OTLPDecodeError as exc:
                raise self.refuse("bad_request", 400, str(exc)) from None
            finally:
                self.metrics.inflight_bytes.set(budget.used)
        finally:
            lease.close()

    def _enqueue(self, spans: list[SpanData], dropped: Counter[str], truncated: int) -> None:
        m = self.metrics
        overflow = self.queue.put(spans)
        m.spans_received.inc(len(spans))
        if overflow:
            dropped["queue_full"] += overflow
        for reason, n in dropped.items():
            m.spans_dropped.labels(reason).inc(n)
        if truncated:
            m.spans_truncated.inc(truncated)
        m.queue.set(len(self.queue))
        m.otlp_requests.labels("ok").inc()
        for reason, n in dropped.items():
            self.spans_refused.note(reason, f"{n} span(s) of one export", n=n)

    @staticmethod
    def _answer(dropped: Counter[str], ctype: str | None) -> Response:
        rejected = sum(dropped.values())
        message = ", ".join(f"{k}: {v}" for k, v in sorted(dropped.items()))
        if (ctype or "").startswith("application/json"):
            body_json = (
                {"partialSuccess": {"rejectedSpans": rejected, "errorMessage": message}} if rejected else {}
            )
            return JSONResponse(body_json)
        if not rejected:
            return Response(EMPTY_PROTO_RESPONSE, media_type="application/x-protobuf")
        answer = ExportTraceServiceResponse(
            partial_success=ExportTracePartialSuccess(rejected_spans=rejected, error_message=message)
        )
        return Response(answer.SerializeToString(), media_type="application/x-protobuf")


def build_app(
    queue: SpanQueue,
    metrics: CollectorMetrics,
    config: ReceiverConfig | None = None,
    *,
    health: TaskHealth | None = None,
    clock: Callable[[], float] = time.time,
    collectors: Callable[[], Mapping[str, object]] | None = None,
) -> Starlette:
    traces = _TracesEndpoint(queue, metrics, config or ReceiverConfig(), clock)

    async def prom(_request: Request) -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def healthz(_request: Request) -> Response:
        ok, tasks = health.report() if health is not None else (True, {})
        store = health.store_report() if health is not None else {"state": "ok"}
        status = "unhealthy" if not ok else ("degraded" if store["state"] != "ok" else "ok")
        doc = {"status": status, "span_queue": len(queue), "tasks": tasks, "store": store}
        if collectors is not None:
            doc["collectors"] = dict(collectors())
        return JSONResponse(doc, status_code=200 if ok else 503)

    return Starlette(
        routes=[
            Route("/v1/traces", traces.handle, methods=["POST"]),
            Route("/metrics", prom, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
        ]
    )
