"""What the receiver keeps of a decoded span: refuse the invalid, bound the oversized.

``admit`` runs on every decoded span before it is queued for the store. It refuses
(with a reason the receiver counts in ``pdscope_collector_spans_dropped_total``):

- an all-zero trace id or span id (invalid per OTLP; an all-zero parent means "no parent");
- a start or end time that is not finite, older than the retention horizon
  (``max_age_s``: the store would delete it at once, and it would make retention
  walk from that minute) or more than ``max_future_s`` ahead of the collector's clock;

and it bounds what it keeps: at most ``max_attributes`` keys, strings cut to
``max_value_chars``, arrays and maps to ``MAX_ITEMS`` items, all the attributes together
to about ``max_attribute_chars``; NaN and ±Infinity (and integers past 64 bits) become
null; span events with an implausible time are left out. A span that had to be cut is
kept and counted (``truncated``). Pure: no I/O, the clock is passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from collector.otlp import SpanData, SpanEvent

MAX_ITEMS = 64
MAX_KEY_CHARS = 256
MAX_EVENTS = 128
MAX_NAME_CHARS = 256
_INT64 = 2**63
_INT32 = 2**31
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16


@dataclass(frozen=True)
class SpanLimits:
    max_attributes: int = 128
    max_value_chars: int = 2048
    max_attribute_chars: int = 32 * 1024
    max_future_s: float = 300.0
    max_age_s: float = 6 * 3600.0


@dataclass(frozen=True, slots=True)
class Admitted:
    span: SpanData | None  # None: refused
    reason: str | None = None  # why it was refused
    truncated: bool = False  # kept, but attributes or events were cut


def _plain(attrs: dict[str, Any], limits: SpanLimits) -> bool:
    """True when every value is a short scalar (the common case: nothing to rebuild)."""
    if len(attrs) > limits.max_attributes:
        return False
    size = 0
    maxv = limits.max_value_chars
    for k, v in attrs.items():
        t = type(v)
        if t is str:
            if len(v) > maxv:
                return False
            size += len(v)
        elif t is int:
            if not -_INT64 <= v < _INT64:
                return False
        elif t is float:
            if not math.isfinite(v):
                return False
        elif t is not bool and v is not None:
            return False
        size += len(k) + 8
    return size <= limits.max_attribute_chars


class _Budget:
    __slots__ = ("cut", "left")

    def __init__(self, chars: int) -> None:
        self.left = chars
        self.cut = False


def _value(v: Any, limits: SpanLimits, budget: _Budget, depth: int = 0) -> Any:
    if v is None or isinstance(v, bool):
        budget.left -= 5
        return v
    if isinstance(v, int):
        budget.left -= 20
        return v if -_INT64 <= v < _INT64 else None
    if isinstance(v, float):
        budget.left -= 20
        return v if math.isfinite(v) else None
    if isinstance(v, str):
        if len(v) > limits.max_value_chars:
            budget.cut = True
            v = v[: limits.max_value_chars]
        budget.left -= len(v) + 2
        return v
    if isinstance(v, list | tuple):
        if len(v) > MAX_ITEMS:
            budget.cut = True
        out: list[Any] = []
        for x in v[:MAX_ITEMS]:
            if budget.left <= 0:
                budget.cut = True
                break
            out.append(_value(x, limits, budget, depth + 1) if depth < 3 else None)
        return out
    if isinstance(v, dict):
        if len(v) > MAX_ITEMS:
            budget.cut = True
        m: dict[str, Any] = {}
        for k, x in list(v.items())[:MAX_ITEMS]:
            if budget.left <= 0:
                budget.cut = True
                break
            key = str(k)[:MAX_KEY_CHARS]
            budget.left -= len(key) + 4
            m[key] = _value(x, limits, budget, depth + 1) if depth < 3 else None
        return m
    budget.cut = True
    return None


def bound_attributes(attrs: dict[str, Any], limits: SpanLimits) -> tuple[dict[str, Any], bool]:
    """The attributes within the limits, and whether anything was cut."""
    if _plain(attrs, limits):
        return attrs, False
    budget = _Budget(limits.max_attribute_chars)
    out: dict[str, Any] = {}
    for n, (k, v) in enumerate(attrs.items()):
        if n >= limits.max_attributes or budget.left <= 0:
            budget.cut = True
            break
        key = str(k)[:MAX_KEY_CHARS]
        budget.left -= len(key) + 4
        out[key] = _value(v, limits, budget)
    return out, budget.cut


def _plausible(ts: float, lo: float, hi: float) -> bool:
    return math.isfinite(ts) and lo <= ts <= hi


def admit(span: SpanData, now: float, limits: SpanLimits) -> Admitted:
    """Keep (possibly bounded), or refuse with a reason. Never raises."""
    if span.trace_id == _ZERO_TRACE:
        return Admitted(None, "invalid_trace_id")
    if span.span_id == _ZERO_SPAN:
        return Admitted(None, "invalid_span_id")
    if not (math.isfinite(span.start_ts) and math.isfinite(span.end_ts)):
        return Admitted(None, "bad_timestamp")
    lo, hi = now - limits.max_age_s, now + limits.max_future_s
    if span.start_ts < lo:
        return Admitted(None, "too_old")
    if span.start_ts > hi or span.end_ts > hi:
        return Admitted(None, "in_future")
    cut = False
    changes: dict[str, Any] = {}
    if span.parent_span_id == _ZERO_SPAN:
        changes["parent_span_id"] = None
    if not isinstance(span.name, str) or len(span.name) > MAX_NAME_CHARS:
        changes["name"] = str(span.name)[:MAX_NAME_CHARS]
    if span.service is not None and (not isinstance(span.service, str) or len(span.service) > MAX_NAME_CHARS):
        changes["service"] = span.service[:MAX_NAME_CHARS] if isinstance(span.service, str) else None
    for f in ("kind", "status_code"):
        v = getattr(span, f)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < _INT32):
            changes[f] = None
    attrs, attrs_cut = bound_attributes(span.attributes, limits)
    if attrs_cut or attrs is not span.attributes:
        changes["attributes"] = attrs
        cut = cut or attrs_cut
    if span.events:
        events = tuple(e for e in span.events[:MAX_EVENTS] if _plausible(e.ts, lo, hi))
        if len(events) != len(span.events):
            cut = True
            changes["events"] = events
        if any(not isinstance(e.name, str) or len(e.name) > MAX_NAME_CHARS for e in events):
            changes["events"] = tuple(
                SpanEvent(str(e.name)[:MAX_NAME_CHARS], e.ts, e.attributes) for e in events
            )
    return Admitted(replace(span, **changes) if changes else span, None, cut)
