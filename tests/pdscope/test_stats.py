"""pdscope.stats: table cases for each statistic, properties against independent oracles."""

from __future__ import annotations

import math
import random
import statistics
from bisect import bisect_left
from itertools import accumulate

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from pdscope.stats import (
    Histogram,
    counter_increase,
    effective_size,
    histogram_increase,
    histogram_quantile,
    merge_histograms,
    percentile,
    percentiles,
    quantile_interval,
)

LE = (0.1, 0.5, 1.0)
finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


# -- percentile ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([], 50, None),
        ([5.0], 99, 5.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([1.0, 2.0, 3.0, 4.0], 0, 1.0),
        ([1.0, 2.0, 3.0, 4.0], 100, 4.0),
        ([4.0, 1.0, 3.0, 2.0], 25, 1.75),  # order does not matter
        (list(range(1, 11)), 99, 9.91),  # not the maximum: interpolated, as numpy and pandas do
        (list(range(1, 101)), 99, 99.01),
        ([3.0, 3.0, 3.0], 90, 3.0),
    ],
)
def test_percentile_table(values: list[float], q: float, expected: float | None) -> None:
    got = percentile(values, q)
    assert got == (None if expected is None else pytest.approx(expected))


def test_percentiles_sorts_once_and_answers_each_q() -> None:
    assert percentiles([10.0, 0.0], (0, 50, 100)) == [0.0, 5.0, 10.0]
    assert percentiles([], (50, 99)) == [None, None]


@pytest.mark.parametrize("q", [-1.0, 100.5, math.nan])
def test_percentile_rejects_a_q_outside_0_100(q: float) -> None:
    with pytest.raises(ValueError, match=r"quantile must be in 0\.\.100"):
        percentile([1.0, 2.0], q)


@pytest.mark.parametrize("values", [[1.0, math.nan, 2.0], [math.inf, 1.0], [math.nan]])
def test_percentile_rejects_non_finite_values(values: list[float]) -> None:
    with pytest.raises(ValueError, match="non-finite"):
        percentile(values, 50)


@given(st.lists(finite, min_size=2, max_size=60), st.integers(min_value=1, max_value=99))
def test_percentile_is_the_inclusive_quantile_of_the_standard_library(values: list[float], k: int) -> None:
    oracle = statistics.quantiles(values, n=100, method="inclusive")[k - 1]
    assert percentile(values, k) == pytest.approx(oracle, rel=1e-9, abs=1e-6)


@given(st.lists(finite, min_size=1, max_size=60), st.floats(0, 100), st.floats(0, 100))
def test_percentile_is_monotonic_in_q_and_within_the_data(values: list[float], a: float, b: float) -> None:
    lo, hi = sorted((a, b))
    p_lo, p_hi = percentile(values, lo), percentile(values, hi)
    assert p_lo is not None and p_hi is not None
    assert min(values) - 1e-6 <= p_lo <= p_hi + 1e-6 and p_hi <= max(values) + 1e-6


# -- histogram quantile -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("q", "le", "counts", "expected"),
    [
        # 10 observations: 5 in (0, 0.1], 3 in (0.1, 0.5], 2 in (0.5, 1.0]
        (0.5, LE, (5.0, 8.0, 10.0, 10.0), 0.1),
        (0.25, LE, (5.0, 8.0, 10.0, 10.0), 0.05),
        (0.9, LE, (5.0, 8.0, 10.0, 10.0), 0.75),
        (0.0, LE, (5.0, 8.0, 10.0, 10.0), 0.0),
        (1.0, LE, (5.0, 8.0, 10.0, 10.0), 1.0),
        (0.99, LE, (0.0, 0.0, 0.0, 4.0), 1.0),  # all in +Inf: the highest finite bound
        (0.5, LE, (0.0, 0.0, 0.0, 0.0), None),  # empty
        (0.5, (), (7.0,), None),  # only +Inf: no bound to answer with
        (0.0, LE, (0.0, 4.0, 4.0, 4.0), 0.1),  # q=0 over an empty first bucket: the next one's lower bound
        (0.5, (-1.0, 0.0, 1.0), (2.0, 4.0, 6.0, 6.0), -1.0 + 1.0 * (3.0 - 2.0) / 2.0),
        (0.1, (-1.0, 0.0, 1.0), (2.0, 4.0, 6.0, 6.0), -1.0),  # first bound <= 0: that bound
        (0.5, LE, (5.0, 4.0, 10.0, 10.0), 0.1),  # non-monotonic counts are made monotonic first
    ],
)
def test_histogram_quantile_table(
    q: float, le: tuple[float, ...], counts: tuple[float, ...], expected: float | None
) -> None:
    got = histogram_quantile(q, le, counts)
    assert got == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize("q", [-0.1, 1.5, math.nan])
