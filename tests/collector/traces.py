"""Test support: build one P/D request's spans as the proxy and vLLM would, and encode them as OTLP."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from collector.otlp import SpanData, SpanEvent
from collector.spool import Spool
from pdscope import semconv as sc


def new_id(n: int) -> str:
    return os.urandom(n).hex()


def request_spans(
    *,
    t0: float | None = None,
    request_id: str | None = None,
    p: str = "p0",
    d: str = "d0",
    outcome: str = "ok",
    tokens: int = 11,
    with_vllm: bool = True,
    parent_vllm: bool = True,
    stream: bool = True,
    root_attributes: dict[str, Any] | None = None,
) -> list[SpanData]:
    """proxy root + admission + prefill + handoff + decode (+ P's and D's llm_request spans).

    ``root_attributes`` are added to (or replace) the root's; a value of None removes the key.

    Timeline (s after t0): prefill 0.01-0.21, handoff 0.21-0.51, decode 0.22-1.51, first token 0.51.
    ``t0`` defaults to a minute ago (whole seconds), a time the receiver finds plausible. The root
    carries what the proxy's does: the stage timestamps (Unix ns, the children's own), P's prompt
    tokens and, when not streamed, D's completion tokens (a stream here has no usage event).
    """
    if t0 is None:
        t0 = float(int(time.time()) - 60)
    trace = new_id(16)
    rid = request_id or new_id(8)
    root, adm, pre, hand, dec = (new_id(8) for _ in range(5))
    attrs = {
        sc.REQUEST_ID: rid,
        sc.ENDPOINT: "/v1/completions",
        sc.STREAM: stream,
        sc.P_INSTANCE: p,
        sc.D_INSTANCE: d,
        sc.P_POOL: "prefill",
        sc.D_POOL: "decode",
        sc.OUTCOME: outcome,
        sc.RETRIES: 0,
        sc.KV_BLOCKS: 4,
        sc.KV_BYTES: 123456,
        sc.HTTP_STATUS: 200,
        sc.PROMPT_TOKENS: 100,
        sc.P_SENT_NS: round((t0 + 0.01) * 1e9),
        sc.P_DONE_NS: round((t0 + 0.21) * 1e9),
        sc.D_SENT_NS: round((t0 + 0.22) * 1e9),
        sc.FIRST_TOKEN_NS: round((t0 + 0.51) * 1e9),
    }
    if not stream:
        attrs[sc.COMPLETION_TOKENS] = tokens
    for key, value in (root_attributes or {}).items():
        if value is None:
            attrs.pop(key, None)
        else:
            attrs[key] = value

    def span(
        sid: str,
        parent: str | None,
        name: str,
        a: float,
        b: float,
        service: str = sc.SERVICE_PROXY,
        attributes: dict[str, Any] | None = None,
        events: tuple[SpanEvent, ...] = (),
    ) -> SpanData:
        return SpanData(
            trace_id=trace,
            span_id=sid,
            parent_span_id=parent,
            name=name,
            service=service,
            kind=2 if parent is None else 1,
            start_ts=t0 + a,
            end_ts=t0 + b,
            status_code=0,
            attributes=attributes or {},
            events=events,
        )

    spans = [
        span(root, None, sc.SPAN_REQUEST, 0.0, 1.52, attributes=attrs),
        span(adm, root, sc.SPAN_ADMISSION, 0.0, 0.005),
        span(pre, root, sc.SPAN_PREFILL, 0.01, 0.21, attributes={sc.INSTANCE: p, sc.ATTEMPT: 0}),
        span(hand, root, sc.SPAN_HANDOFF, 0.21, 0.51),
        span(
            dec,
            root,
            sc.SPAN_DECODE,
            0.22,
            1.51,
            attributes={sc.INSTANCE: d, sc.ATTEMPT: 0},
            events=(SpanEvent(sc.EVENT_FIRST_TOKEN, t0 + 0.51, {}),),
        ),
    ]
    if with_vllm:
        spans.append(
            span(
                new_id(8),
                pre if parent_vllm else root,
                sc.VLLM_SPAN,
                0.02,
                0.20,
                service=p,
                attributes={
                    sc.GEN_AI_REQUEST_ID: f"cmpl-{rid}-0",
                    sc.GEN_AI_PROMPT_TOKENS: 100,
                    sc.GEN_AI_COMPLETION_TOKENS: 1,
                    sc.GEN_AI_MAX_TOKENS: 1,
                    sc.GEN_AI_QUEUE: 0.03,
                    sc.GEN_AI_PREFILL: 0.12,
                    sc.GEN_AI_TTFT: 0.16,
                },
            )
        )
        spans.append(
            span(
                new_id(8),
                dec if parent_vllm else root,
                sc.VLLM_SPAN,
                0.23,
                1.50,
                service=d,
                attributes={
                    sc.GEN_AI_REQUEST_ID: f"cmpl-{rid}-0",
                    sc.GEN_AI_PROMPT_TOKENS: 100,
                    sc.GEN_AI_COMPLETION_TOKENS: tokens,
                    sc.GEN_AI_MAX_TOKENS: tokens,
                    sc.GEN_AI_QUEUE: 0.25,
                    sc.GEN_AI_PREFILL: 0.01,
                    sc.GEN_AI_DECODE: 0.99,
                    sc.GEN_AI_TTFT: 0.28,
                },
            )
        )
    return spans


def decode_only_spans(
    *, t0: float, request_id: str, d: str = "d0", parent_vllm: bool = True, tokens: int = 11
) -> list[SpanData]:
    """A request the KV-aware router sent to D alone (route path "decode_only"): no prefill, no
    handoff, no P instance; D computed the prompt (reusing 96 cached tokens of 100) and decoded."""
    spans = request_spans(
        t0=t0,
        request_id=request_id,
        d=d,
        tokens=tokens,
        parent_vllm=parent_vllm,
        root_attributes={
            sc.P_INSTANCE: None,
            sc.P_POOL: None,
            sc.P_SENT_NS: None,
            sc.P_DONE_NS: None,
            sc.KV_BLOCKS: None,
            sc.KV_BYTES: None,
            sc.ROUTE_PATH: sc.ROUTE_DECODE_ONLY,
            sc.D_PREDICTED_CACHED: 96,
            sc.D_CACHED_TOKENS: 96,
            sc.PREFIX_KEY: "00c0ffee00c0ffee",
            sc.PREFIX_TOKENS: 96,
        },
    )
    out: list[SpanData] = []
    for s in spans:
        if s.name in (sc.SPAN_PREFILL, sc.SPAN_HANDOFF) or (s.name == sc.VLLM_SPAN and s.service != d):
            continue
        out.append(s)
    return out


def _any(v: Any) -> AnyValue:
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    return AnyValue(string_value=str(v))


def _by_service(spans: Sequence[SpanData]) -> dict[str | None, list[SpanData]]:
    out: dict[str | None, list[SpanData]] = {}
    for s in spans:
        out.setdefault(s.service, []).append(s)
    return out


def to_proto(spans: Sequence[SpanData]) -> bytes:
    req = ExportTraceServiceRequest()
    for service, group in _by_service(spans).items():
        rs = ResourceSpans()
        if service:
            rs.resource.attributes.append(KeyValue(key="service.name", value=AnyValue(string_value=service)))
        ss = ScopeSpans()
        for s in group:
            ps = Span(
                trace_id=bytes.fromhex(s.trace_id),
                span_id=bytes.fromhex(s.span_id),
                parent_span_id=bytes.fromhex(s.parent_span_id) if s.parent_span_id else b"",
                name=s.name,
                kind=s.kind or 0,
                start_time_unix_nano=round(s.start_ts * 1e9),
                end_time_unix_nano=round(s.end_ts * 1e9),
                status=Status(code=s.status_code or 0),
            )
            for k, v in s.attributes.items():
                ps.attributes.append(KeyValue(key=k, value=_any(v)))
            for e in s.events:
                ev = ps.events.add()
                ev.name = e.name
                ev.time_unix_nano = round(e.ts * 1e9)
            ss.spans.append(ps)
        rs.scope_spans.append(ss)
        req.resource_spans.append(rs)
    return req.SerializeToString()


def _json_any(v: Any) -> dict[str, Any]:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    return {"stringValue": str(v)}


def to_json(spans: Sequence[SpanData]) -> bytes:
    resource_spans = []
    for service, group in _by_service(spans).items():
        resource_spans.append(
            {
                "resource": {
                    "attributes": [{"key": "service.name", "value": {"stringValue": service}}]
                    if service
                    else []
                },
                "scopeSpans": [
                    {
                        "scope": {"name": "test"},
                        "spans": [
                            {
                                "traceId": s.trace_id,
                                "spanId": s.span_id,
                                **({"parentSpanId": s.parent_span_id} if s.parent_span_id else {}),
                                "name": s.name,
                                "kind": s.kind,
                                "startTimeUnixNano": str(round(s.start_ts * 1e9)),
                                "endTimeUnixNano": str(round(s.end_ts * 1e9)),
                                "attributes": [
                                    {"key": k, "value": _json_any(v)} for k, v in s.attributes.items()
                                ],
                                "events": [
                                    {"name": e.name, "timeUnixNano": str(round(e.ts * 1e9))} for e in s.events
                                ],
                                "status": {"code": s.status_code or 0},
                            }
                            for s in group
                        ],
                    }
                ],
            }
        )
    return json.dumps({"resourceSpans": resource_spans}).encode()


def take(spool: Spool, n: int = 1_000_000) -> list[SpanData]:
    """The oldest spooled spans (whole batches, up to ``n`` spans), taken out of the spool."""
    batch = spool.peek(n)
    spans = [s for e in batch for s in (e.spans or ())]
    spool.ack(batch)
    return spans
