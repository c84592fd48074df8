"""The proxy's OTLP/HTTP span exporter: one POST per batch, and a verdict the queue can act on.

OpenTelemetry's own exporter answers only success or failure; the proxy's span queue
(``proxy.tracing``) needs to know whether a batch is worth trying again and when: a
network error, a 408/429 or a 5xx is (after ``Retry-After`` when the collector sends one);
any other 4xx is not (the collector refused the batch itself: retrying would block the
queue behind it). Sends ``Authorization: Bearer <token>`` when a token is given.

Runs on the span-export thread only (a blocking ``httpx.Client``); never logs per batch.

The batch is encoded here (:func:`encode_otlp`), not with OpenTelemetry's encoder: that one
builds a protobuf object per span, attribute and value and hashes each span's resource,
and the export thread holds the GIL while it runs (measured: about a seventh of the proxy's
CPU at ``trace_sample_ratio`` 1.0). The wire bytes are the same message (a test decodes both).
"""

from __future__ import annotations

import email.utils
import logging
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, StatusCode

log = logging.getLogger(__name__)

MAX_RETRY_AFTER_S = 60.0  # a collector's Retry-After is honoured up to this


@dataclass(frozen=True, slots=True)
class Sent:
    """What became of one batch: delivered, or worth another try (after ``retry_after_s``)."""

    ok: bool
    retry: bool = False
    retry_after_s: float | None = None
    status: int | None = None


def retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date), bounded; None if absent
    or bad."""
    if not value:
        return None
    value = value.strip()
    seconds: float | None
    if value.isdigit():
        seconds = float(value)
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    return min(MAX_RETRY_AFTER_S, max(0.0, seconds))


# -- OTLP protobuf, by hand (opentelemetry/proto/trace/v1/trace.proto) -----------------------

_KIND = {k: b"\x30" + bytes((k.value + 1,)) for k in SpanKind}  # Span.kind: OTLP's is the SDK's + 1
_STATUS_UNSET = b"\x7a\x00"  # Span.status, empty
_FLAGS_LOCAL = b"\x85\x01" + struct.pack("<I", 0x100)  # Span.flags (16, fixed32): HAS_IS_REMOTE
_FLAGS_REMOTE = b"\x85\x01" + struct.pack("<I", 0x300)  # ... and IS_REMOTE
_pack_q = struct.Struct("<Q").pack
_pack_d = struct.Struct("<d").pack


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _ld(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag byte(s), the length, the payload."""
    n = len(payload)
    return tag + (bytes((n,)) if n < 0x80 else _varint(n)) + payload


def _value(v: Any) -> bytes:
    """An ``AnyValue`` message's bytes (the oneof is always written, as protobuf does)."""
    if v is None:
        return b""
    if v is True:
        return b"\x10\x01"
    if v is False:
        return b"\x10\x00"
    if isinstance(v, str):
        return _ld(b"\x0a", v.encode())
    if isinstance(v, int):
        return b"\x18" + _varint(v & 0xFFFFFFFFFFFFFFFF)  # int64: negatives as ten bytes
    if isinstance(v, float):
        return b"\x21" + _pack_d(v)
    if isinstance(v, bytes):
        return _ld(b"\x3a", v)
    if isinstance(v, Sequence):
        return _ld(b"\x2a", b"".join(_ld(b"\x0a", _value(x)) for x in v))
    if isinstance(v, Mapping):
        return _ld(b"\x32", b"".join(_ld(b"\x0a", _key_value(str(k), x)) for k, x in v.items()))
    raise TypeError(f"attribute value of type {type(v).__name__} cannot be encoded")


def _key_value(key: str, v: Any) -> bytes:
    return _ld(b"\x0a", key.encode()) + _ld(b"\x12", _value(v))