def test_histogram_quantile_rejects_a_q_outside_0_1(q: float) -> None:
    with pytest.raises(ValueError, match=r"quantile must be in 0\.\.1,"):
        histogram_quantile(q, LE, (1.0, 2.0, 3.0, 3.0))


def test_histogram_quantile_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="need 4 counts"):
        histogram_quantile(0.5, LE, (1.0, 2.0, 3.0))


def _histogram(obs: list[float], le: tuple[float, ...]) -> Histogram:
    per = [0.0] * (len(le) + 1)
    for x in obs:
        per[bisect_left(le, x)] += 1  # bucket i holds le[i-1] < x <= le[i]
    return Histogram(le, tuple(accumulate(per)), sum(obs), float(len(obs)))


bounds = st.lists(st.floats(0.001, 100.0), min_size=1, max_size=8, unique=True).map(
    lambda b: tuple(sorted(b))
)
observations = st.lists(st.floats(0.0, 150.0), min_size=1, max_size=80)


@given(bounds, observations, st.floats(0.0, 1.0))
def test_histogram_quantile_lands_in_the_bucket_of_the_true_quantile(
    le: tuple[float, ...], obs: list[float], q: float
) -> None:
    h = _histogram(obs, le)
    got = h.quantile(q)
    assert got is not None
    rank = q * len(obs)
    ordered = sorted(obs)
    # The observation of that rank (at least the first) lies in the bucket the answer interpolates in.
    true = ordered[max(0, math.ceil(rank) - 1)]
    b = bisect_left(le, true)
    if b == len(le):
        assert got == le[-1]
    else:
        lower = le[b - 1] if b > 0 else 0.0
        assert lower - 1e-9 <= got <= le[b] + 1e-9


@given(bounds, observations, st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_histogram_quantile_is_monotonic_in_q(
    le: tuple[float, ...], obs: list[float], a: float, b: float
) -> None:
    lo, hi = sorted((a, b))
    h = _histogram(obs, le)
    q_lo, q_hi = h.quantile(lo), h.quantile(hi)
    assert q_lo is not None and q_hi is not None and q_lo <= q_hi + 1e-9


def test_histogram_checks_its_shape() -> None:
    with pytest.raises(ValueError, match="expected one more count"):
        Histogram(LE, (1.0, 2.0), 0.0, 2.0)
    with pytest.raises(ValueError, match="strictly ascending"):
        Histogram((0.5, 0.1), (1.0, 2.0, 2.0), 0.0, 2.0)
    assert Histogram(LE, (1.0, 2.0, 3.0, 4.0), 2.0, 4.0).mean == 0.5
    assert Histogram(LE, (0.0, 0.0, 0.0, 0.0), 0.0, 0.0).mean is None


# -- counter increase ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([10.0, 15.0, 20.0], 10.0),
        ([10.0, 15.0, 3.0, 8.0], 5.0 + 3.0 + 5.0),  # restart after 15: 3 is the increase since
        ([10.0, None, 12.0], 2.0),
        ([10.0], None),
        ([], None),
        ([None, math.nan, 4.0], None),
        ([1.0, math.inf, 3.0], 2.0),
        ([5.0, 5.0], 0.0),
    ],
)
def test_counter_increase_table(values: list[float | None], expected: float | None) -> None:
    assert counter_increase(values) == expected


# Each step: (increase, restart?). A restart starts the counter from zero, so its value is the
# step's increase; it is seen only when that is below the value before (else it looks like growth).
steps = st.lists(st.tuples(st.integers(0, 1000), st.booleans()), min_size=1, max_size=40)


@given(st.integers(0, 10_000), steps)
def test_counter_increase_recovers_the_true_increase_across_restarts(
    start: int, moves: list[tuple[int, bool]]
) -> None:
    values: list[float | None] = [float(start)]
    true = 0.0
    for inc, restart in moves:
        prev = values[-1]
        assert prev is not None
        if restart and inc < prev:
            values.append(float(inc))
        else:
            values.append(prev + inc)
        true += inc
    assert counter_increase(values) == pytest.approx(true)
    assert counter_increase([None, *values, None]) == pytest.approx(true)  # gaps change nothing


