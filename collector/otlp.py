"""Decode an OTLP/HTTP trace export (protobuf or JSON, optionally gzip) into plain spans.

Accepts what the OpenTelemetry SDKs and the OpenTelemetry Collector send to
``POST /v1/traces``: ``application/x-protobuf`` (an ``ExportTraceServiceRequest``) or
``application/json`` (the OTLP/JSON mapping: camelCase keys, hex ``traceId``/``spanId``,
64-bit integers as strings or numbers). Anything else raises ``OTLPDecodeError`` with a
reason fit for a 400 response. No I/O, no store.
"""

from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

MAX_DECOMPRESSED = 64 * 2**20


class OTLPDecodeError(ValueError):
    """The body is not an OTLP trace export; ``str()`` is the reason (retrying will not help)."""


@dataclass(frozen=True, slots=True)
class SpanData:
    trace_id: str  # 32 hex chars
    span_id: str  # 16 hex chars
    parent_span_id: str | None
    name: str
    service: str | None
    kind: int | None
    start_ts: float  # Unix seconds
    end_ts: float
    status_code: int | None
    attributes: dict[str, Any]
    events: tuple[tuple[str, float, dict[str, Any]], ...] = ()


def decompress(body: bytes, encoding: str | None) -> bytes:
    enc = (encoding or "").strip().lower()
    if enc in ("", "identity"):
        return body
    if enc not in ("gzip", "deflate"):
        raise OTLPDecodeError(f"unsupported Content-Encoding {enc!r} (gzip, deflate or none)")
    try:
        out = gzip.decompress(body) if enc == "gzip" else zlib.decompress(body)
    except (OSError, EOFError, zlib.error) as exc:
        raise OTLPDecodeError(f"body is not valid {enc}: {exc}") from exc
    if len(out) > MAX_DECOMPRESSED:
        raise OTLPDecodeError(f"decompressed body larger than {MAX_DECOMPRESSED} bytes")
    return out


def decode(body: bytes, content_type: str | None, encoding: str | None = None) -> list[SpanData]:
    """Spans of one export request. Raises OTLPDecodeError."""
    raw = decompress(body, encoding)
    ctype = (content_type or "application/x-protobuf").split(";")[0].strip().lower()
    if ctype == "application/json":
        return _decode_json(raw)
    if ctype in ("application/x-protobuf", "application/protobuf", "application/octet-stream"):
        return _decode_proto(raw)
    raise OTLPDecodeError(f"unsupported Content-Type {ctype!r} (application/x-protobuf or application/json)")


# -- protobuf ------------------------------------------------------------------------------


_SCALARS = frozenset({"string_value", "int_value", "double_value", "bool_value"})


def _any_value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which in _SCALARS:
        return getattr(v, which)
    if which is None:
        return None
    if which == "array_value":
        return [_any_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _any_value(kv.value) for kv in v.kvlist_value.values}
    if which == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, which)


def _decode_proto(raw: bytes) -> list[SpanData]:
    req = ExportTraceServiceRequest()
    try:
        req.ParseFromString(raw)
    except DecodeError as exc:
        raise OTLPDecodeError(f"body is not an OTLP protobuf ExportTraceServiceRequest: {exc}") from exc
    out: list[SpanData] = []
    for rs in req.resource_spans:
        service = None
        for kv in rs.resource.attributes:
            if kv.key == "service.name":
                service = kv.value.string_value or None
        for ss in rs.scope_spans:
            for s in ss.spans:
                trace_id, span_id = s.trace_id, s.span_id
                if len(trace_id) != 16 or len(span_id) != 8:
                    raise OTLPDecodeError("span with a trace_id that is not 16 bytes or a span_id that is not 8")
                attrs: dict[str, Any] = {}
                for kv in s.attributes:
                    v = kv.value
                    which = v.WhichOneof("value")
                    attrs[kv.key] = getattr(v, which) if which in _SCALARS else _any_value(v)
                events = (
                    tuple(
                        (e.name, e.time_unix_nano / 1e9, {kv.key: _any_value(kv.value) for kv in e.attributes})
                        for e in s.events
                    )
                    if len(s.events)
                    else ()
                )
                status = s.status.code if s.HasField("status") else None
                out.append(
                    SpanData(
                        trace_id.hex(),
                        span_id.hex(),
                        s.parent_span_id.hex() or None,
                        s.name,
                        service,
                        s.kind,
                        s.start_time_unix_nano / 1e9,
                        s.end_time_unix_nano / 1e9,
                        status,
                        attrs,
                        events,
                    )
                )
    return out