_MASK64 = 0xFFFFFFFFFFFFFFFF
_CACHE_MAX = 4096
_keys: dict[str, bytes] = {}  # attribute key -> KeyValue.key field
_fields: dict[tuple[bytes, str, str], bytes] = {}  # (tag, key, str value) -> the whole field
_bools: dict[tuple[bytes, str, bool], bytes] = {}
_names: dict[str, bytes] = {}  # span name -> Span.name field


def _attributes(tag: bytes, attrs: Mapping[str, Any] | None) -> bytes:
    """The repeated ``KeyValue`` field ``tag`` for ``attrs``. Keys and string/bool pairs repeat from
    span to span (instance names, outcomes): their encodings are cached (bounded)."""
    if not attrs:
        return b""
    out = []
    for k, v in attrs.items():
        t = type(v)
        if t is int:
            key = _keys.get(k)
            if key is None:
                key = _ld(b"\x0a", k.encode())
                if len(_keys) < _CACHE_MAX:
                    _keys[k] = key
            val = b"\x18" + _varint(v & _MASK64)
            kv = key + b"\x12" + bytes((len(val),)) + val  # an int64 varint is at most 11 bytes
            out.append(_ld(tag, kv))
        elif t is str:
            field = _fields.get((tag, k, v))
            if field is None:
                field = _ld(tag, _key_value(k, v))
                if len(_fields) < _CACHE_MAX and len(v) <= 256:
                    _fields[(tag, k, v)] = field
            out.append(field)
        elif t is bool:
            field = _bools.get((tag, k, v))
            if field is None:
                field = _ld(tag, _key_value(k, v))
                if len(_bools) < _CACHE_MAX:
                    _bools[(tag, k, v)] = field
            out.append(field)
        else:
            out.append(_ld(tag, _key_value(k, v)))
    return b"".join(out)


def _span(span: ReadableSpan) -> bytes:
    ctx = span.get_span_context()
    assert ctx is not None
    parent = span.parent
    parts = [
        b"\x0a\x10",
        ctx.trace_id.to_bytes(16, "big"),
        b"\x12\x08",
        ctx.span_id.to_bytes(8, "big"),
    ]
    if ctx.trace_state:
        parts.append(_ld(b"\x1a", ",".join(f"{k}={v}" for k, v in ctx.trace_state.items()).encode()))
    if parent is not None:
        parts += (b"\x22\x08", parent.span_id.to_bytes(8, "big"))
    name = _names.get(span.name)
    if name is None:
        name = _ld(b"\x2a", span.name.encode())
        if len(_names) < _CACHE_MAX:
            _names[span.name] = name
    parts += (
        name,
        _KIND[span.kind],
        b"\x39",
        _pack_q(span.start_time or 0),
        b"\x41",
        _pack_q(span.end_time or 0),
        _attributes(b"\x4a", span.attributes),
    )
    if span.dropped_attributes:
        parts += (b"\x50", _varint(span.dropped_attributes))
    for event in span.events:
        ev = b"\x09" + _pack_q(event.timestamp) + _ld(b"\x12", event.name.encode())
        ev += _attributes(b"\x1a", event.attributes)
        if event.dropped_attributes:
            ev += b"\x20" + _varint(event.dropped_attributes)
        parts.append(_ld(b"\x5a", ev))
    if span.dropped_events:
        parts += (b"\x60", _varint(span.dropped_events))
    for link in span.links:
        lc = link.context
        lk = b"\x0a\x10" + lc.trace_id.to_bytes(16, "big") + b"\x12\x08" + lc.span_id.to_bytes(8, "big")
        lk += _attributes(b"\x22", link.attributes)
        if link.dropped_attributes:
            lk += b"\x28" + _varint(link.dropped_attributes)
        lk += b"\x35" + struct.pack("<I", 0x300 if lc.is_remote else 0x100)  # Link.flags
        parts.append(_ld(b"\x6a", lk))
    if span.dropped_links:
        parts += (b"\x70", _varint(span.dropped_links))
    status = span.status
    if status.status_code is StatusCode.UNSET and not status.description:
        parts.append(_STATUS_UNSET)
    else:
        st = _ld(b"\x12", status.description.encode()) if status.description else b""
        if status.status_code.value:
            st += b"\x18" + _varint(status.status_code.value)
        parts.append(_ld(b"\x7a", st))
    parts.append(_FLAGS_REMOTE if parent is not None and parent.is_remote else _FLAGS_LOCAL)
    return _ld(b"\x12", b"".join(parts))  # ScopeSpans.spans