# -- histogram increase -------------------------------------------------------------------


def test_histogram_increase_subtracts_bucket_by_bucket() -> None:
    first = Histogram((1.0,), (3.0, 5.0), 4.0, 5.0)
    last = Histogram((1.0,), (7.0, 12.0), 10.0, 12.0)
    assert histogram_increase([first, last]) == Histogram((1.0,), (4.0, 7.0), 6.0, 7.0)


def test_histogram_increase_takes_a_restarted_sample_whole() -> None:
    a = Histogram((1.0,), (3.0, 5.0), 4.0, 5.0)
    b = Histogram((1.0,), (7.0, 12.0), 10.0, 12.0)
    restarted = Histogram((1.0,), (1.0, 2.0), 1.0, 2.0)
    later = Histogram((1.0,), (2.0, 4.0), 3.0, 4.0)
    assert histogram_increase([a, b, restarted, later]) == Histogram(
        (1.0,), (4.0 + 1.0 + 1.0, 7.0 + 2.0 + 2.0), 6.0 + 1.0 + 2.0, 7.0 + 2.0 + 2.0
    )
    # one bucket went down while the count did not: a restart too (no negative bucket increase)
    odd = Histogram((1.0,), (6.0, 13.0), 11.0, 13.0)
    assert histogram_increase([b, odd]) == odd


def test_histogram_increase_counts_a_new_layout_as_a_restart() -> None:
    old = Histogram((1.0,), (3.0, 5.0), 4.0, 5.0)
    new = Histogram((0.5, 1.0), (1.0, 1.0, 2.0), 1.5, 2.0)
    newer = Histogram((0.5, 1.0), (2.0, 3.0, 5.0), 4.0, 5.0)
    assert histogram_increase([old, new, newer]) == Histogram((0.5, 1.0), (2.0, 3.0, 5.0), 4.0, 5.0)
    # back to the old layout: a restart again; what the other layout saw cannot be added to its buckets
    assert histogram_increase([old, new, old]) == old


def test_histogram_increase_needs_two_samples() -> None:
    h = Histogram((1.0,), (3.0, 5.0), 4.0, 5.0)
    assert histogram_increase([h]) is None
    assert histogram_increase([None, h, None]) is None
    assert histogram_increase([]) is None


batches = st.lists(
    st.tuples(st.lists(st.floats(0.0, 3.0), max_size=10), st.booleans()), min_size=1, max_size=12
)


@given(batches)
def test_histogram_increase_is_the_histogram_of_what_was_observed_since_the_first_sample(
    moves: list[tuple[list[float], bool]],
) -> None:
    le = (0.5, 1.0, 2.0)
    since_start: list[float] = [0.7, 2.5]  # observed before the first sample
    samples = [_histogram(since_start, le)]
    seen: list[float] = []
    for obs, restart in moves:
        before = samples[-1]
        since_start = obs if restart else since_start + obs
        samples.append(_histogram(since_start, le))
        # a restart that looks like growth cannot be told apart (as for counters)
        assume(not restart or samples[-1].count < before.count)
        seen += obs
    got = histogram_increase(samples)
    want = _histogram(seen, le)
    assert got is not None
    assert got.counts == pytest.approx(want.counts) and got.count == pytest.approx(want.count)
    assert got.sum == pytest.approx(want.sum, abs=1e-9)


def test_merge_histograms_adds_same_layouts_only() -> None:
    a = Histogram((1.0,), (1.0, 2.0), 1.0, 2.0)
    b = Histogram((1.0,), (3.0, 3.0), 2.0, 3.0)
    other = Histogram((2.0,), (9.0, 9.0), 9.0, 9.0)
    assert merge_histograms([a, other, b]) == Histogram((1.0,), (4.0, 5.0), 3.0, 5.0)
    assert merge_histograms([]) is None


# -- quantile_interval --------------------------------------------------------------------


def _coverage(n: int, q: float, draws: int = 600) -> float:
    """How often the interval of ``n`` exponential values holds the true ``q``-th percentile."""
    import random

    rng, truth, hits = random.Random(11), -math.log(1.0 - q / 100.0), 0
    for _ in range(draws):
        got = quantile_interval([rng.expovariate(1.0) for _ in range(n)], q)
        assert got is not None
        hits += got[0] <= truth <= got[1]
    return hits / draws


