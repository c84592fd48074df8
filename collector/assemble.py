"""Assemble one request record from the spans of one trace (pure: no I/O, no clock).

The proxy writes the spans named in ``pdscope.semconv``; vLLM adds one ``llm_request``
span per instance (P's and D's) when the proxy forwarded ``traceparent``. Stages::

    proxy_in ─ p_sent ─ p_done ─(handoff: D queue incl. the KV pull)─ first_token ─ done
               └ P llm_request: queue, prefill ┘   d_sent └ D llm_request: queue, prefill, decode ┘

Which ``llm_request`` is P's and which is D's: its parent is the proxy's prefill or decode
span; failing that (a proxy that does not parent them), its ``service.name`` is the P or D
instance's name; failing that, the one with one completion token (P runs ``max_tokens=1``)
is P's. A record needs the proxy's root span (``pdscope.request``); without it
``assemble`` returns ``None`` and the trace waits for the rest of its spans.

Every value is coerced to its column's type: a number must be finite (NaN, ±Infinity,
``"inf"`` and ``"nan"`` count as absent), an integer must fit its column (32 or 64 bits),
a string column takes a string (or a number, spelled out) cut to the column's length,
anything else (a map, a list) counts as absent. A malformed attribute costs only itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pdscope import semconv as sc
from pdscope.config import SLOSettings

STATUS_ERROR = 2  # OTLP Status.code


class SpanLike(Protocol):
    @property
    def trace_id(self) -> str: ...
    @property
    def span_id(self) -> str: ...
    @property
    def parent_span_id(self) -> str | None: ...
    @property
    def name(self) -> str: ...
    @property
    def service(self) -> str | None: ...
    @property
    def start_ts(self) -> float: ...
    @property
    def end_ts(self) -> float: ...
    @property
    def status_code(self) -> int | None: ...
    @property
    def attributes(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Assembled:
    """Column values for one ``store.models.RequestRecord``."""

    values: dict[str, Any]

    @property
    def request_id(self) -> str:
        return str(self.values["request_id"])


EVENTS_KEY = "otel.events"  # where span events are kept in a stored span's attributes


_INT32 = 2**31
_INT64 = 2**63


def _num(attrs: dict[str, Any], key: str) -> float | None:
    """A finite number, or None (absent, not a number, NaN or infinite)."""
    v = attrs.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return f if math.isfinite(f) else None


def _int(attrs: dict[str, Any], key: str, bound: int = _INT32) -> int | None:
    """An integer that fits a column of ``bound`` (2**31 or 2**63), or None."""
    v = _num(attrs, key)
    if v is None:
        return None
    n = int(v)
    return n if -bound <= n < bound else None


def _str(value: Any, length: int) -> str | None:
    """A value for a String(length) column: a string (or a number spelled out), cut; else None."""
    if isinstance(value, str):
        return value[:length] if value else None
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return str(value)[:length]
    return None


def _last_attempt(spans: Sequence[SpanLike]) -> SpanLike | None:
    if not spans:
        return None
    return max(spans, key=lambda s: (_num(s.attributes, sc.ATTEMPT) or 0.0, s.start_ts))


def _event_ts(span: SpanLike | None, name: str) -> float | None:
    if span is None:
        return None
    stored = span.attributes.get(EVENTS_KEY)
    for ev in stored if isinstance(stored, list) else []:
        ts = ev.get("ts") if isinstance(ev, dict) and ev.get("name") == name else None
        if isinstance(ts, int | float) and not isinstance(ts, bool) and math.isfinite(ts):
            return float(ts)
    events = getattr(span, "events", ())
    for ev_name, ts, _attrs in events:
        if ev_name == name and isinstance(ts, int | float) and math.isfinite(ts):
            return float(ts)
    return None


def _split_vllm(
    vllm: Sequence[SpanLike],
    prefill_ids: set[str],
    decode_ids: set[str],
    p_instance: str | None,
    d_instance: str | None,
) -> tuple[SpanLike | None, SpanLike | None]:
    p_spans: list[SpanLike] = []
    d_spans: list[SpanLike] = []
    rest: list[SpanLike] = []
    for s in vllm:
        if s.parent_span_id in prefill_ids:
            p_spans.append(s)
        elif s.parent_span_id in decode_ids:
            d_spans.append(s)
        elif s.service and s.service == p_instance:
            p_spans.append(s)
        elif s.service and s.service == d_instance:
            d_spans.append(s)
        else:
            rest.append(s)
    for s in sorted(rest, key=lambda s: s.start_ts):
        one_token = _int(s.attributes, sc.GEN_AI_COMPLETION_TOKENS) == 1 and _int(s.attributes, sc.GEN_AI_MAX_TOKENS) == 1
        (p_spans if one_token and not p_spans else d_spans).append(s)
    p = max(p_spans, key=lambda s: s.start_ts) if p_spans else None
    d = max(d_spans, key=lambda s: s.start_ts) if d_spans else None
    return p, d


def assemble(spans: Iterable[SpanLike], slo: SLOSettings) -> Assembled | None:
    """The record for one trace's spans, or None while the proxy's root span is missing."""
    by_name: dict[str, list[SpanLike]] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    roots = by_name.get(sc.SPAN_REQUEST)
    if not roots:
        return None
    root = min(roots, key=lambda s: s.start_ts)
    ra = root.attributes
    request_id = _str(ra.get(sc.REQUEST_ID), 128) or root.trace_id
    prefills = by_name.get(sc.SPAN_PREFILL, [])
    decodes = by_name.get(sc.SPAN_DECODE, [])
    prefill = _last_attempt(prefills)
    decode = _last_attempt(decodes)
    handoff = _last_attempt(by_name.get(sc.SPAN_HANDOFF, []))
    p_instance = _str(ra.get(sc.P_INSTANCE), 128) or (_str(prefill.attributes.get(sc.INSTANCE), 128) if prefill else None)
    d_instance = _str(ra.get(sc.D_INSTANCE), 128) or (_str(decode.attributes.get(sc.INSTANCE), 128) if decode else None)
    p_llm, d_llm = _split_vllm(
        by_name.get(sc.VLLM_SPAN, []),
        {s.span_id for s in prefills},
        {s.span_id for s in decodes},
        p_instance,
        d_instance,
    )

    proxy_in = root.start_ts
    if not math.isfinite(proxy_in):
        return None
    done = root.end_ts if root.end_ts >= root.start_ts else None
    p_sent = prefill.start_ts if prefill else None
    p_done = prefill.end_ts if prefill else None
    d_sent = decode.start_ts if decode else None
    first_token = _event_ts(decode, sc.EVENT_FIRST_TOKEN) or _event_ts(root, sc.EVENT_FIRST_TOKEN)
    if first_token is None and d_llm is not None and _num(d_llm.attributes, sc.GEN_AI_TTFT) is not None:
        first_token = d_llm.start_ts + (_num(d_llm.attributes, sc.GEN_AI_TTFT) or 0.0)
    if first_token is None and handoff is not None and handoff.end_ts > handoff.start_ts:
        first_token = handoff.end_ts
    if p_done is None and handoff is not None:
        p_done = handoff.start_ts

    outcome = ra.get(sc.OUTCOME)
    if not isinstance(outcome, str) or outcome not in sc.OUTCOMES:
        outcome = "error" if root.status_code == STATUS_ERROR else "ok"
    prompt_tokens = _int(d_llm.attributes, sc.GEN_AI_PROMPT_TOKENS) if d_llm else None
    if prompt_tokens is None and p_llm is not None:
        prompt_tokens = _int(p_llm.attributes, sc.GEN_AI_PROMPT_TOKENS)
    if prompt_tokens is None:  # no vLLM span: what the proxy read from P's usage
        prompt_tokens = _int(ra, sc.PROMPT_TOKENS)
    completion_tokens = _int(d_llm.attributes, sc.GEN_AI_COMPLETION_TOKENS) if d_llm else None
    if completion_tokens is None:
        completion_tokens = _int(ra, sc.COMPLETION_TOKENS)

    ttft_s = first_token - proxy_in if first_token is not None else None
    e2e_s = done - proxy_in if done is not None else None
    tpot_s: float | None = None
    if completion_tokens is not None and completion_tokens > 1:
        if first_token is not None and done is not None:
            tpot_s = max(0.0, done - first_token) / (completion_tokens - 1)
        elif d_llm is not None and _num(d_llm.attributes, sc.GEN_AI_DECODE) is not None:
            tpot_s = (_num(d_llm.attributes, sc.GEN_AI_DECODE) or 0.0) / (completion_tokens - 1)

    ttft_met = None if ttft_s is None else ttft_s * 1000.0 <= slo.ttft.target_ms
    tpot_met = True if tpot_s is None and ttft_s is not None else (None if tpot_s is None else tpot_s * 1000.0 <= slo.tpot.target_ms)
    slo_met = outcome == "ok" and bool(ttft_met) and bool(tpot_met)

    attributes: dict[str, Any] = {"spans": sum(len(v) for v in by_name.values())}
    if p_llm is not None:
        attributes["p_vllm_request_id"] = _str(p_llm.attributes.get(sc.GEN_AI_REQUEST_ID), 256)
    if d_llm is not None:
        attributes["d_vllm_request_id"] = _str(d_llm.attributes.get(sc.GEN_AI_REQUEST_ID), 256)
        attributes["d_ttft_s"] = _num(d_llm.attributes, sc.GEN_AI_TTFT)
    if _str(ra.get(sc.REJECT_REASON), 256):
        attributes["reject_reason"] = _str(ra.get(sc.REJECT_REASON), 256)
    if _str(ra.get(sc.REMOTE_ENGINE_ID), 256):
        attributes["remote_engine_id"] = _str(ra.get(sc.REMOTE_ENGINE_ID), 256)

    values: dict[str, Any] = {
        "request_id": str(request_id)[:128],
        "trace_id": root.trace_id,
        "endpoint": _str(ra.get(sc.ENDPOINT), 64),
        "stream": ra.get(sc.STREAM) if isinstance(ra.get(sc.STREAM), bool) else None,
        "p_instance": p_instance,
        "d_instance": d_instance,
        "p_pool": _str(ra.get(sc.P_POOL), 128) or (_str(prefill.attributes.get(sc.P_POOL), 128) if prefill else None),
        "d_pool": _str(ra.get(sc.D_POOL), 128) or (_str(decode.attributes.get(sc.D_POOL), 128) if decode else None),
        "status": outcome,
        "http_status": _int(ra, sc.HTTP_STATUS),
        "error": _str(ra.get(sc.ERROR_TYPE), 1024),
        "retries": _int(ra, sc.RETRIES) or 0,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "kv_blocks": _int(ra, sc.KV_BLOCKS) if sc.KV_BLOCKS in ra else (_int(handoff.attributes, sc.KV_BLOCKS) if handoff else None),
        "kv_bytes": (_int(ra, sc.KV_BYTES, _INT64) if sc.KV_BYTES in ra
                     else (_int(handoff.attributes, sc.KV_BYTES, _INT64) if handoff else None)),
        "proxy_in": proxy_in,
        "p_sent": p_sent,
        "p_done": p_done,
        "d_sent": d_sent,
        "first_token": first_token,
        "done": done,
        "p_queue_s": _num(p_llm.attributes, sc.GEN_AI_QUEUE) if p_llm else None,
        "p_prefill_s": _num(p_llm.attributes, sc.GEN_AI_PREFILL) if p_llm else None,
        "d_queue_s": _num(d_llm.attributes, sc.GEN_AI_QUEUE) if d_llm else None,
        "d_prefill_s": _num(d_llm.attributes, sc.GEN_AI_PREFILL) if d_llm else None,
        "d_decode_s": _num(d_llm.attributes, sc.GEN_AI_DECODE) if d_llm else None,
        "ttft_s": ttft_s,
        "tpot_s": tpot_s,
        "e2e_s": e2e_s,
        "slo_ttft_met": ttft_met,
        "slo_tpot_met": tpot_met,
        "slo_met": slo_met,
        "attributes": attributes,
        "sender": getattr(root, "sender", None),
    }
    return Assembled(values)
