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

The root alone is enough (under ``proxy.trace_sample_ratio`` an unsampled request exports
only its root): it carries the outcome, instances, pools, retries, tokens, KV size and the
stage timestamps (``pdscope.*_unix_nano``), each read when no child span gives it, so the
record has the same columns as with its children. Only vLLM's ``llm_request`` spans give the
in-vLLM durations (``p_queue_s`` .. ``d_decode_s``) and vLLM's request ids, and, for a
stream without a usage event (the client did not ask ``stream_options.include_usage``),
``completion_tokens`` and so ``tpot_s``. Spans are
found by their name (``_Trace``), the last attempt of a stage by its ``pdscope.attempt``.
The record is a ``collector.record.AssembledRecord``, its SLO verdict
``pdscope.slo.slo_verdict`` of its status and durations.

Every value is coerced to its column's type: a number must be finite (NaN, ±Infinity,
``"inf"`` and ``"nan"`` count as absent), an integer must fit its column (32 or 64 bits),
a string column takes a string (or a number, spelled out) cut to the column's length,
anything else (a map, a list) counts as absent. A malformed attribute costs only itself.

The KV-aware routing attributes of the root (``routing``) are checked against what they mean,
not only their column's type: token counts are integers in [0, 10**9], the prefix key is 1 to
16 hex digits (stored in lower case), the route path one of ``semconv.ROUTE_PATHS``, the handoff
one of ``semconv.HANDOFFS``. One that is
present but fails its check is left out and named in the record's ``dropped`` notes, which the
sink counts. A decode-only request (``route_path`` "decode_only") has no prefill span and no P
instance: its record has no ``p_*`` stage, as a record from the root alone. The TTFT predictor's
attributes of the root are checked the same way, in ``collector.predicted``, and its tenant
(``pdscope.tenant``: a well-formed id the config declares) in ``collector.tenant``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from collector.otlp import SpanData
from collector.predicted import Predicted, predicted
from collector.record import AssembledRecord, AssemblyNotes, VllmSide
from collector.rootattrs import Check, checked, token_count
from collector.tenant import tenant_of
from pdscope import semconv as sc
from pdscope.config import SLOSettings, TenantSettings
from pdscope.slo import slo_verdict

STATUS_ERROR = 2  # OTLP Status.code

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


_HEX_KEY = re.compile(r"[0-9a-fA-F]{1,16}")
_TOKEN_KEYS = (
    sc.P_PREDICTED_CACHED,
    sc.D_PREDICTED_CACHED,
    sc.P_CACHED_TOKENS,
    sc.D_CACHED_TOKENS,
    sc.PREFIX_TOKENS,
)


@dataclass(frozen=True, slots=True)
class Routing:
    """The root's KV-aware routing attributes, each checked (None: absent or invalid)."""

    route_path: str | None = None
    p_predicted_cached_tokens: int | None = None
    d_predicted_cached_tokens: int | None = None
    p_cached_tokens: int | None = None
    d_cached_tokens: int | None = None
    prefix_tokens: int | None = None
    prefix_key: str | None = None
    handoff: str | None = None  # how the KV went from P to D (semconv.HANDOFFS)
    dropped: tuple[str, ...] = ()  # the keys present but invalid, in semconv order


def _route_path(value: Any) -> str | None:
    return value if isinstance(value, str) and value in sc.ROUTE_PATHS else None


def _handoff(value: Any) -> str | None:
    return value if isinstance(value, str) and value in sc.HANDOFFS else None


def _prefix_key(value: Any) -> str | None:
    return value.lower() if isinstance(value, str) and _HEX_KEY.fullmatch(value) else None


_ROUTING_CHECKS: tuple[tuple[str, Check], ...] = (
    (sc.ROUTE_PATH, _route_path),
    *((key, token_count) for key in _TOKEN_KEYS),
    (sc.PREFIX_KEY, _prefix_key),
    (sc.HANDOFF, _handoff),
)


def routing(attrs: dict[str, Any]) -> Routing:
    """The KV-aware routing fields of a root span's attributes, and the keys that were invalid."""
    values, dropped = checked(attrs, _ROUTING_CHECKS)
    path, p_predicted, d_predicted, p_cached, d_cached, prefix_tokens, prefix_key, handoff = values
    return Routing(
        path, p_predicted, d_predicted, p_cached, d_cached, prefix_tokens, prefix_key, handoff, dropped
    )