# -- JSON ------------------------------------------------------------------------------------


def _json_value(v: Any) -> Any:
    if not isinstance(v, dict) or not v:
        return None
    key, val = next(iter(v.items()))
    if key == "intValue":
        return int(val)
    if key == "doubleValue":
        return float(val)
    if key == "arrayValue":
        return [_json_value(x) for x in (val or {}).get("values", [])]
    if key == "kvlistValue":
        return {kv["key"]: _json_value(kv.get("value")) for kv in (val or {}).get("values", [])}
    return val


def _json_attrs(items: Any) -> dict[str, Any]:
    if not items:
        return {}
    return {kv["key"]: _json_value(kv.get("value")) for kv in items}


_KINDS = {"SPAN_KIND_UNSPECIFIED": 0, "SPAN_KIND_INTERNAL": 1, "SPAN_KIND_SERVER": 2, "SPAN_KIND_CLIENT": 3,
          "SPAN_KIND_PRODUCER": 4, "SPAN_KIND_CONSUMER": 5}
_STATUS = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}


def _enum(value: Any, names: dict[str, int]) -> int:
    if isinstance(value, str) and value in names:
        return names[value]
    return int(value)


def _hex_id(value: Any, length: int, what: str) -> str:
    if not isinstance(value, str) or len(value) != length:
        raise OTLPDecodeError(f"{what} must be {length} hex characters")
    try:
        bytes.fromhex(value)
    except ValueError as exc:
        raise OTLPDecodeError(f"{what} is not hex") from exc
    return value.lower()


def _decode_json(raw: bytes) -> list[SpanData]:
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OTLPDecodeError(f"body is not JSON: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("resourceSpans", []), list):
        raise OTLPDecodeError("JSON body has no resourceSpans list")
    out: list[SpanData] = []
    try:
        for rs in doc.get("resourceSpans", []):
            service = _json_attrs((rs.get("resource") or {}).get("attributes")).get("service.name")
            for ss in rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans") or []:
                for s in ss.get("spans", []):
                    parent = s.get("parentSpanId") or None
                    status = s.get("status") or {}
                    out.append(
                        SpanData(
                            trace_id=_hex_id(s.get("traceId"), 32, "traceId"),
                            span_id=_hex_id(s.get("spanId"), 16, "spanId"),
                            parent_span_id=_hex_id(parent, 16, "parentSpanId") if parent else None,
                            name=str(s.get("name", "")),
                            service=service,
                            kind=_enum(s.get("kind", 0), _KINDS),
                            start_ts=int(s.get("startTimeUnixNano", 0)) / 1e9,
                            end_ts=int(s.get("endTimeUnixNano", 0)) / 1e9,
                            status_code=_enum(status.get("code", 0), _STATUS) if status else None,
                            attributes=_json_attrs(s.get("attributes")),
                            events=tuple(
                                (str(e.get("name", "")), int(e.get("timeUnixNano", 0)) / 1e9, _json_attrs(e.get("attributes")))
                                for e in s.get("events") or []
                            ),
                        )
                    )
    except OTLPDecodeError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise OTLPDecodeError(f"JSON body is not an OTLP trace export: {type(exc).__name__}: {exc}") from exc
    return out
