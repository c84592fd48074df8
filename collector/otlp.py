"""Decode an OTLP/HTTP trace export (protobuf or JSON, optionally gzip) into plain spans.

Accepts what the OpenTelemetry SDKs and the OpenTelemetry Collector send to
``POST /v1/traces``: ``application/x-protobuf`` (an ``ExportTraceServiceRequest``) or
``application/json`` (the OTLP/JSON mapping: camelCase keys, hex ``traceId``/``spanId``,
64-bit integers as strings or numbers). A body that is not an export at all raises
``OTLPDecodeError`` with a reason fit for a 400 response; one malformed span inside an
export costs only itself: ``decode_export`` returns the good spans and the count of the
dropped ones by reason. ``inflate`` decompresses incrementally under a cap on the
inflated size (``BodyTooLarge``) and, optionally, a shared byte budget (``OverBudget``).
No I/O, no store.
"""

from __future__ import annotations

import json
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

MAX_DECOMPRESSED = 64 * 2**20
INFLATE_CHUNK = 256 * 2**10
MAX_VALUE_DEPTH = 4  # arrays/maps nested deeper than this become null


class OTLPDecodeError(ValueError):
    """The body is not an OTLP trace export; ``str()`` is the reason (retrying will not help)."""


class BodyTooLarge(OTLPDecodeError):
    """The body inflates past the cap (a 413, not a 400)."""


class OverBudget(Exception):
    """The shared in-flight byte budget has no room for this body now (a 429: retry later)."""


class SpanEvent(NamedTuple):
    """One span event (e.g. the proxy's ``first_token``): the one shape, received or read back."""

    name: str
    ts: float  # Unix seconds
    attributes: dict[str, Any]


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
    events: tuple[SpanEvent, ...] = ()
    sender: str | None = None  # the name of the OTLP token it came with; None: no auth


@dataclass
class Decoded:
    """The spans of one export and the spans dropped while decoding it, by reason."""

    spans: list[SpanData] = field(default_factory=list)
    dropped: Counter[str] = field(default_factory=Counter)


