"""Outlier detection (``proxy/outlier.py``) and failures weighed in the power-of-two choice
(issue 14, "no black holes"). Pure: injected clock, no sockets."""

from __future__ import annotations

import heapq
import random
from collections import Counter

import pytest

from pdscope.config import ConfigError, OutlierSettings, parse_config
from proxy.outlier import OutlierDetector
from proxy.routing import Target
from proxy.selection import Selector

POOL = {"decode": ["d0", "d1", "d2", "d3"]}


def _detector(**kw: float) -> OutlierDetector:
    return OutlierDetector(OutlierSettings(**kw), POOL)  # type: ignore[arg-type]


def test_consecutive_failures_eject_for_a_period_that_doubles_and_is_capped() -> None:
    out = _detector(consecutive_failures=3, base_ejection_s=5, max_ejection_s=15)
    now = 0.0
    periods = []
    for round_ in range(4):
        reasons = [out.failure("d0", "decode", now) for _ in range(3 if round_ == 0 else 1)]
        assert reasons[-1] is not None
        assert out.is_ejected("d0", now)
        (ej,) = out.ejected(now)
        periods.append(ej.remaining_s)
        now += ej.remaining_s
        assert not out.is_ejected("d0", now)  # back after its period
    # first by 3 in a row; then on probation (the first failure after the return re-ejects at once)
    assert periods == [5.0, 10.0, 15.0, 15.0]
    assert out.ejections == Counter({("d0", "consecutive_failures"): 1, ("d0", "probation"): 3})


def test_a_returned_instance_is_reejected_at_once_then_cleared_by_successes() -> None:
    out = _detector(consecutive_failures=3, base_ejection_s=5)
    for _ in range(3):
        out.failure("d0", "decode", 0.0)
    assert out.is_ejected("d0", 4.9) and not out.is_ejected("d0", 5.0)
    assert out.failure("d0", "decode", 5.1) == "probation"  # re-ejected at once
    assert out.is_ejected("d0", 5.2)
    for _ in range(3):  # back at 15.1, then three good answers end the probation
        out.success("d0", "decode", 16.0)
    assert out.failure("d0", "decode", 16.1) is None
    assert not out.is_ejected("d0", 16.2)


def test_the_ejection_period_starts_again_after_a_long_stay() -> None:
    out = _detector(consecutive_failures=1, base_ejection_s=5, max_ejection_s=60)
    out.failure("d0", "decode", 0.0)
    assert out.failure("d0", "decode", 5.0) == "probation"
    assert out.ejected(5.0)[0].remaining_s == 10.0
    out.is_ejected("d0", 15.0)  # returns at 15
    for _ in range(5):
        out.success("d0", "decode", 20.0)
    out.failure("d0", "decode", 80.0)  # a full max_ejection_s in: not a successive ejection
    assert out.ejected(80.0)[0].remaining_s == 5.0


def test_a_windowed_failure_ratio_ejects_once_there_are_enough_requests() -> None:
    out = _detector(consecutive_failures=100, failure_ratio=0.25, min_requests=20, window_s=10)
    now = 0.0
    for i in range(19):  # 1 in 3 fails: below min_requests nothing happens
        now += 0.1
        (out.failure if i % 3 == 0 else out.success)("d0", "decode", now)
    assert not out.any_ejected
    assert out.failure("d0", "decode", now) == "failure_ratio"  # 8 of 20
    assert out.ejections[("d0", "failure_ratio")] == 1


def test_old_failures_leave_the_window() -> None:
    out = _detector(consecutive_failures=100, failure_ratio=0.5, min_requests=4, window_s=10)
    for _ in range(3):
        out.failure("d0", "decode", 0.0)
    assert out.recent("d0", 5.0) == (3, 3)
    assert out.recent("d0", 20.0) == (0, 0)
    for _ in range(3):
        out.success("d0", "decode", 20.0)
    assert out.failure("d0", "decode", 20.0) is None  # 1 of 4: the old three are gone
    assert out.penalties(30.0) == {}  # and so is its selection penalty, once the window passes


