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
6. the admitted spans go into the spool (``collector.spool``: on disk, fsynced per policy,
   before the answer); a spool past its bound (bytes or the age of its oldest batch), or a
   disk that refuses the write: 503 with ``Retry-After`` (OTLP senders retry it later;
   nothing of it is kept). A 2xx means the spans are kept.

A ``SpanBatcher`` task drains the spool in batches, on size or every ``flush_s``, into a
``Sink`` in a worker thread, and gives a batch back to the spool only once the sink has it:
while the store is down or locked the batch is retried with a backoff and nothing is dropped.
A failing turn is caught, counted and logged (rate-limited), and the loop goes on. ``/healthz`` answers
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
from collections import Counter
from collections.abc import Callable, Mapping
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
from collector.sink import Sink, WriteResult
from collector.spool import Entry, Spool, SpoolFull
from pdscope.auththrottle import AuthThrottle, bearer_failure

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
    auth_throttle: AuthThrottle = field(default_factory=lambda: AuthThrottle("OTLP receiver"))


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


RETRY_MIN_S, RETRY_MAX_S = 0.25, 5.0
MAX_WRITER_ERRORS = 3  # a batch the sink raises on this many times in a row is dropped (counted)


class SpanBatcher:
    """Drains the spool into the sink, oldest batches first, in batches of up to ``batch_size`` spans.

    A batch leaves the spool (``ack``) only once the sink has it. While the store is unavailable
    (``WriteResult.retry``) the batch stays and is written again after a backoff (``RETRY_MIN_S``
    doubling to ``RETRY_MAX_S``); what arrives meanwhile waits behind it, up to the spool's bound.
    Spans the store refuses for their data are dropped and counted (``store_error``); a batch on
    which the sink itself raises ``MAX_WRITER_ERRORS`` times in a row is dropped and counted
    (``writer_error``), so one poison batch cannot stop the spool.
    """

    def __init__(
        self,
        spool: Spool,
        sink: Sink,
        metrics: CollectorMetrics,
        *,
        batch_size: int = 2000,
        flush_s: float = 0.25,
        health: TaskHealth | None = None,
    ) -> None:
        self.spool = spool
        self.sink = sink
        self.metrics = metrics
        self.batch_size = batch_size
        self.flush_s = flush_s
        self.health = health or TaskHealth()
        self.health.register(SPAN_WRITER, max(60.0, 40 * flush_s))
        self._warn = RateLimitedLog(log)
        self.backoff_s = 0.0  # > 0 while the store is unavailable: the wait before the next try
        self.behind = False  # the store was unavailable and the spool is not yet empty again
        if spool.ready is None:
            spool.ready = asyncio.Event()

    async def _write(self, batch: list[Entry]) -> bool:
        """One batch into the sink. True when it left the spool (stored, or dropped and counted)."""
        spans = [s for e in batch for s in (e.spans or ())]
        try:
            result = await asyncio.to_thread(self.sink.write, spans)
        except Exception as exc:  # a sink must not raise; if one does, the writer goes on
            self.metrics.task_errors.labels(SPAN_WRITER, type(exc).__name__).inc()
            self.health.error(SPAN_WRITER, exc)
            batch[0].attempts += 1
            if batch[0].attempts < MAX_WRITER_ERRORS:
                self._warn.warning(
                    SPAN_WRITER, "span batch of %d not written, will retry: %r", len(spans), exc
                )
                return False
            self.metrics.spans_dropped.labels("writer_error").inc(len(spans))
            self._warn.warning(SPAN_WRITER, "span batch of %d lost: %r", len(spans), exc, exc_info=exc)
            self._ack(batch)
            return True
        if result.retry:
            self.behind = True
            for e in batch:
                e.attempts += 1
            self.metrics.store_errors.labels("spans").inc()
            self.health.store(False, result.error or "store unavailable")
            self._warn.warning(
                "spool_retry", "store unavailable, %d spans stay in the spool: %s", len(spans), result.error
            )
            return False
        self._count(result, batch)
        self._ack(batch)
        return True

    def _count(self, result: WriteResult, batch: list[Entry]) -> None:
        m = self.metrics
        m.spans_written.inc(result.written)
        m.records.inc(result.records)
        replayed = sum(e.count for e in batch if e.attempts or e.recovered or self.behind)
        if replayed:
            m.spool_replayed.inc(replayed)
        if result.assemble_errors:
            m.records_failed.labels("assemble_error").inc(result.assemble_errors)
        for key, n in result.attributes_dropped:
            m.record_attributes_dropped.labels(key).inc(n)
        if result.failed:
            m.spans_dropped.labels("store_error").inc(result.failed)
            m.store_errors.labels("spans").inc()
        self.health.store(not result.failed or bool(result.written), result.error or "")

    def _ack(self, batch: list[Entry]) -> None:
        try:
            self.spool.ack(batch)
        except OSError as exc:  # the ack position not saved: a restart writes these again (harmless)
            self.metrics.task_errors.labels(SPAN_WRITER, "spool_ack").inc()
            self._warn.warning("spool_ack", "spool ack position not saved: %r", exc)
        self.metrics.queue.set(len(self.spool))

    async def flush(self) -> bool:
        """Write what the spool holds. False when the store is unavailable (the rest stays)."""
        while self.spool.batches:
            batch = await asyncio.to_thread(self.spool.peek, self.batch_size)
            done = await self._write(batch)
            self.health.beat(SPAN_WRITER)
            if not done:
                self.backoff_s = min(RETRY_MAX_S, max(RETRY_MIN_S, 2 * self.backoff_s))
                return False
            self.backoff_s = 0.0
        self.behind = False
        return True

    async def run(self, stop: asyncio.Event) -> None:
        ready = self.spool.ready
        while not stop.is_set():
            self.health.beat(SPAN_WRITER)
            wait = self.backoff_s or self.flush_s
            try:
                if self.backoff_s:
                    await asyncio.wait_for(stop.wait(), timeout=wait)
                else:
                    await asyncio.wait_for(ready.wait(), timeout=wait)
            except TimeoutError:
                if not self.spool.batches:
                    continue
            ready.clear()
            if not self.backoff_s and len(self.spool) < self.batch_size:
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
        self, spool: Spool, metrics: CollectorMetrics, cfg: ReceiverConfig, clock: Callable[[], float]
    ) -> None:
        self.spool, self.metrics, self.cfg, self.clock = spool, metrics, cfg, clock
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
            await self._keep(spans, _content_length(request) or 0)
        except _Refused as refusal:
            return refusal.response
        self._count(spans, dropped, truncated)
        return self._answer(dropped, request.headers.get("content-type"))

    async def _keep(self, spans: list[SpanData], size_hint: int) -> None:
        """Put the batch in the spool, or refuse the export (503: nothing of it is kept)."""
        spool = self.spool
        if not spans:
            return
        try:
            refused = spool.refusal(len(spans), size_hint)
            if refused is not None:
                raise refused
            if spool.durable:
                await asyncio.to_thread(spool.append, spans)
            else:
                spool.append(spans)
        except SpoolFull as exc:
            spool.refusing = True
            self.metrics.spool_refused.labels(exc.reason).inc(len(spans))
            raise self.refuse(exc.reason, 503, f"{exc}: retry later", self.retry_after) from None
        except OSError as exc:
            self.metrics.spool_refused.labels("spool_error").inc(len(spans))
            raise self.refuse("spool_error", 503, f"spool write failed: {exc}", self.retry_after) from None
        if spool.ready is not None:
            spool.ready.set()

    def _sender(self, request: Request) -> str | None:
        if not self.cfg.tokens:
            return None
        source = request.client.host if request.client else "unknown"
        header = request.headers.get("authorization")
        wait = self.cfg.auth_throttle.blocked(source)  # past its limit: its token is not compared
        if wait is not None:
            raise self.refuse("throttled", 429, "too many wrong tokens", {"Retry-After": str(wait)})
        sender = _sender(self.cfg.tokens, header)
        if sender is None:
            self.cfg.auth_throttle.failed(source, bearer_failure(header))
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

    def _count(self, spans: list[SpanData], dropped: Counter[str], truncated: int) -> None:
        m = self.metrics
        m.spans_received.inc(len(spans))
        for reason, n in dropped.items():
            m.spans_dropped.labels(reason).inc(n)
        if truncated:
            m.spans_truncated.inc(truncated)
        m.queue.set(len(self.spool))
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
    spool: Spool,
    metrics: CollectorMetrics,
    config: ReceiverConfig | None = None,
    *,
    health: TaskHealth | None = None,
    clock: Callable[[], float] = time.time,
    collectors: Callable[[], Mapping[str, object]] | None = None,
) -> Starlette:
    traces = _TracesEndpoint(spool, metrics, config or ReceiverConfig(), clock)
    metrics.watch_spool(spool)

    async def prom(_request: Request) -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def healthz(_request: Request) -> Response:
        ok, tasks = health.report() if health is not None else (True, {})
        store = health.store_report() if health is not None else {"state": "ok"}
        refusing = spool.refusing or spool.refusal(1) is not None
        status = "unhealthy" if not ok else ("degraded" if store["state"] != "ok" or refusing else "ok")
        doc = {
            "status": status,
            "span_queue": len(spool),
            "spool": {**spool.report(), "refusing": refusing},
            "tasks": tasks,
            "store": store,
        }
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
