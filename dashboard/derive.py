"""Pure arithmetic the dashboard pages share: a snapshot's histograms (increase and quantile
over ``pdscope.stats``), a request's waterfall and the P:D capacity ratio.

No I/O, no Streamlit, no clock: every function takes plain values and returns plain
values, so the pages stay thin and these are tested with tables of cases.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdscope.stats import Histogram
from pdscope.stats import histogram_increase as _increase
from pdscope.stats import histogram_quantile as _quantile
from store.families import HISTOGRAM_BY_PREFIX

# A snapshot's ``histograms`` column keys its families by the scraped name; older or
# hand-written stores may use the bare name or a short alias (the family's column prefix
# in ``store.families``). First match wins.
HISTOGRAM_ALIASES: dict[str, tuple[str, ...]] = {
    short: (family, family.removeprefix("vllm:"), short) for short, family in HISTOGRAM_BY_PREFIX.items()
}


def find_histogram(histograms: Mapping[str, Any] | None, family: str) -> Histogram | None:
    """The histogram ``family`` (a key of HISTOGRAM_ALIASES) from a snapshot, or None
    (also for a malformed one)."""
    if not histograms:
        return None
    for key in HISTOGRAM_ALIASES.get(family, (family,)):
        raw = histograms.get(key)
        if isinstance(raw, Mapping) and "le" in raw and "counts" in raw:
            le = tuple(float(x) for x in raw["le"])
            counts = tuple(float(x) for x in raw["counts"])
            try:
                return Histogram(
                    le, counts, float(raw.get("sum") or 0.0), float(raw.get("count") or counts[-1])
                )
            except (ValueError, IndexError):  # counts not one more than bounds, bounds not ascending
                return None
    return None


def histogram_increase(first: Histogram | None, last: Histogram | None) -> Histogram | None:
    """What was observed between two scrapes (``pdscope.stats.histogram_increase``: a restart
    keeps ``last`` whole); without a first scrape, all of ``last``."""
    if last is None:
        return None
    if first is None:
        return last
    return _increase((first, last))


def histogram_quantile(q: float, hist: Histogram | None) -> float | None:
    """Prometheus-style quantile (``pdscope.stats.histogram_quantile``); None when empty."""
    if hist is None:
        return None
    return _quantile(q, hist.le, hist.counts)


def ratio(num: float | None, den: float | None) -> float | None:
    """num/den, or None when the denominator is missing or zero."""
    if num is None or den is None or den == 0 or math.isnan(num) or math.isnan(den):
        return None
    return num / den


# -- a request's waterfall ---------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One bar of a request's waterfall, in milliseconds from ``proxy_in``."""

    name: str
    start_ms: float
    end_ms: float
    note: str = ""

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms


D_ALONE = "D queue and prefill (decode only)"
STAGE_ORDER = (
    "proxy",
    "P queue",
    "P prefill",
    "handoff (D queue incl. KV pull)",
    D_ALONE,
    "first token",
    "decode",
)


def _cached(rec: Mapping[str, Any], side: str) -> str:
    """ "; 512 of 900 prompt tokens cached (predicted 528)" for P or D, or "" without figures."""
    reported, predicted = rec.get(f"{side}_cached_tokens"), rec.get(f"{side}_predicted_cached_tokens")
    if reported is None and predicted is None:
        return ""
    prompt = rec.get("prompt_tokens")
    of = f" of {prompt}" if prompt is not None else ""
    said = f"{reported}{of} prompt tokens cached" if reported is not None else "cached tokens not reported"
    return f"; {said} (predicted {predicted if predicted is not None else '—'})"


def cache_summary(rec: Mapping[str, Any]) -> str | None:
    """One line on a record's KV-aware routing: path, cached tokens on P and D (reported, then the
    router's prediction) and the matched prefix; None for a record without any of it."""
    path = rec.get("route_path")
    parts: list[str] = []
    if path is not None:
        parts.append("route **decode only** (no P)" if path == "decode_only" else f"route **{path}**")
    for side, name in (("p", "P"), ("d", "D")):
        reported, predicted = rec.get(f"{side}_cached_tokens"), rec.get(f"{side}_predicted_cached_tokens")
        if reported is not None or predicted is not None:
            parts.append(
                f"{name} cached **{'—' if reported is None else reported}** "
                f"(predicted {'—' if predicted is None else predicted})"
            )
    if rec.get("prefix_key") is not None:
        tokens = rec.get("prefix_tokens")
        parts.append(f"prefix `{rec['prefix_key']}`" + (f" ({tokens} tokens)" if tokens is not None else ""))
    return " · ".join(parts) if parts else None


@dataclass(frozen=True)
class _Marks:
    """A record's timestamps in milliseconds after ``proxy_in`` (None: not recorded)."""

    p_sent: float | None
    p_done: float | None
    d_sent: float | None
    first: float | None
    done: float | None

    @classmethod
    def of(cls, rec: Mapping[str, Any], t0: Any) -> _Marks:
        def ms(key: str) -> float | None:
            ts = rec.get(key)
            return None if ts is None else (float(ts) - float(t0)) * 1000.0

        return cls(ms("p_sent"), ms("p_done"), ms("d_sent"), ms("first_token"), ms("done"))


