"""The fleet bench's pure parts: the burst rate, the overshoot, the figures and targets, the table
(on made-up measurements; the runs themselves are the bench, not a test)."""

from __future__ import annotations

import json

import pytest

from bench.fleet.report import (
    FULL,
    QUICK,
    RunResult,
    burst_rate,
    median,
    overshoot,
    percentiles,
    summary,
    table,
)


def run(name: str, proxies: int, peak_d: float, good: int, **kw: object) -> RunResult:
    fields: dict[str, object] = {
        "contender": name,
        "proxies": proxies,
        "rate": 80.0,
        "sent": 200,
        "ok": 150,
        "rejected": 50,
        "failed": 0,
        "good": good,
        "wall_s": 12.0,
        "burst_s": 10.0,
        "peak_inflight": {"prefill": 5.0, "decode": peak_d},
        "samples": 100,
    }
    fields.update(kw)
    return RunResult(**fields)  # type: ignore[arg-type]


def test_the_burst_rate_keeps_factor_times_the_limit_in_flight() -> None:
    assert burst_rate(48, 0.5, 1.5) == pytest.approx(144.0)
    assert burst_rate(16, 0.8, 1.0) * 0.8 == pytest.approx(16)
    for bad in ((0, 1.0, 1.5), (16, 0.0, 1.5), (16, 1.0, -1.0)):
        with pytest.raises(ValueError, match="positive"):
            burst_rate(*bad)


def test_overshoot_is_the_share_over_the_limit_and_never_negative() -> None:
    assert overshoot(48, 16) == pytest.approx(2.0)
    assert overshoot(17.6, 16) == pytest.approx(0.1)
    assert overshoot(10, 16) == 0.0


def test_percentiles_are_the_kernels_interpolated_ones() -> None:
    xs = [float(i) for i in range(1, 101)]
    assert percentiles(xs) == pytest.approx({"p50": 50.5, "p90": 90.1, "p99": 99.01})
    assert percentiles([7.0]) == {"p50": 7.0, "p90": 7.0, "p99": 7.0} and percentiles([]) == {}


def test_median() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([4.0, 1.0, 2.0, 3.0]) == 2.5
    with pytest.raises(ValueError):
        median([])


def test_the_plans_are_the_issues_fleet_and_a_small_one() -> None:
    assert (FULL.prefill, FULL.decode, FULL.factor) == (8, 16, 1.5)
    assert QUICK.prefill * QUICK.decode < FULL.prefill * FULL.decode and QUICK.burst_s < FULL.burst_s
    assert FULL.name == "8P+16D"


def test_the_figures_compare_the_fleet_with_its_baselines() -> None:
    runs = {
        "apportioned": run(
            "apportioned", 3, 50.0, 95, takeover_s=0.7, records_expected=150, records_stored=149
        ),
        "naive": run("naive", 3, 144.0, 120),
        "one_proxy": run("one_proxy", 1, 48.0, 100),
    }
    doc = summary(FULL, runs, 0.5)
    figures = doc["figures"]
    assert isinstance(figures, dict)
    assert figures["apportioned_worst_overshoot"] == pytest.approx(50 / 48 - 1)
    assert figures["naive_worst_overshoot"] == pytest.approx(2.0)
    assert figures["goodput_ratio_3_vs_1"] == pytest.approx(0.95)
    assert figures["takeover_s"] == 0.7 and figures["records_lost"] == 1
    assert figures["targets"] == {
        "overshoot_within_10pct": True,
        "goodput_within_10pct": True,
        "no_records_lost": False,
    }
    json.dumps(doc)  # what the bench writes
    text = table(FULL, runs)
    assert "8P+16D" in text and "limit 48" in text
    naive_line = next(line for line in text.splitlines() if line.startswith("naive"))
    assert "200%" in naive_line and naive_line.split()[-1] == "-"


def test_a_fleet_over_its_limit_misses_the_target() -> None:
    runs = {"apportioned": run("apportioned", 3, 60.0, 95), "one_proxy": run("one_proxy", 1, 48.0, 50)}
    targets = summary(FULL, runs, 0.5)["figures"]["targets"]  # type: ignore[index]
    assert targets["overshoot_within_10pct"] is False and targets["goodput_within_10pct"] is False
    assert targets["no_records_lost"] is None  # not measured
