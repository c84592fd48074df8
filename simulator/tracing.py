"""``llm_request`` spans as vLLM emits them, exported over OTLP/HTTP.

One span per finished request, kind SERVER, named ``llm_request``, started at the
request's arrival and ended at its finish, parented by the incoming ``traceparent``,
with vLLM's ``gen_ai.*`` attributes as real vLLM 0.32.0 exports them (see
tests/fixtures/vllm-0.32.0-cpu/otlp-traces.*): ``top_p``/``n``/``max_tokens``/``temperature``
only when truthy, with vLLM's defaults (top_p 1, n 1, temperature 1), so a request with
``temperature: 0`` has no temperature attribute. ``service.name`` is the instance name. Export is batched
off the hot path by the SDK's BatchSpanProcessor; failures are the exporter's to log.
"""

from __future__ import annotations

import os
from typing import Any

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdscope import semconv
from simulator.model import SimRequest

_PROPAGATOR = TraceContextTextMapPropagator()


class SpanEmitter:
    def __init__(
        self, service_name: str, endpoint: str | None = None, exporter: SpanExporter | None = None
    ) -> None:
        resource = Resource.create(
            {
                "service.name": service_name,
                "vllm.instrumenting_module_name": "vllm.llm_engine",
                "vllm.process_id": str(os.getpid()),
            }
        )
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(exporter or OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("vllm.tracing.otel")

    def emit(
        self, req: SimRequest, wall_offset: float, carrier: dict[str, str], params: dict[str, Any]
    ) -> None:
        """Record ``req``'s span; ``wall_offset`` maps the engine's monotonic clock to epoch seconds."""
        ctx = _PROPAGATOR.extract(carrier) if carrier else None
        start_ns = int((req.arrival + wall_offset) * 1e9)
        end = req.finished_ts if req.finished_ts is not None else req.arrival
        span = self.tracer.start_span(
            semconv.VLLM_SPAN, context=ctx, kind=SpanKind.SERVER, start_time=start_ns
        )
        first = req.first_token_ts
        last = req.last_token_ts or first
        sched = req.scheduled_ts
        attrs: dict[str, Any] = {
            semconv.GEN_AI_REQUEST_ID: req.request_id,
            semconv.GEN_AI_PROMPT_TOKENS: req.prompt_tokens,
            semconv.GEN_AI_COMPLETION_TOKENS: req.generated,
            semconv.GEN_AI_E2E: end - req.arrival,
        }
        if first is not None:
            attrs[semconv.GEN_AI_TTFT] = first - req.arrival
        if sched is not None:
            attrs[semconv.GEN_AI_QUEUE] = sched - req.queued_ts
            if first is not None and last is not None:
                attrs[semconv.GEN_AI_PREFILL] = first - sched
                attrs[semconv.GEN_AI_DECODE] = last - first
                attrs[semconv.GEN_AI_INFERENCE] = last - sched
        for key, attr, default in (
            ("top_p", semconv.GEN_AI_TOP_P, 1.0),
            ("temperature", semconv.GEN_AI_TEMPERATURE, 1.0),
            ("max_tokens", semconv.GEN_AI_MAX_TOKENS, req.max_tokens),
            ("n", semconv.GEN_AI_N, 1),
        ):
            value = params.get(key, default)
            if key == "max_tokens":
                value = req.max_tokens
            if value and isinstance(value, (int, float)):
                attrs[attr] = float(value) if key in ("top_p", "temperature") else int(value)
        span.set_attributes(attrs)
        span.end(end_time=int((end + wall_offset) * 1e9))

    def shutdown(self) -> None:
        self.provider.shutdown()
