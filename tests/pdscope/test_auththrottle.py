"""pdscope.auththrottle: wrong tokens per address counted, logged once per window, throttled; bounded."""

from __future__ import annotations

import logging

import pytest

from pdscope.auththrottle import INVALID, MISSING, AuthThrottle, bearer_failure


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def throttle(clock: Clock, **kw: object) -> AuthThrottle:
    args: dict[str, object] = {"max_failures": 3, "window_s": 60.0, "block_s": 300.0, "max_sources": 100}
    args.update(kw)
    return AuthThrottle("test API", clock=clock, **args)  # type: ignore[arg-type]


def test_more_than_max_failures_in_a_window_blocks_the_address_for_block_s() -> None:
    clock = Clock()
    t = throttle(clock)
    for _ in range(3):
        assert t.blocked("10.0.0.1") is None
        t.failed("10.0.0.1", INVALID)
    assert t.blocked("10.0.0.1") is None  # three is the limit, not past it
    t.failed("10.0.0.1", INVALID)
    assert t.blocked("10.0.0.1") == 300
    assert t.blocked("10.0.0.2") is None  # only that address
    clock.now += 299.5
    assert t.blocked("10.0.0.1") == 1  # Retry-After is at least 1
    clock.now += 0.5
    assert t.blocked("10.0.0.1") is None  # served its time: a fresh window
    t.failed("10.0.0.1", INVALID)
    assert t.blocked("10.0.0.1") is None
    assert t.counts() == {"missing": 0, "invalid": 5, "throttled": 2}


def test_failures_spread_over_windows_never_block() -> None:
    clock = Clock()
    t = throttle(clock)
    for _ in range(10):
        for _ in range(3):
            t.failed("a", INVALID)
        clock.now += 60.0
        assert t.blocked("a") is None


def test_a_missing_token_is_counted_but_is_no_guess() -> None:
    t = throttle(Clock())
    for _ in range(50):
        t.failed("a", MISSING)
    assert t.blocked("a") is None
    assert t.counts()["missing"] == 50


def test_logged_once_per_address_and_window_plus_the_block(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    t = throttle(clock)
    with caplog.at_level(logging.WARNING, logger="pdscope.auththrottle"):
        for _ in range(10):
            if t.blocked("a") is None:
                t.failed("a", INVALID)
        t.failed("b", MISSING)
        clock.now += 400.0  # block served, next window
        t.blocked("a")
        t.failed("a", INVALID)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4, lines
    assert "from a" in lines[0] and "a sent more than 3 wrong tokens" in lines[1]
    assert "from b" in lines[2] and "from a" in lines[3]


def test_memory_is_bounded_the_least_recently_seen_forgotten_first() -> None:
    clock = Clock()
    t = throttle(clock, max_sources=10, max_failures=1)
    t.failed("old", INVALID)
    t.failed("old", INVALID)
    assert t.blocked("old") == 300
    for i in range(10_000):
        t.failed(f"10.1.{i // 256}.{i % 256}", INVALID)
    assert len(t) == 10
    assert t.blocked("old") is None  # forgotten: the bound holds whoever connects


def test_bearer_failure_reasons() -> None:
    assert bearer_failure("Bearer nope") == INVALID
    for header in (None, "", "Bearer", "Bearer   ", "Basic abc", "nope"):
        assert bearer_failure(header) == MISSING, header


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError):
        AuthThrottle("x", max_failures=0)
