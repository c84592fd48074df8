"""The statistics every pdscope layer shares: percentiles of raw values, quantiles of
Prometheus histograms, and the increase of counters and histograms across restarts.

Part of the kernel: standard library only, no I/O, no clock, so the store queries, the
collector's rollups, the dashboard, the simulator's load report and the benchmarks all
compute a p99 or an increase the same way. Nothing here knows a metric's name or how the
store keeps it (``store.families`` does).

**Percentile of raw values** (:func:`percentile`, ``q`` in 0..100) is the linear
interpolation between order statistics: with ``s`` the sorted values and
``h = (n - 1) * q / 100``, the answer is ``s[floor(h)] + (h - floor(h)) * (s[floor(h) + 1] -
s[floor(h)])`` (Hyndman and Fan's type 7). It is the default of numpy, pandas, R and
spreadsheets' ``PERCENTILE.INC``, so a number pdscope prints matches what an operator
computes from the exported records in any of them; it is continuous in the data and in
``q`` (a p99 over few requests does not jump to the maximum), and it is the definition the
controller's SLO percentiles have always used, so its decisions do not move.

**Histogram quantile** (:func:`histogram_quantile`) is Prometheus's
``histogram_quantile()``: linear interpolation inside the bucket holding the rank
``q * count``, from 0 for the first bucket (or that bucket's bound when it is <= 0); a
rank in the +Inf bucket gives the highest finite bound; non-monotonic cumulative counts
are made monotonic first. Where Prometheus would divide 0 by 0 (``q = 0`` over an empty
first bucket) this gives the lower bound of the first non-empty bucket, the limit as ``q``
goes to 0. Prometheus answers NaN or +-Inf for an empty histogram or ``q`` outside 0..1;
here an empty histogram gives ``None`` and a bad ``q`` raises ``ValueError``.

**Counter increase** (:func:`counter_increase`) is Prometheus's ``increase()`` without
extrapolation: the sum of the steps between consecutive samples, where a drop means the
process restarted and the value after the drop is the increase since.

**Histogram increase** (:func:`histogram_increase`) is the same, bucket by bucket, for
one histogram: a drop of the count or of any cumulative bucket, or a change of the bucket
layout, means a restart, and the whole later sample is the increase since.

**Sampling interval of a quantile** (:func:`quantile_interval`) is the distribution-free
confidence interval from order statistics: the number of ``n`` values below the true ``q``
quantile is binomial(``n``, ``q``), so the sorted values ``s[l]`` and ``s[u]`` bracket it with the
probability that this count is in ``l+1..u``; ``l`` and ``u`` leave about half of the rest on each
side. Where no value can hold one side's half, that end is the extreme value and the interval covers
less: a p99 over 160 values has the maximum as its upper end, which is below the true p99 with
probability 0.99^160 = 0.2, so that interval covers 78 % (checked in the tests). It says how far
a quantile of one run could be from another run's of the same process, which a p99 over a few
hundred requests needs: it is set by the two or three worst of them.

That holds for values drawn independently. A served run's are not: requests that queue behind
the same burst, or the same slow instance before the controller cut it, are slow together, and
one run's p99 then moves with how many such clumps it had. **Effective sample size**
(:func:`effective_size`) says how many independent values carry as much: ``n / (1 + 2 S)``, with
``S`` the sum of the lag autocorrelations of the values' ranks in the order given (arrival order),
summed by Geyer's initial positive sequence (lag pairs while their sum is positive, lags up to
:data:`MAX_LAG`). Given it, :func:`quantile_interval` takes its ranks from the binomial over that
many values and scales them to the ``n`` at hand, so a clumped run's interval is as wide as its
clumps make it (a slow-P what-if recording of 178 requests: about 22).

Every function is pure and raises ``ValueError`` (only) for input it cannot give a
meaning to; none mutates its arguments.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram's cumulative buckets: ``counts[i]`` observations <= ``le[i]``,
    ``counts[-1]`` all of them (the +Inf bucket), so ``len(counts) == len(le) + 1``.

    ``le`` holds the finite upper bounds in ascending order. Construction raises
    ``ValueError`` when the lengths do not match or the bounds are not ascending.
    """

    le: tuple[float, ...]
    counts: tuple[float, ...]
    sum: float
    count: float

    def __post_init__(self) -> None:
        if len(self.counts) != len(self.le) + 1:
            raise ValueError(
                f"histogram has {len(self.le)} finite bounds but {len(self.counts)} counts "
                f"(expected one more count, for +Inf)"
            )
        if any(b <= a for a, b in pairwise(self.le)):
            raise ValueError(f"histogram bounds must be strictly ascending, got {list(self.le)}")

    def quantile(self, q: float) -> float | None:
        """:func:`histogram_quantile` of this histogram."""
        return histogram_quantile(q, self.le, self.counts)

    @property
    def mean(self) -> float | None:
        """The mean observation (sum / count); None when empty."""
        return self.sum / self.count if self.count > 0 else None