def _unix_ns(attrs: dict[str, Any], key: str) -> float | None:
    """A stage timestamp the root carries (Unix ns) in Unix seconds, as a span's would be; or None."""
    n = _int(attrs, key, _INT64)
    return n / 1e9 if n is not None and n > 0 else None


def _last_attempt(spans: Sequence[SpanData]) -> SpanData | None:
    if not spans:
        return None
    return max(spans, key=lambda s: (_num(s.attributes, sc.ATTEMPT) or 0.0, s.start_ts))


def _event_ts(span: SpanData | None, name: str) -> float | None:
    if span is None:
        return None
    for ev in span.events:
        ts = ev.ts
        if ev.name == name and isinstance(ts, int | float) and not isinstance(ts, bool) and math.isfinite(ts):
            return float(ts)
    return None


def _split_vllm(
    vllm: Sequence[SpanData],
    prefill_ids: set[str],
    decode_ids: set[str],
    p_instance: str | None,
    d_instance: str | None,
    decode_only: bool = False,
) -> tuple[SpanData | None, SpanData | None]:
    p_spans: list[SpanData] = []
    d_spans: list[SpanData] = []
    rest: list[SpanData] = []
    for s in vllm:
        if decode_only:  # no P was asked: every vLLM span is D's (even one with max_tokens 1)
            d_spans.append(s)
        elif s.parent_span_id in prefill_ids:
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
        one_token = (
            _int(s.attributes, sc.GEN_AI_COMPLETION_TOKENS) == 1
            and _int(s.attributes, sc.GEN_AI_MAX_TOKENS) == 1
        )
        (p_spans if one_token and not p_spans else d_spans).append(s)
    p = max(p_spans, key=lambda s: s.start_ts) if p_spans else None
    d = max(d_spans, key=lambda s: s.start_ts) if d_spans else None
    return p, d


class _Trace:
    """One trace's spans, by name: the proxy's root, the last attempt of each stage, P's and D's vLLM span."""

    def __init__(self, spans: Iterable[SpanData]) -> None:
        by_name: dict[str, list[SpanData]] = {}
        for s in spans:
            by_name.setdefault(s.name, []).append(s)
        self.count = sum(len(v) for v in by_name.values())
        roots = by_name.get(sc.SPAN_REQUEST)
        self.root = min(roots, key=lambda s: s.start_ts) if roots else None
        prefills = by_name.get(sc.SPAN_PREFILL, [])
        decodes = by_name.get(sc.SPAN_DECODE, [])
        self.prefill = _last_attempt(prefills)
        self.decode = _last_attempt(decodes)
        self.handoff = _last_attempt(by_name.get(sc.SPAN_HANDOFF, []))
        ra = self.root.attributes if self.root is not None else {}
        self.p_instance = _str(ra.get(sc.P_INSTANCE), 128) or _name_of(self.prefill, sc.INSTANCE)
        self.d_instance = _str(ra.get(sc.D_INSTANCE), 128) or _name_of(self.decode, sc.INSTANCE)
        self.p_llm, self.d_llm = _split_vllm(
            by_name.get(sc.VLLM_SPAN, []),
            {s.span_id for s in prefills},
            {s.span_id for s in decodes},
            self.p_instance,
            self.d_instance,
            decode_only=ra.get(sc.ROUTE_PATH) == sc.ROUTE_DECODE_ONLY,
        )


def _name_of(span: SpanData | None, key: str) -> str | None:
    """A name (an instance's, a pool's) from a span's attribute, or None."""
    return _str(span.attributes.get(key), 128) if span is not None else None


def _vllm_side(span: SpanData | None, with_ttft: bool) -> VllmSide | None:
    if span is None:
        return None
    ttft = _num(span.attributes, sc.GEN_AI_TTFT) if with_ttft else None
    return VllmSide(_str(span.attributes.get(sc.GEN_AI_REQUEST_ID), 256), ttft)


def _vllm_num(span: SpanData | None, key: str) -> float | None:
    return _num(span.attributes, key) if span is not None else None


