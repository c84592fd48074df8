"""Splitting the pools' limits among proxies: the pure rules (``controller.policy.shares``)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.policy.shares import apportion, prior_rate, smoothed_rate, split


@pytest.mark.parametrize(
    ("prev_rate", "prev_total", "prev_ts", "total", "now", "expected"),
    [
        (5.0, None, None, 100, 10.0, 5.0),  # first report: the prior stands
        (5.0, 100, 10.0, 120, 10.0, 5.0),  # no time passed
        (0.0, 100, 0.0, 130, 30.0, 1.0 * (1 - math.exp(-1))),  # 1/s for one window from 0
        (2.0, 100, 0.0, 100, 30.0, 2.0 * math.exp(-1)),  # no demand: decays by e per window
        (0.0, 500, 0.0, 30, 30.0, 1.0 * (1 - math.exp(-1))),  # counter went back: a restart, count 30
    ],
)
def test_smoothed_rate(
    prev_rate: float, prev_total: int | None, prev_ts: float | None, total: int, now: float, expected: float
) -> None:
    assert smoothed_rate(prev_rate, prev_total, prev_ts, total, now, window_s=30.0) == pytest.approx(expected)


def test_a_steady_rate_is_reached() -> None:
    rate, total = 0.0, 0
    for t in range(1, 301):  # 10 req/s for 300 s, one report a second
        rate = smoothed_rate(rate, total, t - 1.0, total + 10, float(t), 30.0)
        total += 10
    assert rate == pytest.approx(10.0, rel=1e-3)


@pytest.mark.parametrize(
    ("rates", "floor", "expected"),
    [
        ({"a": 0.0, "b": 0.0, "c": 0.0}, 0.2, {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}),  # no demand: equal
        ({"a": 10.0, "b": 10.0}, 0.2, {"a": 0.5, "b": 0.5}),
        ({"a": 30.0, "b": 10.0, "c": 0.0}, 0.0, {"a": 0.75, "b": 0.25, "c": 0.0}),
        ({"a": 30.0, "b": 10.0, "c": 0.0}, 0.3, {"a": 0.1 + 0.525, "b": 0.1 + 0.175, "c": 0.1}),  # idle c
        ({"a": 5.0}, 0.2, {"a": 1.0}),
        ({}, 0.2, {}),
    ],
)
def test_split(rates: dict[str, float], floor: float, expected: dict[str, float]) -> None:
    got = split(rates, floor)
    assert got == pytest.approx(expected)
    if got:
        assert sum(got.values()) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("limit", "shares", "expected"),
    [
        (256, {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}, {"a": 86, "b": 85, "c": 85}),  # ties by id
        (10, {"a": 0.75, "b": 0.25}, {"a": 7, "b": 3}),  # 1 each, then 6 and 2
        (10, {"a": 0.99, "b": 0.01}, {"a": 9, "b": 1}),  # an idle proxy keeps one slot
        (2, {"a": 0.4, "b": 0.3, "c": 0.3}, {"a": 1, "b": 1, "c": 1}),  # more proxies than slots
        (3, {"a": 0.4, "b": 0.3, "c": 0.3}, {"a": 1, "b": 1, "c": 1}),
        (0, {"a": 0.5, "b": 0.5}, {"a": 0, "b": 0}),  # a closed pool stays closed
    ],
)
def test_apportion(limit: int, shares: dict[str, float], expected: dict[str, int]) -> None:
    assert apportion(limit, shares) == expected


@given(
    st.integers(min_value=1, max_value=2**40),
    st.dictionaries(st.text("abcdef", min_size=1, max_size=4), st.floats(0.0, 1.0), min_size=1, max_size=40),
)
def test_apportioned_parts_add_up_to_the_limit(limit: int, raw: dict[str, float]) -> None:
    shares = split(raw, 0.2)
    parts = apportion(limit, shares)
    assert all(n >= 1 for n in parts.values())
    if limit >= len(raw):
        assert sum(parts.values()) == limit
        # the slot each gets first moves a part by 1 - n * share; rounding by less than one more
        n = len(raw)
        assert all(abs(parts[p] - limit * shares[p]) <= 1 + abs(1 - n * shares[p]) + 1e-6 for p in parts)
    else:
        assert sum(parts.values()) == len(raw)


def test_prior_rate_is_the_peers_mean() -> None:
    assert prior_rate([]) == 0.0
    assert prior_rate([3.0, 5.0]) == 4.0


@pytest.mark.parametrize(
    ("target", "limit", "others", "granted"),
    [(85, 256, 170, 85), (85, 256, 200, 56), (85, 256, 256, 0), (85, 256, 300, 0), (0, 256, 0, 0)],
)
def test_a_part_is_granted_within_the_room_the_others_leave(
    target: int, limit: int, others: int, granted: int
) -> None:
    from controller.policy.shares import within_room

    assert within_room(target, limit, others) == granted
