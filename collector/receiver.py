"""The collector's HTTP face: ``POST /v1/traces`` (OTLP/HTTP), ``GET /metrics``, ``GET /healthz``.

Received spans go into a bounded ``SpanQueue``; when it is full the *oldest* spans are
dropped and counted (a slow store must not make senders wait or the process grow). A
``SpanBatcher`` task drains the queue in batches, on size or every ``flush_s``, into a
``Sink`` in a worker thread, and flushes once more at shutdown. A body that is not an
OTLP trace export gets 400 with the reason; an export the queue could only partly keep
still gets 200 (OTLP senders would retry it forever otherwise), the drops are counted.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from collector.otlp import OTLPDecodeError, SpanData, decode
from collector.selfmetrics import CollectorMetrics
from collector.sink import Sink

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 16 * 2**20
THREAD_DECODE_BYTES = 256 * 2**10
EMPTY_PROTO_RESPONSE = b""  # an empty ExportTraceServiceResponse encodes to zero bytes


class SpanQueue:
    """A bounded FIFO of spans that drops the oldest when full."""

    def __init__(self, maxlen: int) -> None:
        self._q: deque[SpanData] = deque(maxlen=maxlen)
        self.maxlen = maxlen
        self.dropped = 0
        self.ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._q)

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
        self, queue: SpanQueue, sink: Sink, metrics: CollectorMetrics, *, batch_size: int = 2000, flush_s: float = 0.25
    ) -> None:
        self.queue = queue
        self.sink = sink
        self.metrics = metrics
        self.batch_size = batch_size
        self.flush_s = flush_s

    async def flush(self) -> None:
        while len(self.queue):
            batch = self.queue.take(self.batch_size)
            result = await asyncio.to_thread(self.sink.write, batch)
            self.metrics.spans_written.inc(result.written)
            self.metrics.records.inc(result.records)
            if result.failed:
                self.metrics.spans_dropped.labels("store_error").inc(result.failed)
                self.metrics.store_errors.labels("spans").inc()
            self.metrics.queue.set(len(self.queue))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(self.queue.ready.wait(), timeout=self.flush_s)
            except TimeoutError:
                continue
            if len(self.queue) < self.batch_size:
                await asyncio.sleep(self.flush_s)  # let a batch build up
            await self.flush()
        await self.flush()


def build_app(queue: SpanQueue, metrics: CollectorMetrics) -> Starlette:
    async def traces(request: Request) -> Response:
        body = bytearray()
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > MAX_REQUEST_BYTES:
                metrics.otlp_requests.labels("too_large").inc()
                return JSONResponse({"error": f"body larger than {MAX_REQUEST_BYTES} bytes"}, status_code=413)
        ctype = request.headers.get("content-type")
        encoding = request.headers.get("content-encoding")
        try:
            if len(body) > THREAD_DECODE_BYTES:  # a big export must not stall scrapes on the loop
                spans = await asyncio.to_thread(decode, bytes(body), ctype, encoding)
            else:
                spans = decode(bytes(body), ctype, encoding)
        except OTLPDecodeError as exc:
            metrics.otlp_requests.labels("bad_request").inc()
            log.info("OTLP request refused: %s", exc)
            return JSONResponse({"error": str(exc)}, status_code=400)
        dropped = queue.put(spans)
        metrics.spans_received.inc(len(spans))
        if dropped:
            metrics.spans_dropped.labels("queue_full").inc(dropped)
        metrics.queue.set(len(queue))
        metrics.otlp_requests.labels("ok").inc()
        if (ctype or "").startswith("application/json"):
            return JSONResponse({})
        return Response(EMPTY_PROTO_RESPONSE, media_type="application/x-protobuf")

    async def prom(_request: Request) -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def healthz(_request: Request) -> Response:
        return JSONResponse({"status": "ok", "span_queue": len(queue)})

    return Starlette(
        routes=[
            Route("/v1/traces", traces, methods=["POST"]),
            Route("/metrics", prom, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
        ]
    )
