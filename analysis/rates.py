"""The fleet's rates, fitted from a window's request records: the prior of the proxy's TTFT predictor.

The proxy predicts a request's TTFT as a P part plus a handoff part (``pdscope.routing.Rates``):

* **P part**, per P instance: ``prefill_base_s + prefill_s_per_token x tokens``, fitted to
  ``y = p_done - p_sent`` (P's queue and its prefill) against ``x = tokens ahead + own tokens``, the
  uncached prefill tokens the proxy counted ahead of the request on that P when it sent it, plus its
  own (``predict_tokens_ahead + predict_tokens``; where the proxy predicted nothing: its uncached
  prompt, ``prompt_tokens - p_cached_tokens``, and nothing ahead).
* **Handoff part**, per D: the median of ``first_token - p_done`` over the handoffs it served; per
  P x D pair the same, where the pair carried at least ``pair_min_samples`` of them.

The P fit: least squares, then again without the ``trim`` share of the records farthest from the
line (a stall, a retry's tail); a negative base is refitted through the origin. Where there are fewer
than ``min_fit_samples`` records, the tokens show no spread (their standard deviation under
``min_spread`` of their mean), or the line does not rise, the fit is the median of ``y / x`` with base
0 (all the time is taken as proportional to the tokens); with no tokens at all, the base is the median
of ``y`` and the slope unknown. ``error`` is the median of ``|fit(x) - y| / y`` over every sampled
record (None under ``min_fit_samples``: too few to say).

Only served (``ok``) requests count, and none that was retried (its times mix attempts). The work is
bounded: at most ``max_per_instance`` records per P, D and pair, the newest; O(n log n) in all.

Pure: values in, a ``Rates`` out; no I/O, no clock (``now`` is passed in).
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from statistics import median
from typing import NamedTuple, TypeVar

from pdscope.routing import InstanceRate, PairRate, Rates

_MAX_NAME = 256  # InstanceRate.name's bound
_MAX_S = 3600.0  # InstanceRate's bound on a time
_MAX_S_PER_TOKEN = 60.0  # InstanceRate's bound on the slope
_P = TypeVar("_P", tuple[float, float], tuple[float, float, float])


class RateFacts(NamedTuple):
    """One request record's fields the fit reads (any may be None or of the wrong type: it is skipped)."""

    p_instance: object
    d_instance: object
    status: object
    p_sent: object
    p_done: object
    first_token: object
    retries: object
    prompt_tokens: object
    p_cached_tokens: object
    predict_tokens_ahead: object
    predict_tokens: object


# The fields past the first six: the ones a reader of records may have to add to what it reads anyway.
EXTRA_FIELDS = RateFacts._fields[6:]


@dataclass(frozen=True)
class RateConfig:
    max_per_instance: int = 512  # newest records per P, D and pair
    min_fit_samples: int = 10  # below: the ratio fit, and no error
    pair_min_samples: int = 5  # a pair's handoff from fewer is left out (its D's stands)
    trim: float = 0.2  # the share of the farthest records left out of the second fit
    min_spread: float = 0.05  # tokens' stdev / mean under this: no slope can be told from the base


class PrefillFit(NamedTuple):
    base_s: float
    s_per_token: float | None
    samples: int
    error: float | None


@dataclass
class _Sample:
    """The usable points, keyed: P -> (t, x, y); D and pair -> (t, handoff)."""

    prefill: defaultdict[str, list[tuple[float, float, float]]]
    by_d: defaultdict[str, list[tuple[float, float]]]
    by_pair: defaultdict[tuple[str, str], list[tuple[float, float]]]


def _name(v: object) -> str | None:
    return v if isinstance(v, str) and 0 < len(v) <= _MAX_NAME else None


def _time(v: object) -> float | None:
    if isinstance(v, float):  # the hot path: a float column
        return v if math.isfinite(v) else None
    return float(v) if type(v) is int else None  # a bool is no time


def _tokens(v: object) -> int | None:
    return v if type(v) is int and v >= 0 else None  # a bool is no count


def prefill_tokens(r: RateFacts) -> float | None:
    """``x``: the tokens ahead plus the request's own, as the proxy counted them, else its uncached prompt."""
    own = _tokens(r.predict_tokens)
    if own is not None:
        return float(own + (_tokens(r.predict_tokens_ahead) or 0))
    prompt = _tokens(r.prompt_tokens)
    if prompt is None:
        return None
    return float(max(0, prompt - (_tokens(r.p_cached_tokens) or 0)))


def _served_once(r: RateFacts) -> bool:
    retries = r.retries
    return r.status == "ok" and (retries is None or retries == 0)