def _first_token(t: _Trace, root: SpanData) -> float | None:
    """The first token: the decode span's event, the root's, D's vLLM TTFT, the handoff's end, or the
    timestamp the root carries (a record from the root alone), the first that says."""
    first_token = _event_ts(t.decode, sc.EVENT_FIRST_TOKEN) or _event_ts(root, sc.EVENT_FIRST_TOKEN)
    d_ttft = _vllm_num(t.d_llm, sc.GEN_AI_TTFT)
    if first_token is None and t.d_llm is not None and d_ttft is not None:
        first_token = t.d_llm.start_ts + d_ttft
    if first_token is None and t.handoff is not None and t.handoff.end_ts > t.handoff.start_ts:
        first_token = t.handoff.end_ts
    if first_token is None:
        first_token = _unix_ns(root.attributes, sc.FIRST_TOKEN_NS)
    return first_token


def _p_done(t: _Trace, ra: dict[str, Any]) -> float | None:
    """P done: the prefill span's end, the handoff's start, or the timestamp the root carries."""
    if t.prefill:
        return t.prefill.end_ts
    if t.handoff is not None:
        return t.handoff.start_ts
    return _unix_ns(ra, sc.P_DONE_NS)


def _outcome(root: SpanData) -> str:
    outcome = root.attributes.get(sc.OUTCOME)
    if not isinstance(outcome, str) or outcome not in sc.OUTCOMES:
        return "error" if root.status_code == STATUS_ERROR else "ok"
    return outcome


def _tokens(t: _Trace, ra: dict[str, Any]) -> tuple[int | None, int | None]:
    """(prompt, completion) tokens: from D's vLLM span, else P's (prompt), else the proxy's (the usage)."""
    prompt = _int(t.d_llm.attributes, sc.GEN_AI_PROMPT_TOKENS) if t.d_llm else None
    if prompt is None and t.p_llm is not None:
        prompt = _int(t.p_llm.attributes, sc.GEN_AI_PROMPT_TOKENS)
    if prompt is None:  # no vLLM span: what the proxy read from P's usage
        prompt = _int(ra, sc.PROMPT_TOKENS)
    completion = _int(t.d_llm.attributes, sc.GEN_AI_COMPLETION_TOKENS) if t.d_llm else None
    if completion is None:
        completion = _int(ra, sc.COMPLETION_TOKENS)
    return prompt, completion


def _tpot(
    completion_tokens: int | None, first_token: float | None, done: float | None, d_decode: float | None
) -> float | None:
    """Time per output token: first token to done over the tokens after the first, else vLLM's decode."""
    if completion_tokens is None or completion_tokens <= 1:
        return None
    if first_token is not None and done is not None:
        return max(0.0, done - first_token) / (completion_tokens - 1)
    if d_decode is not None:
        return d_decode / (completion_tokens - 1)
    return None


def _kv_size(ra: dict[str, Any], handoff: SpanData | None) -> tuple[int | None, int | None]:
    """(blocks, bytes) of the KV handed off: the root's, else the handoff span's."""
    blocks = (
        _int(ra, sc.KV_BLOCKS)
        if sc.KV_BLOCKS in ra
        else (_int(handoff.attributes, sc.KV_BLOCKS) if handoff else None)
    )
    size = (
        _int(ra, sc.KV_BYTES, _INT64)
        if sc.KV_BYTES in ra
        else (_int(handoff.attributes, sc.KV_BYTES, _INT64) if handoff else None)
    )
    return blocks, size


