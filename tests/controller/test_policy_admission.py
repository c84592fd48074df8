"""Pool admission limits (AIMD on pressure from KV headroom, handoff backlog, TTFT) as tables."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from controller.policy import LimitState, PolicyConfig, PoolSignals
from controller.policy.admission import decide_pool

CFG = PolicyConfig(ttft_target_s=2.0, handoff_budget_s=1.0, default_max_inflight_requests=100,
                   default_max_inflight_kv_bytes=1000)
CALM = PoolSignals("decode", "decode", inflight_requests=40.0, completed_per_s=20.0, ttft_p_s=0.8, kv_usage=0.5,
                   handoff_backlog_requests=2.0)


def run(pools: list[PoolSignals], prev: LimitState | None = None) -> list[LimitState]:
    out = []
    for p in pools:
        d = decide_pool(p, prev, CFG, stale=False)
        prev = d.new
        out.append(d.new)
    return out


@dataclass(frozen=True)
class Case:
    name: str
    ticks: list[PoolSignals]
    prev: LimitState | None
    requests: list[int]
    kv_bytes: list[int] | None = None


CASES = [
    Case("calm keeps the defaults", [CALM] * 3, None, [100, 100, 100], [1000, 1000, 1000]),
    # b = min(limit, in flight) = 40: floor(40 x 0.5 + sqrt(40)) = 26, then a 3-tick cooldown
    Case("TTFT 2x over target cuts to in-flight x pressure + sqrt headroom, then waits for it to show",
         [replace(CALM, ttft_p_s=4.0)] * 6, None, [26, 26, 26, 18, 18, 18]),
    Case("TTFT 1.5x over cuts by 2/3", [replace(CALM, ttft_p_s=3.0)], None, [32]),
    Case("mild pressure (TTFT 1.1x) holds, neither cuts nor grows", [replace(CALM, ttft_p_s=2.2)] * 2,
         LimitState(50, 1000), [50, 50]),
    Case("a cut never takes more than half", [replace(CALM, ttft_p_s=40.0)], None, [26]),
    Case("KV usage 92% cuts the request and KV-bytes limits", [replace(CALM, kv_usage=0.92)], None, [26], [200]),
    Case("KV usage at 95%+ floors the KV-bytes budget", [replace(CALM, kv_usage=0.99)], None, [26], [50]),
    Case("handoff backlog worth 2x the budget halves", [replace(CALM, handoff_backlog_requests=40.0)], None, [26]),
    Case("calm again: additive increase back to the default",
         [CALM] * 4, LimitState(20, 1000), [22, 25, 28, 31]),
    Case("the limit never goes below the minimum", [replace(CALM, ttft_p_s=40.0, inflight_requests=0.5)],
         LimitState(4, 1000), [4]),
    Case("unknown in-flight cuts from the current limit", [replace(CALM, ttft_p_s=4.0, inflight_requests=None)],
         LimitState(60, 1000), [37]),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_admission(case: Case) -> None:
    got = run(case.ticks, case.prev)
    assert [g.max_inflight_requests for g in got] == case.requests
    if case.kv_bytes is not None:
        assert [g.max_inflight_kv_bytes for g in got] == case.kv_bytes


def test_decision_explains_itself() -> None:
    d = decide_pool(replace(CALM, ttft_p_s=4.0), LimitState(100, 1000), CFG, stale=False)
    assert d.reason == "TTFTOverBudget"
    assert d.scores["ttft"] == 0.5 and d.scores["pressure"] == 0.5
    assert "floor(b × max(0.5, 0.50) + sqrt(b))) = 26 with b = min(limit 100, in flight 40)" in d.arithmetic
    assert d.inputs["ttft_p_s"] == 4.0
    assert d.changed("max_inflight_requests") and not d.changed("max_inflight_kv_bytes")


def test_stale_data_holds_limits() -> None:
    prev = LimitState(37, 500)
    d = decide_pool(replace(CALM, ttft_p_s=9.0), prev, CFG, stale=True)
    assert d.new == prev and d.reason == "StaleData"


def test_worst_pressure_names_the_reason() -> None:
    d = decide_pool(replace(CALM, kv_usage=0.93, ttft_p_s=2.2), None, CFG, stale=False)
    assert d.reason == "KVHeadroomLow"