def _check_q(q: float, top: float) -> None:
    if not 0.0 <= q <= top:  # also false for NaN
        raise ValueError(f"quantile must be in 0..{top:g}, got {q!r}")


def percentiles(values: Sequence[float], qs: Sequence[float]) -> list[float | None]:
    """:func:`percentile` for each of ``qs`` (0..100), sorting ``values`` once.

    Returns one ``None`` per ``q`` for no values. Raises ``ValueError`` for a ``q`` outside
    0..100 or a value that is not finite (NaN has no rank).
    """
    for q in qs:
        _check_q(q, 100.0)
    if not values:
        return [None] * len(qs)
    if len(values) == 1:  # most of a large fleet's P x D pairs in a window
        only = float(values[0])
        if not math.isfinite(only):
            raise ValueError(f"percentile of a non-finite value {only!r}")
        return [only] * len(qs)
    s = sorted(values)
    if not all(map(math.isfinite, s)):
        raise ValueError("percentile of non-finite values (NaN or infinity)")
    return [percentile_of_sorted(s, q) for q in qs]


def percentile_of_sorted(s: Sequence[float], q: float) -> float:
    """:func:`percentile` of values already sorted, finite and not empty (what a reader that keeps them
    sorted between reads asks, ``controller.slowindow``); ``q`` is not checked."""
    last = len(s) - 1
    pos = last * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, last)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (``q`` in 0..100) of raw values, linearly interpolated between
    order statistics (see the module docstring); None for no values. Raises ``ValueError``
    as :func:`percentiles` does."""
    return percentiles(values, (q,))[0]


def _binomial_cdf(n: int, p: float) -> list[float]:
    """P(X <= k) for k in 0..n, X ~ binomial(n, p), 0 < p < 1 (log-space terms: no overflow)."""
    lp, lq = math.log(p), math.log1p(-p)
    logs = [
        math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * lp + (n - k) * lq
        for k in range(n + 1)
    ]
    return list(accumulate(math.exp(x) for x in logs))


def quantile_interval(
    values: Sequence[float], q: float, confidence: float = 0.95, effective_n: float | None = None
) -> tuple[float, float] | None:
    """The distribution-free ``confidence`` interval (0 < confidence < 1) of the ``q``-th percentile
    (``q`` in 0..100, exclusive) of the process ``values`` were drawn from: two of the sorted values
    (see the module docstring); None for no values. ``effective_n``: as many independent values as
    they are worth (:func:`effective_size`; None or ``len(values)`` and over: independent). Raises
    ``ValueError`` as :func:`percentiles` does, and for a ``confidence`` or ``q`` at or outside its
    bounds, or an ``effective_n`` under 1 or not finite."""
    _check_q(q, 100.0)
    if not 0.0 < q < 100.0 or not 0.0 < confidence < 1.0:
        raise ValueError(
            f"quantile_interval needs 0 < q < 100 and 0 < confidence < 1, got {q!r}, {confidence!r}"
        )
    if effective_n is not None and not (math.isfinite(effective_n) and effective_n >= 1.0):
        raise ValueError(f"quantile_interval needs an effective_n of 1 or more, got {effective_n!r}")
    if not values:
        return None
    s = sorted(float(v) for v in values)
    if not all(map(math.isfinite, s)):
        raise ValueError("quantile interval of non-finite values (NaN or infinity)")
    n, tail = len(s), (1.0 - confidence) / 2.0
    m = n if effective_n is None else min(n, int(effective_n))
    cdf = _binomial_cdf(m, q / 100.0)
    # lower end: the largest l with P(count <= l) <= tail (the (l+1)-th smallest of m); upper: the
    # smallest u with P(count <= u) >= 1 - tail; each scaled from m values to n, outward
    lo = max((k for k in range(m) if cdf[k] <= tail), default=0)
    hi = min((k for k in range(m) if cdf[k] >= 1.0 - tail), default=m - 1)
    return s[(lo + 1) * n // m - 1], s[-((-(hi + 1) * n) // m) - 1]


# the longest lag effective_size reads: 100 values back (a clump of slow requests is far shorter)
MAX_LAG = 100


def effective_size(values: Sequence[float]) -> float:
    """How many independent values ``values`` (in the order given) are worth for a quantile: ``n /
    (1 + 2 S)`` over their ranks (see the module docstring), between 1 and ``n``; 0 for none. Raises
    ``ValueError`` for a non-finite value."""
    n = len(values)
    if n < 3:
        return float(n)
    if not all(math.isfinite(float(v)) for v in values):
        raise ValueError("effective size of non-finite values (NaN or infinity)")
    order = sorted(range(n), key=lambda i: float(values[i]))
    ranks = [0.0] * n
    for rank, i in enumerate(order):
        ranks[i] = rank - (n - 1) / 2.0  # centred
    var = sum(r * r for r in ranks)

    def rho(k: int) -> float:
        return sum(a * b for a, b in zip(ranks, ranks[k:], strict=False)) / var

    total, k = 0.0, 1
    while k + 1 < min(n, MAX_LAG + 1):
        pair = rho(k) + rho(k + 1)
        if pair <= 0.0:
            break
        total, k = total + pair, k + 2
    return max(1.0, n / (1.0 + 2.0 * total))


def histogram_quantile(q: float, le: Sequence[float], counts: Sequence[float]) -> float | None:
    """Prometheus ``histogram_quantile(q, ...)`` (``q`` in 0..1) over cumulative ``counts``,
    one more than the finite bounds ``le`` (the last is +Inf).

    None when the histogram holds no observation or has no finite bound. Raises
    ``ValueError`` for ``q`` outside 0..1 or mismatched lengths.
    """
    _check_q(q, 1.0)
    if len(counts) != len(le) + 1:
        raise ValueError(f"{len(le)} finite bounds need {len(le) + 1} counts, got {len(counts)}")
    if not le:
        return None
    cum = list(accumulate(counts, max))  # as Prometheus: force monotonic cumulative counts
    total = cum[-1]
    if not total > 0:
        return None
    rank = q * total
    for b in range(len(le)):
        c = cum[b]
        if c >= rank and c > 0:
            break
    else:  # the rank is in the +Inf bucket: the highest finite bound is the answer
        return float(le[-1])
    upper = float(le[b])
    if b == 0:
        if upper <= 0:
            return upper
        return upper * rank / c
    lower, below = float(le[b - 1]), cum[b - 1]
    return lower + (upper - lower) * (rank - below) / (c - below)


def counter_increase(values: Iterable[float | None]) -> float | None:
    """Increase of a cumulative counter over consecutive samples; a drop is a restart and
    the value after it is the increase since.

    ``None`` and non-finite samples (a failed scrape, a metric the instance lacks) are
    skipped. Fewer than two usable samples give ``None``.
    """
    total = 0.0
    prev: float | None = None
    seen = 0
    for v in values:
        if v is None or not math.isfinite(v):
            continue
        seen += 1
        if prev is not None:
            total += v - prev if v >= prev else v
        prev = v
    return total if seen >= 2 else None


def _restarted(prev: Histogram, cur: Histogram) -> bool:
    return cur.count < prev.count or any(b < a for a, b in zip(prev.counts, cur.counts, strict=True))


def histogram_increase(samples: Iterable[Histogram | None]) -> Histogram | None:
    """A histogram's increase over consecutive samples of it, bucket by bucket.

    The result has the last sample's bucket layout. Each step adds ``cur - prev``; a
    restart (the count or any cumulative bucket went down, or the layout changed) adds the
    whole ``cur`` instead. Steps into a sample of another layout than the last one's add
    nothing (their buckets cannot be added to the result's). ``None`` samples are skipped;
    fewer than two samples give ``None``.
    """
    shapes = [h for h in samples if h is not None]
    if len(shapes) < 2:
        return None
    le = shapes[-1].le
    counts = [0.0] * (len(le) + 1)
    total_sum = 0.0
    total_count = 0.0
    for prev, cur in pairwise(shapes):
        if cur.le != le:
            continue
        if prev.le != le or _restarted(prev, cur):
            for i, b in enumerate(cur.counts):
                counts[i] += b
            total_sum += cur.sum
            total_count += cur.count
        else:
            for i, (a, b) in enumerate(zip(prev.counts, cur.counts, strict=True)):
                counts[i] += b - a
            total_sum += cur.sum - prev.sum
            total_count += cur.count - prev.count
    return Histogram(le, tuple(counts), total_sum, total_count)


def merge_histograms(histograms: Iterable[Histogram]) -> Histogram | None:
    """The bucket-wise sum of histograms (e.g. one per instance of a pool); histograms of
    another layout than the first one's are left out. None for none."""
    merged: Histogram | None = None
    for h in histograms:
        if merged is None:
            merged = h
        elif merged.le == h.le:
            merged = Histogram(
                merged.le,
                tuple(a + b for a, b in zip(merged.counts, h.counts, strict=True)),
                merged.sum + h.sum,
                merged.count + h.count,
            )
    return merged