def assemble(
    spans: Iterable[SpanData], slo: SLOSettings, tenants: TenantSettings | None = None
) -> AssembledRecord | None:
    """The record for one trace's spans, or None while the proxy's root span is missing. ``tenants``:
    the ids its tenant may be (``collector.tenant``; None: any well-formed id)."""
    t = _Trace(spans)
    root = t.root
    if root is None or not math.isfinite(root.start_ts):
        return None
    ra = root.attributes
    request_id = _str(ra.get(sc.REQUEST_ID), 128) or root.trace_id
    outcome = _outcome(root)
    prompt_tokens, completion_tokens = _tokens(t, ra)
    stages = _stages(t, root, completion_tokens)
    verdict = slo_verdict(outcome, stages["ttft_s"], stages["tpot_s"], slo)
    kv_blocks, kv_bytes = _kv_size(ra, t.handoff)
    stream = ra.get(sc.STREAM)
    route, pred = routing(ra), predicted(ra)
    tenant, tenant_dropped = tenant_of(ra, tenants)
    return AssembledRecord(
        request_id=request_id[:128],
        trace_id=root.trace_id,
        endpoint=_str(ra.get(sc.ENDPOINT), 64),
        stream=stream if isinstance(stream, bool) else None,
        p_instance=t.p_instance,
        d_instance=t.d_instance,
        p_pool=_str(ra.get(sc.P_POOL), 128) or _name_of(t.prefill, sc.P_POOL),
        d_pool=_str(ra.get(sc.D_POOL), 128) or _name_of(t.decode, sc.D_POOL),
        status=outcome,
        http_status=_int(ra, sc.HTTP_STATUS),
        error=_str(ra.get(sc.ERROR_TYPE), 1024),
        retries=_int(ra, sc.RETRIES) or 0,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        kv_blocks=kv_blocks,
        kv_bytes=kv_bytes,
        **_same_named(route, _ROUTING_COLUMNS),
        **stages,
        slo_ttft_met=verdict.ttft_met,
        slo_tpot_met=verdict.tpot_met,
        slo_met=verdict.met,
        attributes=_notes(t, ra, route.dropped + pred.dropped + tenant_dropped),
        sender=root.sender,
        **_same_named(pred, _PREDICTED_COLUMNS),
        tenant=tenant,
    )


def _notes(t: _Trace, ra: dict[str, Any], dropped: tuple[str, ...]) -> AssemblyNotes:
    """Assembly's notes: the spans, the vLLM sides, the reject reason, the engine id, what was dropped."""
    return AssemblyNotes(
        spans=t.count,
        p_vllm=_vllm_side(t.p_llm, with_ttft=False),
        d_vllm=_vllm_side(t.d_llm, with_ttft=True),
        reject_reason=_str(ra.get(sc.REJECT_REASON), 256),
        remote_engine_id=_str(ra.get(sc.REMOTE_ENGINE_ID), 256),
        dropped=dropped,
    )


# The fields of the root's checked attributes that are record columns of the same name (all but
# ``dropped``, which goes to the record's notes).
_ROUTING_COLUMNS = tuple(f.name for f in fields(Routing) if f.name != "dropped")
_PREDICTED_COLUMNS = tuple(f.name for f in fields(Predicted) if f.name != "dropped")


def _same_named(checked: Routing | Predicted, names: tuple[str, ...]) -> dict[str, Any]:
    """The record's columns named ``names``, as ``checked`` holds them."""
    return {name: getattr(checked, name) for name in names}


def _stages(t: _Trace, root: SpanData, completion_tokens: int | None) -> dict[str, Any]:
    """The record's stage timestamps, the durations vLLM measured, and those derived from the stages."""
    ra = root.attributes
    proxy_in = root.start_ts
    done = root.end_ts if root.end_ts >= root.start_ts else None
    first_token = _first_token(t, root)
    d_decode = _vllm_num(t.d_llm, sc.GEN_AI_DECODE)
    return {
        "proxy_in": proxy_in,
        "p_sent": t.prefill.start_ts if t.prefill else _unix_ns(ra, sc.P_SENT_NS),
        "p_done": _p_done(t, ra),
        "d_sent": t.decode.start_ts if t.decode else _unix_ns(ra, sc.D_SENT_NS),
        "first_token": first_token,
        "done": done,
        "p_queue_s": _vllm_num(t.p_llm, sc.GEN_AI_QUEUE),
        "p_prefill_s": _vllm_num(t.p_llm, sc.GEN_AI_PREFILL),
        "d_queue_s": _vllm_num(t.d_llm, sc.GEN_AI_QUEUE),
        "d_prefill_s": _vllm_num(t.d_llm, sc.GEN_AI_PREFILL),
        "d_decode_s": d_decode,
        "ttft_s": first_token - proxy_in if first_token is not None else None,
        "tpot_s": _tpot(completion_tokens, first_token, done, d_decode),
        "e2e_s": done - proxy_in if done is not None else None,
    }