def _group(obj: Any, ids: dict[int, int], reps: list[Any]) -> int:
    """The index of ``obj``'s group: by identity first (cheap), else the first equal one."""
    i = ids.get(id(obj))
    if i is None:
        for j, rep in enumerate(reps):
            if rep == obj:
                i = j
                break
        else:
            i = len(reps)
            reps.append(obj)
        ids[id(obj)] = i
    return i


def encode_otlp(batch: Sequence[ReadableSpan]) -> bytes:
    """``ExportTraceServiceRequest`` bytes for ``batch``: one ``ResourceSpans`` per resource and in it
    one ``ScopeSpans`` per instrumentation scope, in the order first seen (as OpenTelemetry's encoder)."""
    r_ids: dict[int, int] = {}
    resources: list[Any] = []
    scopes: list[tuple[dict[int, int], list[Any], list[list[bytes]]]] = []
    for span in batch:
        r = _group(span.resource, r_ids, resources)
        if r == len(scopes):
            scopes.append(({}, [], []))
        s_ids, s_reps, s_spans = scopes[r]
        i = _group(span.instrumentation_scope, s_ids, s_reps)
        if i == len(s_spans):
            s_spans.append([])
        s_spans[i].append(_span(span))
    out = []
    for resource, (_, s_reps, s_spans) in zip(resources, scopes, strict=True):
        body = [_ld(b"\x0a", _attributes(b"\x0a", resource.attributes))]  # ResourceSpans.resource
        for scope, spans in zip(s_reps, s_spans, strict=True):
            sc = b""
            if scope is not None:
                if scope.name:
                    sc += _ld(b"\x0a", scope.name.encode())
                if scope.version:
                    sc += _ld(b"\x12", scope.version.encode())
                sc += _attributes(b"\x1a", scope.attributes)
            ss = [_ld(b"\x0a", sc), *spans]
            if scope is not None and scope.schema_url:
                ss.append(_ld(b"\x1a", scope.schema_url.encode()))
            body.append(_ld(b"\x12", b"".join(ss)))  # ResourceSpans.scope_spans
        if resource.schema_url:
            body.append(_ld(b"\x1a", resource.schema_url.encode()))
        out.append(_ld(b"\x0a", b"".join(body)))  # ExportTraceServiceRequest.resource_spans
    return b"".join(out)


class OtlpHttpExporter(SpanExporter):
    """POST ``ExportTraceServiceRequest`` protobuf to ``endpoint`` (…/v1/traces)."""

    def __init__(self, endpoint: str, *, timeout_s: float = 2.0, token: str | None = None) -> None:
        self.endpoint = endpoint
        headers = {"Content-Type": "application/x-protobuf"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._client = httpx.Client(timeout=timeout_s, headers=headers)

    def send(self, batch: Sequence[ReadableSpan]) -> Sent:
        try:
            payload = encode_otlp(batch)
        except Exception:  # a span the encoder cannot take: the batch can never go
            log.debug("span batch could not be encoded", exc_info=True)
            return Sent(ok=False)
        try:
            resp = self._client.post(self.endpoint, content=payload)
        except httpx.HTTPError as exc:
            log.debug("span export failed: %s", exc)
            return Sent(ok=False, retry=True)
        status = resp.status_code
        if 200 <= status < 300:
            return Sent(ok=True, status=status)
        retryable = status in (408, 429) or status >= 500
        wait = retry_after(resp.headers.get("retry-after")) if retryable else None
        return Sent(ok=False, retry=retryable, retry_after_s=wait, status=status)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS if self.send(spans).ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self._client.close()