def _add(sample: _Sample, r: RateFacts) -> None:
    p, d = _name(r.p_instance), _name(r.d_instance)
    p_sent, p_done, first = _time(r.p_sent), _time(r.p_done), _time(r.first_token)
    if p is None or p_done is None:
        return
    x = prefill_tokens(r)
    if p_sent is not None and x is not None and 0.0 < p_done - p_sent <= _MAX_S:
        sample.prefill[p].append((p_done, x, p_done - p_sent))
    if d is not None and first is not None and first - p_done <= _MAX_S:
        handoff = max(0.0, first - p_done)
        sample.by_d[d].append((p_done, handoff))
        sample.by_pair[(p, d)].append((p_done, handoff))


def collect(records: Iterable[RateFacts]) -> _Sample:
    sample = _Sample(defaultdict(list), defaultdict(list), defaultdict(list))
    for r in records:
        if _served_once(r):
            _add(sample, r)
    return sample


def _line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``(base, slope)`` of ``y`` on ``x``; a negative base: through the origin."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx > 0 else 0.0
    base = my - slope * mx
    if base < 0:
        sx2 = sum(x * x for x, _ in points)
        return 0.0, (sum(x * y for x, y in points) / sx2 if sx2 > 0 else 0.0)
    return base, slope


def _spread(xs: Sequence[float]) -> float:
    mean = sum(xs) / len(xs)
    if mean <= 0:
        return 0.0
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs)) / mean


def _ratio_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float | None]:
    ratios = [y / x for x, y in points if x > 0]
    if not ratios:
        return median(y for _, y in points), None
    return 0.0, median(ratios)


def _robust_fit(points: Sequence[tuple[float, float]], cfg: RateConfig) -> tuple[float, float | None]:
    n = len(points)
    if n < cfg.min_fit_samples or _spread([x for x, _ in points]) < cfg.min_spread:
        return _ratio_fit(points)
    base, slope = _line(points)
    keep = max(2, math.ceil(n * (1.0 - cfg.trim)))
    kept = sorted(points, key=lambda p: abs(base + slope * p[0] - p[1]))[:keep]
    base, slope = _line(kept)
    if slope <= 0:
        return _ratio_fit(points)
    return base, slope


def fit_prefill(points: Sequence[tuple[float, float]], cfg: RateConfig = RateConfig()) -> PrefillFit | None:
    """The P part's fit over ``(x, y)`` points (``y > 0``); None without any."""
    if not points:
        return None
    base, slope = _robust_fit(points, cfg)
    base = min(max(0.0, base), _MAX_S)
    slope = None if slope is None else min(slope, _MAX_S_PER_TOKEN)
    error = None
    if len(points) >= cfg.min_fit_samples:
        error = median(abs(base + (slope or 0.0) * x - y) / y for x, y in points)
    return PrefillFit(base, slope, len(points), error)


def _newest(points: list[_P], n: int) -> list[_P]:
    return points if len(points) <= n else heapq.nlargest(n, points, key=lambda p: p[0])


def _instance_rows(sample: _Sample, cfg: RateConfig) -> list[InstanceRate]:
    rows: dict[str, dict[str, object]] = defaultdict(dict)
    for name, pts in sample.prefill.items():
        fit = fit_prefill([(x, y) for _, x, y in _newest(pts, cfg.max_per_instance)], cfg)
        if fit is not None:
            rows[name].update(
                prefill_base_s=fit.base_s, prefill_s_per_token=fit.s_per_token, samples=fit.samples
            )
            rows[name]["error"] = fit.error
    for name, hand in sample.by_d.items():
        newest = _newest(hand, cfg.max_per_instance)
        row = rows[name]
        row["handoff_s"] = min(median(h for _, h in newest), _MAX_S)
        row["samples"] = max(len(newest), _int(row.get("samples")))
    return [InstanceRate.model_validate({"name": name, **rows[name]}) for name in sorted(rows)]


def _int(v: object) -> int:
    return v if isinstance(v, int) else 0


def _pair_rows(sample: _Sample, cfg: RateConfig) -> list[PairRate]:
    out = []
    for (p, d), hand in sorted(sample.by_pair.items()):
        newest = _newest(hand, cfg.max_per_instance)
        if len(newest) >= cfg.pair_min_samples:
            out.append(
                PairRate(
                    prefill=p,
                    decode=d,
                    handoff_s=min(median(h for _, h in newest), _MAX_S),
                    samples=len(newest),
                )
            )
    return out


def fit_rates(
    records: Iterable[RateFacts], now: float, window_s: float, cfg: RateConfig = RateConfig()
) -> Rates:
    """The rates of the window of ``window_s`` seconds before ``now`` from its records (any order).

    Never raises for a record's content: a record without what a part needs is left out of that part.
    An instance that is both a P and a D (a test fleet) gets one row with both parts."""
    sample = collect(records)
    return Rates(
        fitted_at=now,
        window_s=max(0.0, window_s),
        instances=_instance_rows(sample, cfg),
        pairs=_pair_rows(sample, cfg),
    )
