"""OpenTelemetry for the proxy: a tracer, a bounded batching exporter, and ``traceparent``.

Spans end on the event loop and go into a bounded deque (the oldest is dropped and
counted when it is full); a daemon thread exports batches every ``interval_s`` or when a
batch is full. A batch that fails for a reason worth retrying (collector down, 429/503,
5xx) is held and tried again with a bounded, jittered exponential backoff (at least the
collector's ``Retry-After``), while new spans keep queueing behind it: a collector
restart or deploy loses nothing short of the queue filling up. What is lost is counted:
:attr:`BoundedSpanProcessor.dropped` (queue full, or still queued at shutdown) and
:attr:`~BoundedSpanProcessor.rejected` (batches the collector refused for good, e.g. 400
or 401). A failing collector is logged when it starts failing and when it recovers.

Sampling (``proxy.trace_sample_ratio``): every span is recorded (the provider samples
``ALWAYS_ON``), and the head decision (:func:`head_sampled`, on the trace id) is the root's
``pdscope.sampled`` attribute and the flag of the ``traceparent`` sent to P and D. The
processor holds the children of an unsampled root until the root ends; then it exports them
with the root when the root says to keep them (``pdscope.keep``: failed, retried, or over
the TTFT SLO), and otherwise exports the root alone (counted in :attr:`~BoundedSpanProcessor.unsampled`).
What it holds is bounded (``max_buffered`` spans: the oldest trace's are dropped and counted
in ``dropped`` and ``buffer_dropped``).

Spans are :class:`LightSpan`s from :class:`LightTracer` (``make_provider``'s provider hands
it out): the OpenTelemetry API's span, recording into a plain dict on the event loop and
handed to the processor as the ``ReadableSpan`` it already is, without the SDK span's lock,
attribute cleaning and copy at the end (measured: the SDK's span cost about a fifth of the
proxy's CPU per request at five spans a request). Everything downstream (the processor, any
``SpanExporter``) sees ordinary ``ReadableSpan``s.

Must not: log per span, raise into the request path, or wait on the network from the
event loop.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import random
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.util import types

from pdscope import semconv
from proxy.spanexport import OtlpHttpExporter, Sent

log = logging.getLogger(__name__)

_SHUTDOWN_DRAIN_S = 5.0  # at shutdown, queued spans get this long to leave
_ID_SPACE = 2**64  # head sampling compares a trace id's low 64 bits, as OTel's TraceIdRatioBased does


def head_sampled(trace_id: int, ratio: float, parent_sampled: bool = False) -> bool:
    """Whether a request's whole trace is kept: always when its caller's ``traceparent`` said
    sampled, else for the share ``ratio`` of trace ids (the same id decides the same way on
    every proxy)."""
    if parent_sampled or ratio >= 1.0:
        return True
    if ratio <= 0.0:
        return False
    return (trace_id & (_ID_SPACE - 1)) < round(ratio * _ID_SPACE)


def _keep_children(root: ReadableSpan) -> bool:
    attrs = root.attributes or {}
    return attrs.get(semconv.SAMPLED) is not False or bool(attrs.get(semconv.KEEP))


class Backoff:
    """Exponential backoff with jitter: ``base * 2**n`` capped at ``cap``, then a random
    share in [50%, 100%] of it (so many proxies do not retry in step)."""

    def __init__(self, base_s: float, cap_s: float, rng: random.Random | None = None) -> None:
        self.base_s = min(base_s, cap_s)
        self.cap_s = cap_s
        self.rng = rng or random.Random()
        self.failures = 0

    def next_delay(self, at_least: float | None = None) -> float:
        raw = min(self.cap_s, self.base_s * 2 ** min(self.failures, 30))
        self.failures += 1
        delay = raw * (0.5 + 0.5 * self.rng.random())
        return float(max(delay, at_least)) if at_least is not None else float(delay)

    def reset(self) -> None:
        self.failures = 0


def _send(exporter: SpanExporter, batch: Sequence[ReadableSpan]) -> Sent:
    """Our exporter says whether to retry; any other (tests, SDK exporters) is retried on failure."""
    try:
        if isinstance(exporter, OtlpHttpExporter):
            return exporter.send(batch)
        result = exporter.export(batch)
    except Exception:  # an exporter must not raise; if it does, count it and try again later
        log.debug("span export raised", exc_info=True)
        return Sent(ok=False, retry=True)
    return Sent(ok=True) if result == SpanExportResult.SUCCESS else Sent(ok=False, retry=True)


class BoundedSpanProcessor(SpanProcessor):
    """Batch spans for ``exporter`` in a background thread; bounded, retried, losses counted.

    Memory holds at most ``max_queue`` queued spans plus the one batch being retried.
    """

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        max_queue: int = 8192,
        max_batch: int = 512,
        max_buffered: int = 8192,
        interval_s: float = 1.0,
        retry_base_s: float = 0.2,
        retry_max_s: float = 5.0,
        rng: random.Random | None = None,
        sleep: Callable[[float], bool] | None = None,
    ) -> None:
        self.exporter = exporter
        self.max_batch = max_batch
        self.interval_s = interval_s
        self._queue: collections.deque[ReadableSpan] = collections.deque(maxlen=max_queue)
        self._max_queue = max_queue
        self._held: list[ReadableSpan] = []  # the batch being retried (export thread only)
        self.backoff = Backoff(retry_base_s, retry_max_s, rng)
        self.dropped = 0
        self.exported = 0
        self.failed = 0  # spans in failed tries (a span retried twice counts twice)
        self.rejected = 0  # spans in batches the collector refused for good
        self.retries = 0  # tries of a held batch
        # children of unsampled roots, held until the root ends (event loop only)
        self._roots: dict[tuple[int, int], Span] = {}  # local roots that have not ended
        self._buffered: collections.OrderedDict[tuple[int, int], list[ReadableSpan]] = (
            collections.OrderedDict()
        )
        self._buffered_n = 0
        self.max_buffered = max_buffered
        self.unsampled = 0  # children not exported: their trace was not sampled, failed nor slow
        self.buffer_dropped = 0  # held children dropped because the buffer was full (also in dropped)
        self.failing = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._sleep = sleep or self._stop.wait  # returns True when stopping
        self._export_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="pdscope-span-export", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        """Spans waiting to leave (the queue and the batch being retried)."""
        return len(self._queue) + len(self._held)

    @property
    def buffered(self) -> int:
        """Children of unsampled roots held until their root ends."""
        return self._buffered_n

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        parent = span.parent
        if parent is None or parent.is_remote:  # a local root: its children may be held
            ctx = span.get_span_context()
            self._roots[(ctx.trace_id, ctx.span_id)] = span

    def on_end(self, span: ReadableSpan) -> None:
        parent = span.parent
        if parent is not None and not parent.is_remote:
            key = (parent.trace_id, parent.span_id)
            root = self._roots.get(key)
            if root is not None and not _keep_children(root):
                self._hold(key, span)
                return
        else:
            ctx = span.get_span_context()
            if ctx is not None:
                key = (ctx.trace_id, ctx.span_id)
                self._roots.pop(key, None)
                held = self._buffered.pop(key, None)
                if held:
                    self._buffered_n -= len(held)
                    if _keep_children(span):
                        for child in held:
                            self._enqueue(child)
                    else:
                        self.unsampled += len(held)
        self._enqueue(span)

    def _hold(self, key: tuple[int, int], span: ReadableSpan) -> None:
        held = self._buffered.get(key)
        if held is None:
            held = self._buffered[key] = []
        held.append(span)
        self._buffered_n += 1
        while self._buffered_n > self.max_buffered:  # drop the oldest trace's children, counted
            _, old = self._buffered.popitem(last=False)
            self._buffered_n -= len(old)
            self.buffer_dropped += len(old)
            self.dropped += len(old)

    def _enqueue(self, span: ReadableSpan) -> None:
        queue = self._queue
        if len(queue) >= self._max_queue:
            self.dropped += 1  # the deque drops the oldest on append
        queue.append(span)
        if len(queue) == self.max_batch:
            self._wake.set()

    def _run(self) -> None:
        delay: float | None = None
        while not self._stop.is_set():
            if delay is None:  # after a backoff pause, try again at once
                self._wake.wait(self.interval_s)
                self._wake.clear()
            try:
                delay = self._drain(retry=True)
            except Exception:  # never let the export thread die: log, count, go on
                log.exception("span export loop raised; continuing")
                delay = self.backoff.next_delay()
            if delay is not None and self._sleep(delay):
                return

    def _next_batch(self) -> list[ReadableSpan]:
        if self._held:
            return self._held
        batch: list[ReadableSpan] = []
        while self._queue and len(batch) < self.max_batch:
            batch.append(self._queue.popleft())
        return batch

    def _drain(self, retry: bool) -> float | None:
        """Export until the queue is empty; on a retryable failure keep the batch and return
        how long to wait (``retry``) or stop (force flush, shutdown). None when all went."""
        with self._export_lock:
            while True:
                batch = self._next_batch()
                if not batch:
                    return None
                if batch is self._held:
                    self.retries += 1
                sent = _send(self.exporter, batch)
                if sent.ok:
                    self._held = []
                    self.exported += len(batch)
                    if self.failing:
                        self.failing = False
                        log.warning("span export recovered; %d spans still queued", self.queued)
                    self.backoff.reset()
                    continue
                self.failed += len(batch)
                if not sent.retry:
                    self._held = []
                    self.rejected += len(batch)
                    log.warning(
                        "collector refused a span batch (HTTP %s); %d spans lost", sent.status, len(batch)
                    )
                    continue
                self._held = batch
                if not self.failing:
                    self.failing = True
                    log.warning(
                        "span export failing (%s); retrying with backoff, spans held in the queue",
                        f"HTTP {sent.status}" if sent.status else "collector unreachable",
                    )
                delay = self.backoff.next_delay(sent.retry_after_s)
                return delay if retry else 0.0

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """One try for each queued batch; False if some are still held for a retry."""
        return self._drain(retry=False) is None

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5.0)
        deadline = time.monotonic() + _SHUTDOWN_DRAIN_S
        while self.queued and time.monotonic() < deadline:  # bounded: one try per batch, then stop
            if self._drain(retry=False) is not None:
                break
        self.dropped += self.queued + self._buffered_n  # still here at exit: lost, and counted
        self._queue.clear()
        self._held = []
        self._buffered.clear()
        self._buffered_n = 0
        self._roots.clear()
        self.exporter.shutdown()


def otlp_endpoint(configured: str | None, collector_url: str) -> str:
    base = (configured or collector_url).rstrip("/")
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


_UNSET = Status(StatusCode.UNSET)
_SAMPLED_FLAGS = TraceFlags(TraceFlags.SAMPLED)


class LightSpan(trace.Span, ReadableSpan):
    """A recording span for one event loop (no lock): the API's span while it runs, the
    ``ReadableSpan`` the processor and exporters read once it ended. Its attributes are a plain
    dict of what the proxy set (``None`` values are skipped, as the SDK does); nothing changes
    after :meth:`end`."""

    def __init__(
        self,
        processor: SpanProcessor,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        attributes: dict[str, Any],
        start_time: int,
        resource: Resource,
        scope: InstrumentationScope,
    ) -> None:
        # ReadableSpan's fields, set here (its __init__ would create a Resource per span)
        self._name = name
        self._context = self._ctx = context
        self._parent = parent
        self._kind = kind
        self._attributes = self._attrs = attributes
        self._events: list[Event] = []
        self._links: Sequence[Link] = ()
        self._resource = resource
        self._instrumentation_scope = scope
        self._instrumentation_info = None
        self._status = _UNSET
        self._start_time = start_time
        self._end_time: int | None = None
        self._processor = processor

    # What the encoder reads per span, without ReadableSpan's copies and isinstance checks.
    @property
    def attributes(self) -> types.Attributes:
        return self._attrs  # read-only by contract: the span has ended when anyone reads it

    @property
    def events(self) -> Sequence[Event]:
        return self._events

    @property
    def links(self) -> Sequence[Link]:
        return self._links

    @property
    def dropped_attributes(self) -> int:
        return 0  # nothing is dropped: the proxy sets a bounded set of attributes

    @property
    def dropped_events(self) -> int:
        return 0

    @property
    def dropped_links(self) -> int:
        return 0

    def get_span_context(self) -> SpanContext:
        return self._ctx

    def is_recording(self) -> bool:
        return self._end_time is None

    def set_attribute(self, key: str, value: types.AttributeValue) -> None:
        if self._end_time is None and value is not None:
            self._attrs[key] = value

    def set_attributes(self, attributes: Mapping[str, types.AttributeValue]) -> None:
        if self._end_time is None:
            for key, value in attributes.items():
                if value is not None:
                    self._attrs[key] = value

    def add_event(self, name: str, attributes: types.Attributes = None, timestamp: int | None = None) -> None:
        if self._end_time is None:
            self._events.append(Event(name, attributes, time.time_ns() if timestamp is None else timestamp))

    def update_name(self, name: str) -> None:
        if self._end_time is None:
            self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        # as the SDK: OK is final, UNSET is ignored
        if self._end_time is not None or self._status.status_code is StatusCode.OK:
            return
        if isinstance(status, Status):
            if status.status_code is not StatusCode.UNSET:
                self._status = status
        elif status is not StatusCode.UNSET:
            self._status = Status(status, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: types.Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        cls = type(exception)
        kind = (
            cls.__qualname__
            if cls.__module__ in (None, "builtins")
            else f"{cls.__module__}.{cls.__qualname__}"
        )
        attrs: dict[str, types.AttributeValue] = {
            "exception.type": kind,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        attrs.update(attributes or {})
        self.add_event("exception", attrs, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self._end_time is not None:
            return
        self._end_time = time.time_ns() if end_time is None else end_time
        self._processor.on_end(self)


class LightTracer(trace.Tracer):
    """Starts :class:`LightSpan`s for ``processor`` (every span recorded: ALWAYS_ON, see
    :func:`make_provider`). Ids from ``random.getrandbits``, as the SDK's default generator."""

    def __init__(self, processor: SpanProcessor, resource: Resource, scope: InstrumentationScope) -> None:
        self.processor, self.resource, self.scope = processor, resource, scope
        self._bits = random.getrandbits

    def start_span(
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: types.Attributes = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> LightSpan:
        parent: SpanContext | None = trace.get_current_span(context).get_span_context()
        assert parent is not None
        if parent.is_valid:
            trace_id, state = parent.trace_id, parent.trace_state
        else:
            parent, state = None, None
            trace_id = self._bits(128) or 1
        ctx = SpanContext(trace_id, self._bits(64) or 1, False, _SAMPLED_FLAGS, state)
        span = LightSpan(
            self.processor,
            name,
            ctx,
            parent,
            kind,
            dict(attributes) if attributes else {},
            time.time_ns() if start_time is None else start_time,
            self.resource,
            self.scope,
        )
        if links:
            span._links = tuple(links)
        self.processor.on_start(span, context)  # type: ignore[arg-type]  # a ReadableSpan, as on_end gets
        return span

    @contextlib.contextmanager  # the API's own decorator is private
    def start_as_current_span(  # type: ignore[override]
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: types.Attributes = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> Iterator[trace.Span]:
        span = self.start_span(name, context, kind, attributes, links, start_time)
        with trace.use_span(
            span,
            end_on_exit=end_on_exit,
            record_exception=record_exception,
            set_status_on_exception=set_status_on_exception,
        ) as current:
            yield current


class ProxyTracerProvider(TracerProvider):
    """The SDK's provider (resource, shutdown of its processor) handing out :class:`LightTracer`s
    that feed ``processor`` directly: the proxy has exactly one processor."""

    def __init__(self, processor: BoundedSpanProcessor, resource: Resource) -> None:
        super().__init__(resource=resource, sampler=ALWAYS_ON)
        self.add_span_processor(processor)
        self._processor = processor

    def get_tracer(
        self,
        instrumenting_module_name: str,
        instrumenting_library_version: str | None = None,
        schema_url: str | None = None,
        attributes: types.Attributes = None,
    ) -> trace.Tracer:
        scope = InstrumentationScope(
            instrumenting_module_name, instrumenting_library_version, schema_url, attributes
        )
        return LightTracer(self._processor, self.resource, scope)


def make_provider(
    exporter: SpanExporter, **kwargs: float | int
) -> tuple[TracerProvider, BoundedSpanProcessor]:
    """A TracerProvider for the proxy (service.name ``pdscope-proxy``) exporting to ``exporter``."""
    # ALWAYS_ON: every request's root is recorded and exported (its record needs it), whatever the
    # caller's traceparent says; what else is exported is the processor's choice (sampling above).
    processor = BoundedSpanProcessor(exporter, **kwargs)  # type: ignore[arg-type]
    provider = ProxyTracerProvider(processor, Resource.create({"service.name": semconv.SERVICE_PROXY}))
    return provider, processor


def otlp_exporter(endpoint: str, timeout_s: float = 2.0, token_env: str | None = None) -> SpanExporter:
    """The OTLP/HTTP exporter; with ``token_env`` set in the environment it authenticates."""
    token = os.environ.get(token_env, "").strip() if token_env else ""
    return OtlpHttpExporter(endpoint, timeout_s=timeout_s, token=token or None)


def traceparent(span: trace.Span, sampled: bool | None = None) -> str | None:
    """The W3C ``traceparent`` naming ``span`` as the parent, or None if it is invalid; its
    sampled flag is ``sampled`` (the head decision), or the span's own flags when None."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    flags = int(ctx.trace_flags) if sampled is None else int(sampled)
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{flags:02x}"


def parent_sampled(context: Context | None) -> bool:
    """Whether the caller's ``traceparent`` (as :func:`parse_traceparent` read it) said sampled."""
    if context is None:
        return False
    return trace.get_current_span(context).get_span_context().trace_flags.sampled


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