def _entry_stages(rec: Mapping[str, Any], m: _Marks) -> list[Stage]:
    """The proxy's stage, and for a decode-only request D's queue and prefill."""
    if rec.get("route_path") == "decode_only":  # no P: D computed the uncached part itself
        if m.d_sent is None:
            return []
        out = [Stage("proxy", 0.0, m.d_sent, "admission and routing (to D alone)")]
        if m.first is not None:
            out.append(Stage(D_ALONE, m.d_sent, m.first, "D's queue and its prefill" + _cached(rec, "d")))
        return out
    if m.p_sent is not None:
        return [Stage("proxy", 0.0, m.p_sent, "admission and routing")]
    return []


def _p_stages(rec: Mapping[str, Any], m: _Marks) -> list[Stage]:
    """P's queue and prefill, split by vLLM's ``p_queue_s`` when it fits in p_sent→p_done."""
    if m.p_sent is None or m.p_done is None:
        return []
    queue = rec.get("p_queue_s")
    if queue is not None and 0 <= queue * 1000.0 <= m.p_done - m.p_sent:
        split = m.p_sent + float(queue) * 1000.0
        return [
            Stage("P queue", m.p_sent, split, "vLLM time_in_queue on P"),
            Stage("P prefill", split, m.p_done, "prefill and response to the proxy" + _cached(rec, "p")),
        ]
    return [
        Stage("P prefill", m.p_sent, m.p_done, "queue and prefill (no split recorded)" + _cached(rec, "p"))
    ]


def _handoff_stages(rec: Mapping[str, Any], m: _Marks) -> list[Stage]:
    handoff_start = m.p_done if m.p_done is not None else m.d_sent
    if rec.get("route_path") == "decode_only" or handoff_start is None or m.first is None:
        return []
    note = "D queue incl. NIXL KV pull"
    if m.d_sent is not None and m.p_done is not None:
        note += f"; sent to D after {m.d_sent - m.p_done:.1f} ms"
    return [Stage("handoff (D queue incl. KV pull)", handoff_start, m.first, note + _cached(rec, "d"))]


def _token_stages(m: _Marks) -> list[Stage]:
    if m.first is None:
        return []
    stages = [Stage("first token", m.first, m.first, "TTFT")]
    if m.done is not None:
        stages.append(Stage("decode", m.first, m.done, "streamed tokens"))
    return stages


def waterfall(rec: Mapping[str, Any]) -> list[Stage]:
    """The stages of one request record, in order; stages without timestamps are left out.

    proxy = proxy_in→p_sent; P queue and P prefill split p_sent→p_done using vLLM's own
    ``p_queue_s`` (the rest is prefill) when known; handoff = p_done→first_token (D's queue
    and the NIXL pull); first token is a marker; decode = first_token→done. A decode-only request
    (``route_path`` "decode_only": no P) has proxy = proxy_in→d_sent, then D's queue and prefill to
    the first token. P's and D's notes say the cached prompt tokens they reported and the router's
    prediction, when the record has them.
    """
    t0 = rec.get("proxy_in")
    if t0 is None:
        return []
    m = _Marks.of(rec, t0)
    return _entry_stages(rec, m) + _p_stages(rec, m) + _handoff_stages(rec, m) + _token_stages(m)


# -- capacity ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CapacityPlan:
    """Instances needed for a load, from per-instance capacities (tokens/s at saturation)."""

    rate_per_s: float
    mean_prompt: float
    mean_output: float
    c_prefill: float
    c_decode: float
    utilization: float
    n_prefill: int
    n_decode: int
    pd_ratio: float


def pd_ratio(c_prefill: float, c_decode: float, mean_prompt: float, mean_output: float) -> float:
    """n_P / n_D ≈ (C_D / C_P) · (E[prompt] / E[output]), a starting point only."""
    if c_prefill <= 0 or mean_output <= 0:
        raise ValueError("C_P and E[output] must be positive")
    return (c_decode / c_prefill) * (mean_prompt / mean_output)


def capacity_plan(
    rate_per_s: float,
    mean_prompt: float,
    mean_output: float,
    c_prefill: float,
    c_decode: float,
    utilization: float = 0.8,
) -> CapacityPlan:
    """P needs rate·E[prompt]/C_P instances, D needs rate·E[output]/C_D, at ``utilization``."""
    if not 0 < utilization <= 1:
        raise ValueError("utilization must be in (0, 1]")
    if c_prefill <= 0 or c_decode <= 0:
        raise ValueError("per-instance capacities must be positive")
    n_p = math.ceil(rate_per_s * mean_prompt / (c_prefill * utilization) - 1e-9) if rate_per_s > 0 else 0
    n_d = math.ceil(rate_per_s * mean_output / (c_decode * utilization) - 1e-9) if rate_per_s > 0 else 0
    return CapacityPlan(
        rate_per_s=rate_per_s,
        mean_prompt=mean_prompt,
        mean_output=mean_output,
        c_prefill=c_prefill,
        c_decode=c_decode,
        utilization=utilization,
        n_prefill=max(n_p, 1 if rate_per_s > 0 else 0),
        n_decode=max(n_d, 1 if rate_per_s > 0 else 0),
        pd_ratio=pd_ratio(c_prefill, c_decode, mean_prompt, mean_output) if mean_output > 0 else math.inf,
    )
