from __future__ import annotations

import math

import pytest

from dashboard.derive import (
    Histogram,
    capacity_plan,
    find_histogram,
    histogram_increase,
    histogram_quantile,
    pd_ratio,
    ratio,
    waterfall,
)
from pdscope.stats import counter_increase


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([1.0, 3.0, 6.0], 5.0),
        ([10.0, 12.0, 2.0, 5.0], 2.0 + 2.0 + 3.0),  # restart: 2 counts from zero
        ([None, 4.0, None, 9.0], 5.0),
        ([7.0], None),
        ([], None),
    ],
)
def test_counter_increase(values: list[float | None], expected: float | None) -> None:
    assert counter_increase(values) == expected


def test_histogram_quantile_interpolates_and_caps_at_highest_bound() -> None:
    h = Histogram(le=(0.1, 0.5, 1.0), counts=(10.0, 60.0, 90.0, 100.0), sum=40.0, count=100.0)
    assert histogram_quantile(0.05, h) == pytest.approx(0.05)
    assert histogram_quantile(0.5, h) == pytest.approx(0.1 + 0.4 * (50 - 10) / 50)
    assert histogram_quantile(0.99, h) == 1.0  # lands in +Inf
    assert histogram_quantile(0.5, Histogram((0.1,), (0.0, 0.0), 0.0, 0.0)) is None
    assert histogram_quantile(0.5, None) is None


def test_histogram_increase_subtracts_and_handles_reset() -> None:
    first = Histogram((1.0,), (3.0, 5.0), 4.0, 5.0)
    last = Histogram((1.0,), (7.0, 12.0), 10.0, 12.0)
    inc = histogram_increase(first, last)
    assert inc == Histogram((1.0,), (4.0, 7.0), 6.0, 7.0)
    restarted = Histogram((1.0,), (1.0, 2.0), 1.0, 2.0)
    assert histogram_increase(last, restarted) == restarted


def test_find_histogram_accepts_vllm_names_and_aliases() -> None:
    snap = {
        "vllm:nixl_xfer_time_seconds": {"le": [0.1], "counts": [1, 2], "sum": 0.3, "count": 2},
        "ttft": {"le": [1.0], "counts": [4, 4], "sum": 1.0, "count": 4},
    }
    assert find_histogram(snap, "nixl_xfer_time") == Histogram((0.1,), (1.0, 2.0), 0.3, 2.0)
    assert find_histogram(snap, "ttft") is not None
    assert find_histogram(snap, "itl") is None
    assert find_histogram({"ttft": {"le": [1.0], "counts": [1]}}, "ttft") is None  # malformed


def test_ratio() -> None:
    assert ratio(1.0, 4.0) == 0.25
    assert ratio(1.0, 0.0) is None
    assert ratio(None, 1.0) is None
    assert ratio(float("nan"), 1.0) is None


def test_waterfall_orders_and_splits_stages() -> None:
    rec = {
        "proxy_in": 100.0,
        "p_sent": 100.002,
        "p_done": 100.200,
        "d_sent": 100.201,
        "first_token": 100.300,
        "done": 101.300,
        "p_queue_s": 0.05,
    }
    stages = {s.name: s for s in waterfall(rec)}
    assert list(stages) == [
        "proxy",
        "P queue",
        "P prefill",
        "handoff (D queue incl. KV pull)",
        "first token",
        "decode",
    ]
    assert stages["proxy"].duration_ms == pytest.approx(2.0)
    assert stages["P queue"].duration_ms == pytest.approx(50.0)
    assert stages["P prefill"].end_ms == pytest.approx(200.0)
    assert stages["handoff (D queue incl. KV pull)"].duration_ms == pytest.approx(100.0)
    assert stages["first token"].duration_ms == 0.0
    assert stages["decode"].duration_ms == pytest.approx(1000.0)


def test_waterfall_of_a_rejected_request_and_without_queue_split() -> None:
    assert waterfall({"proxy_in": 5.0, "done": 5.001}) == []
    assert waterfall({}) == []
    stages = waterfall(
        {"proxy_in": 0.0, "p_sent": 0.001, "p_done": 0.1, "p_queue_s": 5.0}
    )  # queue > span: no split
    assert [s.name for s in stages] == ["proxy", "P prefill"]


def test_pd_ratio_matches_the_architecture_formula() -> None:
    # n_P/n_D ≈ (C_D/C_P)·(E[prompt]/E[output])
    assert pd_ratio(c_prefill=20_000, c_decode=2_000, mean_prompt=1000, mean_output=200) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        pd_ratio(0, 1, 1, 1)


def test_capacity_plan_scales_with_load() -> None:
    plan = capacity_plan(
        rate_per_s=10, mean_prompt=1000, mean_output=200, c_prefill=20_000, c_decode=2_000, utilization=0.5
    )
    assert (plan.n_prefill, plan.n_decode) == (1, 2)
    assert plan.pd_ratio == pytest.approx(0.5)
    double = capacity_plan(20, 1000, 200, 20_000, 2_000, 0.5)
    assert (double.n_prefill, double.n_decode) == (2, 4)
    idle = capacity_plan(0, 1000, 200, 20_000, 2_000)
    assert (idle.n_prefill, idle.n_decode) == (0, 0)
    with pytest.raises(ValueError):
        capacity_plan(1, 1, 1, 1, 1, utilization=0)
    assert not math.isnan(plan.pd_ratio)