def test_quantile_interval_covers_as_stated() -> None:
    # both ends inside the data: at least the confidence (order statistics make it conservative)
    assert 0.93 <= _coverage(400, 50.0) <= 1.0
    assert 0.93 <= _coverage(2000, 99.0) <= 1.0
    # a p99 over 160: the upper end is the maximum, below the truth with probability 0.99^160
    assert abs(_coverage(160, 99.0) - (0.95 - 0.99**160 + 0.025)) < 0.06


def _clumped(rng: random.Random, n: int, k: int) -> list[float]:
    """``n`` values in clumps of ``k`` alike (one exponential draw each, a hair apart): a queue's slow
    requests, slow together."""
    out: list[float] = []
    while len(out) < n:
        v = rng.expovariate(1.0)
        out += [v + rng.random() * 1e-6 for _ in range(k)]
    return out[:n]


@pytest.mark.parametrize(("q", "n", "k"), [(50.0, 400, 8), (90.0, 400, 8)])
def test_a_clumped_runs_interval_covers_as_stated_at_its_effective_size(q: float, n: int, k: int) -> None:
    rng, truth, draws = random.Random(5), -math.log(1.0 - q / 100.0), 300
    plain = fair = 0
    sizes = []
    for _ in range(draws):
        values = _clumped(rng, n, k)
        sizes.append(effective_size(values))
        a, b = quantile_interval(values, q), quantile_interval(values, q, effective_n=sizes[-1])
        assert a is not None and b is not None and b[0] <= a[0] and a[1] <= b[1]  # only wider
        plain += a[0] <= truth <= a[1]
        fair += b[0] <= truth <= b[1]
    assert plain / draws < 0.7  # read as independent, the clumps' interval is far too narrow
    assert 0.9 <= fair / draws <= 1.0
    assert n / k * 0.8 <= statistics.median(sizes) <= n / k * 1.2  # about one value per clump


def test_effective_size_of_independent_and_ordered_values() -> None:
    rng = random.Random(3)
    values = [rng.random() for _ in range(400)]
    assert effective_size(values) >= 300  # independent: about n
    assert effective_size(sorted(values)) < 10  # one trend: hardly more than one value
    assert effective_size([]) == 0.0 and effective_size([1.0, 2.0]) == 2.0
    assert effective_size([2.0] * 50) >= 1.0  # all tied: no variance to read, at least one value
    with pytest.raises(ValueError):
        effective_size([1.0, 2.0, math.inf])


def test_quantile_interval_at_an_effective_size_scales_its_ranks_to_the_values() -> None:
    values = [float(v) for v in range(1, 161)]
    assert quantile_interval(values, 99.0, effective_n=160) == quantile_interval(values, 99.0)
    assert quantile_interval(values, 99.0, effective_n=1e6) == quantile_interval(values, 99.0)
    lo, hi = quantile_interval(values, 50.0, effective_n=16) or (0.0, 0.0)
    # over 16 values the median's interval is the 4th to 13th smallest: x10 here, outward
    assert (lo, hi) == (40.0, 130.0)
    for bad in (0.5, math.nan, math.inf):
        with pytest.raises(ValueError):
            quantile_interval(values, 50.0, effective_n=bad)


def test_quantile_interval_ends_are_order_statistics() -> None:
    values = [float(v) for v in range(1, 161)]
    lo, hi = quantile_interval(values, 99.0) or (0.0, 0.0)
    assert hi == 160.0 and 150.0 <= lo <= 157.0  # the 5th-worst or so: P(count <= l) <= 2.5 %
    lo50, hi50 = quantile_interval(values, 50.0) or (0.0, 0.0)
    assert lo50 < 80.5 < hi50 and hi50 - lo50 < 30.0
    assert quantile_interval([], 99.0) is None
    assert quantile_interval([3.0], 50.0) == (3.0, 3.0)


@pytest.mark.parametrize(
    ("q", "confidence"), [(0.0, 0.95), (100.0, 0.95), (50.0, 0.0), (50.0, 1.0), (101.0, 0.9)]
)
def test_quantile_interval_refuses_bounds(q: float, confidence: float) -> None:
    with pytest.raises(ValueError):
        quantile_interval([1.0, 2.0], q, confidence)


def test_quantile_interval_refuses_non_finite() -> None:
    with pytest.raises(ValueError):
        quantile_interval([1.0, math.nan], 50.0)
