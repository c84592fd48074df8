"""The load generator's pure parts: length distributions, arrivals, traces, the summary."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pdscope.stats import percentile
from simulator.workload import (
    LengthDist,
    RequestResult,
    arrival_times,
    load_trace,
    plan,
    summarize,
)


def test_length_distributions() -> None:
    rng = random.Random(0)
    assert LengthDist.parse("fixed:64").sample(rng) == 64
    uni = [LengthDist.parse("uniform:10,20").sample(rng) for _ in range(500)]
    assert min(uni) == 10 and max(uni) == 20
    logn = sorted(LengthDist.parse("lognormal:200,0.5").sample(rng) for _ in range(2001))
    assert 170 < logn[1000] < 230 and logn[0] >= 1
    for bad in ("fixed:0", "uniform:5,1", "lognormal:100", "zipf:3", "fixed:x"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_arrivals_are_bounded_seeded_and_at_the_rate() -> None:
    times = arrival_times("poisson", 50.0, 10_000, 20.0, random.Random(1))
    assert times == sorted(times) and times[-1] < 20.0
    assert 900 < len(times) < 1100  # ~50/s for 20 s
    assert len(arrival_times("poisson", 50.0, 30, 20.0, random.Random(1))) == 30
    assert arrival_times("constant", 4.0, 5, 10.0, random.Random(0)) == [0.0, 0.25, 0.5, 0.75, 1.0]
    bursty = arrival_times("bursty", 20.0, 100, 100.0, random.Random(2), burst=10)
    assert len(bursty) == 100 and len(set(bursty)) == 10
    assert plan(
        "poisson", 5, 20, 60, LengthDist.parse("fixed:3"), LengthDist.parse("fixed:4"), seed=7
    ) == plan("poisson", 5, 20, 60, LengthDist.parse("fixed:3"), LengthDist.parse("fixed:4"), seed=7)


def test_trace_replay(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [
        {"prompt_tokens": 10, "output_tokens": 5, "at": 0.5},
        {"prompt_tokens": 20, "output_tokens": 2, "at": 1.0},
        {"prompt_tokens": 30, "output_tokens": 1, "at": 9.0},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = load_trace(path, None, 100, 5.0, 0)
    assert [(p.at, p.prompt_tokens, p.output_tokens) for p in got] == [(0.5, 10, 5), (1.0, 20, 2)]
    path.write_text('{"prompt_tokens": 1}\n')
    with pytest.raises(ValueError, match=r"t\.jsonl:1"):
        load_trace(path, 1.0, 10, 10.0, 0)


def res(i: int, ttft: float | None, e2e: float | None, tokens: int, ok: bool = True) -> RequestResult:
    return RequestResult(
        i, f"r{i}", 0.0, 0.0, 10, tokens, ok=ok, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens
    )


def test_summary_goodput_attainment_and_percentiles() -> None:
    results = [
        res(0, 0.1, 1.1, 11),  # tpot 0.1  -> meets (<= 0.1)
        res(1, 0.1, 2.1, 11),  # tpot 0.2  -> misses TPOT
        res(2, 3.0, 3.5, 6),  # misses TTFT
        res(3, 0.5, 0.5, 1),  # one token: no TPOT, meets
        res(4, None, None, 0, ok=False),
    ]
    results[4].error = "timeout"
    s = summarize(results, wall_s=2.0, slo_ttft_s=2.0, slo_tpot_s=0.1)
    assert s["completed"] == 4 and s["failed"] == 1 and s["errors"] == {"timeout": 1}
    assert s["goodput_rps"] == pytest.approx(1.0) and s["slo_attainment"] == pytest.approx(0.5)
    assert s["ttft_s"]["p50"] == pytest.approx(0.3) and s["ttft_s"]["p99"] == pytest.approx(0.5 + 0.97 * 2.5)
    assert s["tpot_s"]["p50"] == pytest.approx(0.1)
    assert percentile([], 50) is None and percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