def test_at_most_the_configured_share_of_a_pool_is_ejected_and_never_the_last() -> None:
    out = _detector(consecutive_failures=1, max_ejected_share=0.5)
    assert [out.failure(d, "decode", 0.0) is not None for d in ("d0", "d1", "d2")] == [True, True, False]
    assert [e.instance for e in out.ejected(0.0)] == ["d0", "d1"]
    single = OutlierDetector(OutlierSettings(consecutive_failures=1, max_ejected_share=1.0), {"p": ["p0"]})
    assert single.failure("p0", "p", 0.0) is None and not single.is_ejected("p0", 0.0)
    never = _detector(consecutive_failures=1, max_ejected_share=0.0)
    assert never.failure("d0", "decode", 0.0) is None
    small = _detector(consecutive_failures=1, max_ejected_share=0.1)  # 10% of 4: still one
    assert [small.failure(d, "decode", 0.0) is not None for d in ("d0", "d1")] == [True, False]


def test_a_late_failure_while_ejected_does_not_extend_the_ejection() -> None:
    out = _detector(consecutive_failures=1, base_ejection_s=5)
    out.failure("d0", "decode", 0.0)
    assert out.failure("d0", "decode", 1.0) is None
    assert out.ejected(1.0)[0].remaining_s == 4.0


def test_outlier_config_is_validated_and_the_old_cooldown_key_names_its_replacement() -> None:
    base = (
        "model: {name: m, kv_bytes_per_token: 1}\npools:\n  p: {role: prefill, instances: [{name: p0, url: 'http://p'}]}\n"
        "  d: {role: decode, instances: [{name: d0, url: 'http://d'}]}\n"
    )
    s = parse_config(base + "proxy: {outlier: {consecutive_failures: 2, failure_ratio: 0.3}}\n", "<t>")
    assert s.proxy.outlier.consecutive_failures == 2 and s.proxy.outlier.base_ejection_s == 5.0
    for bad, field in (
        ("{outlier: {failure_ratio: 0}}", "failure_ratio"),
        ("{outlier: {base_ejection_s: 10, max_ejection_s: 5}}", "max_ejection_s"),
        ("{outlier: {max_ejected_share: 2}}", "max_ejected_share"),
        ("{failure_cooldown_s: 5}", "proxy.outlier"),
    ):
        with pytest.raises(ConfigError) as err:
            parse_config(base + f"proxy: {bad}\n", "<t>")
        assert field in str(err.value)


# -- failures weighed in the power-of-two choice --------------------------------------------

TARGETS = [Target(f"d{i}", "decode", "http://d", 1.0) for i in range(4)]


def _selection_loop(
    settings: OutlierSettings, steps: int = 20_000, seed: int = 7
) -> tuple[Counter[str], OutlierDetector]:
    """One request every 10 ms over four equal Ds (mean service 100 ms); d0 fails 30% of its
    requests in 2 ms. Picks, in-flight counts and results go through the real Selector."""
    out = OutlierDetector(settings, {"decode": [t.name for t in TARGETS]})
    sel = Selector("weighted", out, random.Random(seed))
    rng = random.Random(seed + 1)
    ends: list[tuple[float, str, bool]] = []
    picks: Counter[str] = Counter()
    for step in range(steps):
        now = step * 0.01
        while ends and ends[0][0] <= now:
            _, name, failed = heapq.heappop(ends)
            sel.release(name)
            if failed:
                out.failure(name, "decode", now)
            else:
                out.success(name, "decode", now)
        t = sel.pick("decode", TARGETS, now)
        assert t is not None
        picks[t.name] += 1
        sel.acquire(t.name)
        failed = t.name == "d0" and rng.random() < 0.3
        heapq.heappush(ends, (now + (0.002 if failed else rng.expovariate(10.0)), t.name, failed))
    return picks, out


def test_failing_fast_does_not_win_traffic_in_the_power_of_two_choice() -> None:
    # Today's comparison (failures ignored, the old behaviour): d0 ends its failures fast, holds
    # fewer requests in flight, and wins more than its share.
    picks, _ = _selection_loop(OutlierSettings(max_ejected_share=0.0, failure_penalty=0.0))
    healthy = [picks[f"d{i}"] for i in (1, 2, 3)]
    assert picks["d0"] > max(healthy)
    # Weighed by its recent failure ratio (no ejection): less than each healthy peer.
    picks, out = _selection_loop(OutlierSettings(max_ejected_share=0.0))
    healthy = [picks[f"d{i}"] for i in (1, 2, 3)]
    assert picks["d0"] < 0.8 * min(healthy), picks
    assert not out.ejections


def test_a_d_failing_30_percent_is_ejected_by_outlier_detection() -> None:
    picks, out = _selection_loop(OutlierSettings())
    assert out.ejections[("d0", "failure_ratio")] >= 1
    assert sum(n for (name, _), n in out.ejections.items() if name != "d0") == 0  # the healthy ones stay
    assert picks["d0"] < 0.05 * sum(picks.values())