def inflate(
    body: bytes | bytearray,
    encoding: str | None,
    max_bytes: int = MAX_DECOMPRESSED,
    reserve: Callable[[int], bool] | None = None,
) -> bytes | bytearray:
    """The body decompressed per ``Content-Encoding``, chunk by chunk, never past ``max_bytes``.

    ``reserve(n)`` is asked before each inflated chunk is kept; False raises OverBudget.
    Raises BodyTooLarge past the cap and OTLPDecodeError for a bad or unknown encoding.
    """
    enc = (encoding or "").strip().lower()
    if enc in ("", "identity"):
        return body
    if enc not in ("gzip", "deflate"):
        raise OTLPDecodeError(f"unsupported Content-Encoding {enc!r} (gzip, deflate or none)")
    wbits = 31 if enc == "gzip" else 15
    out = bytearray()
    data: bytes = bytes(body)
    d = zlib.decompressobj(wbits)
    # Each turn keeps up to one chunk or consumes input: bounded by both sizes.
    for _ in range(max_bytes // INFLATE_CHUNK + len(data) + 8):
        try:
            chunk = d.decompress(data, INFLATE_CHUNK)
        except zlib.error as exc:
            raise OTLPDecodeError(f"body is not valid {enc}: {exc}") from exc
        if len(out) + len(chunk) > max_bytes:
            raise BodyTooLarge(f"decompressed body larger than {max_bytes} bytes")
        if chunk and reserve is not None and not reserve(len(chunk)):
            raise OverBudget("in-flight byte budget exhausted while inflating")
        out.extend(chunk)
        data = d.unconsumed_tail
        if d.eof:
            rest = d.unused_data
            if enc == "gzip" and rest.strip(b"\x00"):  # another gzip member follows
                d, data = zlib.decompressobj(wbits), rest
                continue
            return out
        if not data and not chunk:
            raise OTLPDecodeError(f"body is not valid {enc}: truncated stream")
    raise OTLPDecodeError(f"body is not valid {enc}: does not end")


def decompress(body: bytes, encoding: str | None) -> bytes:
    return bytes(inflate(body, encoding))


def decode_export(raw: bytes | bytearray, content_type: str | None, sender: str | None = None) -> Decoded:
    """Spans of one (already inflated) export, and what was dropped. Raises OTLPDecodeError."""
    ctype = (content_type or "application/x-protobuf").split(";")[0].strip().lower()
    try:
        if ctype == "application/json":
            return _decode_json(raw, sender)
        if ctype in ("application/x-protobuf", "application/protobuf", "application/octet-stream"):
            return _decode_proto(raw, sender)
    except RecursionError as exc:
        raise OTLPDecodeError("body nested too deeply") from exc
    raise OTLPDecodeError(f"unsupported Content-Type {ctype!r} (application/x-protobuf or application/json)")


def decode(body: bytes, content_type: str | None, encoding: str | None = None) -> list[SpanData]:
    """Spans of one export request (malformed spans left out). Raises OTLPDecodeError."""
    return decode_export(inflate(body, encoding), content_type).spans


def _str_or_none(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None


# -- protobuf ------------------------------------------------------------------------------


_SCALARS = frozenset({"string_value", "int_value", "double_value", "bool_value"})


def _any_value(v: Any, depth: int = 0) -> Any:
    which = v.WhichOneof("value")
    if which in _SCALARS:
        return getattr(v, which)
    if which is None or depth >= MAX_VALUE_DEPTH:
        return None
    if which == "array_value":
        return [_any_value(x, depth + 1) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _any_value(kv.value, depth + 1) for kv in v.kvlist_value.values}
    if which == "bytes_value":
        return v.bytes_value.hex()
    return None


def _decode_proto(raw: bytes | bytearray, sender: str | None) -> Decoded:
    req = ExportTraceServiceRequest()
    try:
        req.ParseFromString(raw)
    except DecodeError as exc:
        raise OTLPDecodeError(f"body is not an OTLP protobuf ExportTraceServiceRequest: {exc}") from exc
    result = Decoded()
    out = result.spans
    for rs in req.resource_spans:
        service = None
        for kv in rs.resource.attributes:
            if kv.key == "service.name":
                service = kv.value.string_value or None
        for ss in rs.scope_spans:
            for s in ss.spans:
                bad = _proto_bad_id(s)
                if bad is not None:
                    result.dropped[bad] += 1
                    continue
                out.append(_proto_span(s, service, sender))
    return result


def _proto_bad_id(s: Span) -> str | None:
    """Why a protobuf span's ids make it unusable (the drop reason), or None when they are sound."""
    if len(s.trace_id) != 16:
        return "invalid_trace_id"
    if len(s.span_id) != 8:
        return "invalid_span_id"
    parent = s.parent_span_id
    if parent and len(parent) != 8:
        return "invalid_parent_span_id"
    return None


def _proto_span(s: Span, service: str | None, sender: str | None) -> SpanData:
    """One protobuf span (its ids checked by :func:`_proto_bad_id`)."""
    attrs: dict[str, Any] = {}
    for kv in s.attributes:
        v = kv.value
        which = v.WhichOneof("value")
        attrs[kv.key] = getattr(v, which) if which in _SCALARS else _any_value(v)
    events = (
        tuple(
            SpanEvent(
                e.name,
                e.time_unix_nano / 1e9,
                {kv.key: _any_value(kv.value) for kv in e.attributes},
            )
            for e in s.events
        )
        if len(s.events)
        else ()
    )
    status = s.status.code if s.HasField("status") else None
    return SpanData(
        trace_id=s.trace_id.hex(),
        span_id=s.span_id.hex(),
        parent_span_id=s.parent_span_id.hex() or None,
        name=s.name,
        service=service,
        kind=s.kind,
        start_ts=s.start_time_unix_nano / 1e9,
        end_ts=s.end_time_unix_nano / 1e9,
        status_code=status,
        attributes=attrs,
        events=events,
        sender=sender,
    )


# -- JSON ------------------------------------------------------------------------------------


def _json_value(v: Any, depth: int = 0) -> Any:
    if not isinstance(v, dict) or not v:
        return None
    key, val = next(iter(v.items()))
    if key == "intValue":
        return int(val)
    if key == "doubleValue":
        return float(val)
    if key in ("stringValue", "bytesValue"):
        return val if isinstance(val, str) else None
    if key == "boolValue":
        return val if isinstance(val, bool) else None
    if depth >= MAX_VALUE_DEPTH:
        return None
    if key == "arrayValue":
        return [_json_value(x, depth + 1) for x in _values(val)]
    if key == "kvlistValue":
        return {_key(kv): _json_value(kv.get("value"), depth + 1) for kv in _values(val)}
    return None


def _values(val: Any) -> list[Any]:
    items = val.get("values", []) if isinstance(val, dict) else []
    return items if isinstance(items, list) else []


def _key(kv: Any) -> str:
    key = kv["key"]
    if not isinstance(key, str):
        raise TypeError("attribute key is not a string")
    return key


def _json_attrs(items: Any) -> dict[str, Any]:
    if not items:
        return {}
    if not isinstance(items, list):
        raise TypeError("attributes is not a list")
    return {_key(kv): _json_value(kv.get("value")) for kv in items}


_KINDS = {
    "SPAN_KIND_UNSPECIFIED": 0,
    "SPAN_KIND_INTERNAL": 1,
    "SPAN_KIND_SERVER": 2,
    "SPAN_KIND_CLIENT": 3,
    "SPAN_KIND_PRODUCER": 4,
    "SPAN_KIND_CONSUMER": 5,
}
_STATUS = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}


def _enum(value: Any, names: dict[str, int]) -> int:
    if isinstance(value, str) and value in names:
        return names[value]
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError("enum is not a name or an integer")
    n = int(value)
    if not 0 <= n < 2**31:
        raise ValueError("enum out of range")
    return n


def _nanos(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError("timestamp is not an integer")
    return int(value) / 1e9


class _BadId(ValueError):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _hex_id(value: Any, length: int, reason: str) -> str:
    if not isinstance(value, str) or len(value) != length:
        raise _BadId(reason)
    try:
        bytes.fromhex(value)
    except ValueError as exc:
        raise _BadId(reason) from exc
    return value.lower()


def _json_span(s: Any, service: str | None, sender: str | None) -> SpanData:
    if not isinstance(s, dict):
        raise TypeError("span is not an object")
    parent = s.get("parentSpanId") or None
    status = s.get("status") or {}
    if not isinstance(status, dict):
        raise TypeError("status is not an object")
    name = s.get("name", "")
    if not isinstance(name, str):
        raise TypeError("name is not a string")
    events = s.get("events") or []
    if not isinstance(events, list):
        raise TypeError("events is not a list")
    return SpanData(
        trace_id=_hex_id(s.get("traceId"), 32, "invalid_trace_id"),
        span_id=_hex_id(s.get("spanId"), 16, "invalid_span_id"),
        parent_span_id=_hex_id(parent, 16, "invalid_parent_span_id") if parent else None,
        name=name,
        service=service,
        kind=_enum(s.get("kind", 0), _KINDS),
        start_ts=_nanos(s.get("startTimeUnixNano", 0)),
        end_ts=_nanos(s.get("endTimeUnixNano", 0)),
        status_code=_enum(status.get("code", 0), _STATUS) if status else None,
        attributes=_json_attrs(s.get("attributes")),
        events=tuple(_json_event(e) for e in events),
        sender=sender,
    )


def _json_event(e: Any) -> SpanEvent:
    if not isinstance(e, dict):
        raise TypeError("event is not an object")
    name = e.get("name", "")
    return SpanEvent(
        name if isinstance(name, str) else str(name),
        _nanos(e.get("timeUnixNano", 0)),
        _json_attrs(e.get("attributes")),
    )


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


def _decode_json(raw: bytes | bytearray, sender: str | None) -> Decoded:
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OTLPDecodeError(f"body is not JSON: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("resourceSpans", []), list):
        raise OTLPDecodeError("JSON body has no resourceSpans list")
    result = Decoded()
    for rs in doc.get("resourceSpans", []):
        if not isinstance(rs, dict):
            result.dropped["malformed"] += 1
            continue
        resource = rs.get("resource") or {}
        try:
            rattrs = _json_attrs(resource.get("attributes") if isinstance(resource, dict) else None)
        except (KeyError, TypeError, ValueError, OverflowError):
            rattrs = {}
        service = _str_or_none(rattrs.get("service.name"))
        for ss in _list(rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans")):
            spans = _list(ss.get("spans")) if isinstance(ss, dict) else []
            for s in spans:
                try:
                    result.spans.append(_json_span(s, service, sender))
                except _BadId as exc:
                    result.dropped[exc.reason] += 1
                except (AttributeError, KeyError, TypeError, ValueError, OverflowError):
                    result.dropped["malformed"] += 1
    return result
