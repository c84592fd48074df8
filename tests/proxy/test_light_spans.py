"""The proxy's own span and OTLP encoding (``proxy.tracing.LightSpan``, ``proxy.spanexport.encode_otlp``):
the same message OpenTelemetry's SDK and encoder would produce, and the API's rules for a span."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from proxy.spanexport import encode_otlp
from proxy.tracing import BoundedSpanProcessor, LightSpan, make_provider, parse_traceparent

CALLER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Keep(SpanExporter):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans += spans
        return SpanExportResult.SUCCESS


def _story(tracer: trace.Tracer, i: int) -> None:
    """Spans of every shape the proxy makes, and more: a remote parent or none, every attribute type,
    an event, a link, an error status, a span ended twice, a set after the end."""
    parent = parse_traceparent(CALLER) if i % 2 else None
    root = tracer.start_span(
        "pdscope.request",
        context=parent,
        kind=SpanKind.SERVER,
        attributes={"s": "x" * (i % 3), "b": bool(i % 2), "i": i, "neg": -i - 1, "f": i / 7, "big": 2**62},
        start_time=1_000 + i,
    )
    root.set_attributes({"tuple": ("a", "b"), "ints": (1, 2, 3)})
    ctx = trace.set_span_in_context(root)
    child = tracer.start_span("pdscope.decode", context=ctx, kind=SpanKind.CLIENT, start_time=2_000 + i)
    child.add_event("first_token", {"n": 1}, timestamp=2_500 + i)
    child.add_event("plain", timestamp=2_600 + i)
    child.set_status(Status(StatusCode.ERROR, "boom") if i % 3 else Status(StatusCode.OK))
    child.end(end_time=3_000 + i)
    child.set_attribute("late", 1)  # ignored: it ended
    child.end(end_time=9_999)  # ignored
    linked = tracer.start_span(
        "linked", context=ctx, links=[Link(root.get_span_context(), {"why": "x"})], start_time=3_100 + i
    )
    linked.end(end_time=3_500 + i)
    root.set_status(StatusCode.ERROR, "failed") if i % 4 == 0 else None
    root.end(end_time=4_000 + i)


@pytest.fixture
def light() -> Iterator[tuple[trace.Tracer, Keep, BoundedSpanProcessor]]:
    keep = Keep()
    provider, processor = make_provider(keep, interval_s=3600.0)
    yield provider.get_tracer("pdscope.proxy", "1.0"), keep, processor
    processor.shutdown()


def test_light_spans_read_as_the_sdk_spans_of_the_same_calls(
    light: tuple[trace.Tracer, Keep, BoundedSpanProcessor],
) -> None:
    tracer, keep, processor = light
    sdk_out = InMemorySpanExporter()
    sdk = TracerProvider(resource=Resource.create({"service.name": "pdscope-proxy"}))
    sdk.add_span_processor(SimpleSpanProcessor(sdk_out))
    sdk_tracer = sdk.get_tracer("pdscope.proxy", "1.0")
    for i in range(12):
        _story(tracer, i)
        _story(sdk_tracer, i)
    assert processor.force_flush()
    ours, theirs = keep.spans, list(sdk_out.get_finished_spans())
    assert all(isinstance(s, LightSpan) for s in ours) and len(ours) == len(theirs) == 36

    def view(s: ReadableSpan) -> tuple[object, ...]:
        ctx = s.get_span_context()
        assert ctx is not None
        return (
            s.name,
            s.kind,
            s.start_time,
            s.end_time,
            dict(s.attributes or {}),
            [(e.name, e.timestamp, dict(e.attributes or {})) for e in s.events],
            [(dict(link.attributes or {})) for link in s.links],
            (s.status.status_code, s.status.description),
            s.parent is None,
            s.parent is not None and s.parent.is_remote,
            ctx.trace_flags.sampled,
        )

    assert [view(s) for s in ours] == [view(s) for s in theirs]
    # the caller's trace id is kept, a local root gets a new one, children share their root's
    assert f"{ours[2].context.trace_id:032x}" != CALLER.split("-")[1]
    assert f"{ours[5].context.trace_id:032x}" == CALLER.split("-")[1]
    assert ours[0].context.trace_id == ours[2].context.trace_id
    assert ours[0].parent is not None and ours[0].parent.span_id == ours[2].context.span_id


def test_encode_otlp_is_the_message_opentelemetrys_encoder_builds(
    light: tuple[trace.Tracer, Keep, BoundedSpanProcessor],
) -> None:
    tracer, keep, processor = light
    sdk_out = InMemorySpanExporter()
    sdk = TracerProvider()
    sdk.add_span_processor(SimpleSpanProcessor(sdk_out))
    for i in range(20):
        _story(tracer, i)
        _story(sdk.get_tracer("other.scope"), i)
    assert processor.force_flush()
    for batch in (
        keep.spans,
        list(sdk_out.get_finished_spans()),
        [*keep.spans[:7], *sdk_out.get_finished_spans()],
    ):
        ours = ExportTraceServiceRequest.FromString(encode_otlp(batch))
        assert ours == encode_spans(batch)
    assert encode_otlp([]) == b""


def test_a_light_span_skips_none_values_and_changes_nothing_after_its_end(
    light: tuple[trace.Tracer, Keep, BoundedSpanProcessor],
) -> None:
    tracer, keep, processor = light
    span = tracer.start_span("s", attributes={"a": 1})
    span.set_attribute("none", None)  # type: ignore[arg-type]
    span.set_attributes({"b": "x", "c": None})  # type: ignore[dict-item]
    assert span.is_recording()
    span.set_status(Status(StatusCode.OK))
    span.set_status(Status(StatusCode.ERROR, "later"))  # OK is final
    span.end(end_time=5)
    assert not span.is_recording()
    span.set_attribute("after", 1)
    span.add_event("after")
    span.update_name("renamed")
    span.end(end_time=9)
    assert processor.force_flush()
    (out,) = keep.spans
    assert out.name == "s" and out.end_time == 5 and dict(out.attributes or {}) == {"a": 1, "b": "x"}
    assert out.status.status_code is StatusCode.OK and not out.events
