"""OpenTelemetry for the proxy: a tracer, a bounded batching exporter, and ``traceparent``.

Spans end on the event loop and go into a bounded deque (the oldest is dropped and
counted when it is full); a daemon thread exports batches with an OTLP/HTTP exporter
every ``interval_s`` or when a batch is full. Nothing here blocks a request: a down or
slow collector only costs dropped spans, counted in :attr:`BoundedSpanProcessor.dropped`.

Must not: log per span, raise into the request path, or wait on the network from the
event loop.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from pdscope import semconv

log = logging.getLogger(__name__)


class BoundedSpanProcessor(SpanProcessor):
    """Batch spans for ``exporter`` in a background thread; bounded, drops counted."""

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        max_queue: int = 8192,
        max_batch: int = 512,
        interval_s: float = 1.0,
    ) -> None:
        self.exporter = exporter
        self.max_batch = max_batch
        self.interval_s = interval_s
        self._queue: collections.deque[ReadableSpan] = collections.deque(maxlen=max_queue)
        self._max_queue = max_queue
        self.dropped = 0
        self.exported = 0
        self.failed = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._export_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="pdscope-span-export", daemon=True)
        self._thread.start()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        queue = self._queue
        if len(queue) >= self._max_queue:
            self.dropped += 1  # the deque drops the oldest on append
        queue.append(span)
        if len(queue) == self.max_batch:
            self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            self._drain()

    def _drain(self) -> None:
        with self._export_lock:
            while self._queue:
                batch: list[ReadableSpan] = []
                while self._queue and len(batch) < self.max_batch:
                    batch.append(self._queue.popleft())
                self._export(batch)

    def _export(self, batch: Sequence[ReadableSpan]) -> None:
        try:
            result = self.exporter.export(batch)
        except Exception:  # an exporter must not raise; if it does, count and go on
            log.debug("span export raised", exc_info=True)
            result = SpanExportResult.FAILURE
        if result == SpanExportResult.SUCCESS:
            self.exported += len(batch)
        else:
            self.failed += len(batch)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self._drain()
        return True

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5.0)
        self._drain()  # once more at shutdown
        self.exporter.shutdown()


def otlp_endpoint(configured: str | None, collector_url: str) -> str:
    base = (configured or collector_url).rstrip("/")
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


def make_provider(exporter: SpanExporter, **kwargs: float | int) -> tuple[TracerProvider, BoundedSpanProcessor]:
    """A TracerProvider for the proxy (service.name ``pdscope-proxy``) exporting to ``exporter``."""
    provider = TracerProvider(resource=Resource.create({"service.name": semconv.SERVICE_PROXY}))
    processor = BoundedSpanProcessor(exporter, **kwargs)  # type: ignore[arg-type]
    provider.add_span_processor(processor)
    return provider, processor


class _OncePer(logging.Filter):
    """Let one record through per ``interval_s``: a down collector is news once, not every batch."""

    def __init__(self, interval_s: float) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._last = float("-inf")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.created - self._last >= self.interval_s:
            self._last = record.created
            return True
        return False


_EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.http.trace_exporter"


def otlp_exporter(endpoint: str, timeout_s: float = 2.0) -> SpanExporter:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    exporter_log = logging.getLogger(_EXPORTER_LOGGER)
    if not any(isinstance(f, _OncePer) for f in exporter_log.filters):
        exporter_log.addFilter(_OncePer(60.0))  # failures are counted in our metrics anyway
    return OTLPSpanExporter(endpoint=endpoint, timeout=timeout_s)


def traceparent(span: trace.Span) -> str | None:
    """The W3C ``traceparent`` naming ``span`` as the parent, or None if it is invalid."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def parse_traceparent(value: str | None) -> Context | None:
    """The context of an incoming ``traceparent`` header (version 00), or None."""
    if not value or len(value) < 55:
        return None
    parts = value.strip().split("-")
    if len(parts) < 4 or parts[0] == "ff" or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3][:2], 16)
    except ValueError:
        return None
    if trace_id == 0 or span_id == 0:
        return None
    parent = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))
    return trace.set_span_in_context(NonRecordingSpan(parent))
