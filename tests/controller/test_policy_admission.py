"""Pool admission limits (AIMD on pressure from KV headroom, handoff backlog, TTFT) as tables."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from controller.policy import LimitState, PolicyConfig, PoolSignals
from controller.policy.admission import decide_pool

CFG = PolicyConfig.defaults(
    ttft_target_s=2.0,
    handoff_budget_s=1.0,
    default_max_inflight_requests=100,
    default_max_inflight_kv_bytes=1000,
)
CALM = PoolSignals(
    "decode",
    "decode",
    inflight_requests=40.0,
    completed_per_s=20.0,
    ttft_at_slo_s=0.8,
    kv_usage=0.5,
    handoff_backlog_requests=2.0,
)
CALM_P = PoolSignals(
    "prefill",
    "prefill",
    inflight_requests=40.0,
    completed_per_s=20.0,
    ttft_at_slo_s=0.8,
    kv_usage=0.5,
    waiting_now=0.0,
    running_now=8.0,
)


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


Q = replace(
    CALM_P, service_ttft_at_slo_s=1.5
)  # the fleet takes 1.5 s of the 2 s TTFT target: 0.5 s left to queue
CASES = [
    Case("calm keeps the defaults", [CALM] * 3, None, [100, 100, 100], [1000, 1000, 1000]),
    # b = min(limit, in flight) = 40: floor(40 x 0.5 + 2 sqrt(40)) = 32, then a 3-tick cooldown
    Case(
        (
            "TTFT 2x over target cuts at once to in-flight x pressure + 2 sqrt headroom, "
            "then waits for it to show"
        ),
        [replace(CALM_P, ttft_at_slo_s=4.0)] * 6,
        None,
        [32, 32, 32, 27, 27, 27],
    ),
    Case(
        "TTFT 1.5x over cuts by 2/3 on the second tick in a row",
        [replace(CALM_P, ttft_at_slo_s=3.0)] * 2,
        None,
        [100, 39],
    ),
    Case(
        "mild pressure that does not last cuts nothing",
        [replace(CALM_P, ttft_at_slo_s=2.6), CALM_P, replace(CALM_P, ttft_at_slo_s=2.6)],
        None,
        [100, 100, 100],
    ),
    Case(
        "mild pressure (TTFT 1.1x) holds, neither cuts nor grows",
        [replace(CALM_P, ttft_at_slo_s=2.2)] * 2,
        LimitState(50, 1000),
        [50, 50],
    ),
    Case(
        "a D pool is not cut for TTFT (the P pool is where requests enter)",
        [replace(CALM, ttft_at_slo_s=4.0)] * 2,
        None,
        [100, 100],
    ),
    Case("a cut never takes more than half", [replace(CALM_P, ttft_at_slo_s=40.0)], None, [32]),
    Case(
        "KV usage 92% cuts the request and KV-bytes limits", [replace(CALM, kv_usage=0.92)], None, [32], [200]
    ),
    Case("KV usage at 95%+ floors the KV-bytes budget", [replace(CALM, kv_usage=0.99)], None, [32], [50]),
    Case(
        "handoff backlog worth 2x the budget halves",
        [replace(CALM, handoff_backlog_requests=40.0)],
        None,
        [32],
    ),
    Case(
        "calm again: after 3 calm ticks, additive increase back to the default",
        [CALM] * 6,
        LimitState(20, 1000),
        [20, 20, 22, 25, 28, 31],
    ),
    Case(
        "pressure in between restarts the calm count",
        [CALM, CALM, replace(CALM, kv_usage=0.82), CALM, CALM, CALM],
        LimitState(20, 1000),
        [20, 20, 20, 20, 20, 22],
    ),
    Case(
        "the limit never goes below the minimum",
        [replace(CALM_P, ttft_at_slo_s=40.0, inflight_requests=0.5)],
        LimitState(4, 1000),
        [4],
    ),
    Case(
        "unknown in-flight cuts from the current limit",
        [replace(CALM_P, ttft_at_slo_s=4.0, inflight_requests=None, running_now=None, waiting_now=None)],
        LimitState(60, 1000),
        [45],
    ),
    # 20 waiting at 20/s = 1 s of queue against the 0.5 s left (pressure 0.5): 10 of them fit the budget,
    # so the limit is what is in flight (40) minus the other 10 -- on the second tick in a row: one scrape's
    # queue is a sample of a bursty process (queue_confirm_ticks)
    Case(
        "P's queue worth twice the TTFT budget left cuts the excess before TTFT moves",
        [replace(Q, waiting_now=20.0)] * 2,
        None,
        [100, 30],
    ),
    Case(
        "one scrape's long P queue cuts nothing",
        [replace(Q, waiting_now=20.0), Q, replace(Q, waiting_now=20.0)],
        None,
        [100, 100, 100],
    ),
    Case(
        "a short P queue (within the budget left) holds nothing",
        [replace(Q, waiting_now=5.0)] * 2,
        None,
        [100, 100],
    ),
    # Little's law says 10, P holds 30 running + 30 waiting now: 60 - (30 - 10 that fit the budget) = 40
    Case(
        "in flight is what P holds now when Little's law lags a queue",
        [replace(Q, inflight_requests=10.0, running_now=30.0, waiting_now=30.0)] * 2,
        None,
        [100, 40],
    ),
    # The service TTFT of 1.5 s holds the window's own queue: with 0.9 s of it P's queue, a request that
    # found the queue empty takes 0.6 s, so 1.4 s of the target is left for the queue of now. 20 waiting at
    # 20/s (1 s) fits it: counting the window's queue again would have cut to 30 (the healthy-at-90% cut).
    Case(
        "the queue of now is weighed against what a request takes besides P's queue, not counted twice",
        [replace(Q, waiting_now=20.0, unqueued_ttft_at_slo_s=0.6)] * 3,
        None,
        [100, 100, 100],
    ),
    # 40 waiting, 28 of them fit 1.4 s at 20/s: in flight (8 running + 40 waiting) minus the other 12
    Case(
        "a queue longer than that budget still cuts the excess",
        [replace(Q, waiting_now=40.0, unqueued_ttft_at_slo_s=0.6)] * 2,
        None,
        [100, 36],
    ),
    Case(
        "a queue cut needs no cooldown: the gauges show it at the next scrape",
        [replace(Q, waiting_now=20.0)] * 2 + [replace(Q, waiting_now=20.0, inflight_requests=30.0)],
        None,
        [100, 30, 20],
    ),
]


@pytest.mark.parametrize(
    ("service_s", "prev", "wait"),
    [
        (1.5, None, 0.5),  # 2.0 target - 1.5 the fleet takes
        (1.72, None, 0.25),  # rounded down to 0.05 s steps
        (2.5, None, 0.0),  # the fleet alone breaks the target: no waiting at all
        (0.5, 0.3, None),  # 1.5 s left is more than the proxy's 1 s timeout: the proxy's own
        (None, 0.3, 0.3),  # too few requests to measure: held
        (None, None, None),
    ],
)
def test_wait_budget_is_the_ttft_left(
    service_s: float | None, prev: float | None, wait: float | None
) -> None:
    cfg = replace(CFG, default_queue_wait_s=1.0)
    d = decide_pool(
        replace(CALM_P, service_ttft_at_slo_s=service_s), LimitState(100, 1000, 0, prev), cfg, stale=False
    )
    assert d.new.max_queue_wait_s == wait
    assert "wait =" in d.arithmetic
    if wait is not None and wait != prev:
        assert d.changed("max_queue_wait_s") and f"may wait {wait:.2f}s" in d.message


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_admission(case: Case) -> None:
    got = run(case.ticks, case.prev)
    assert [g.max_inflight_requests for g in got] == case.requests
    if case.kv_bytes is not None:
        assert [g.max_inflight_kv_bytes for g in got] == case.kv_bytes


def test_decision_explains_itself() -> None:
    d = decide_pool(replace(CALM_P, ttft_at_slo_s=4.0), LimitState(100, 1000), CFG, stale=False)
    assert d.reason == "TTFTOverBudget"
    assert d.scores["ttft"] == 0.5 and d.scores["pressure"] == 0.5
    assert "floor(b × max(0.5, 0.50) + 2 sqrt(b))) = 32 with b = min(limit 100, in flight 40)" in d.arithmetic
    assert d.inputs["ttft_at_slo_s"] == 4.0
    assert d.changed("max_inflight_requests") and not d.changed("max_inflight_kv_bytes")


def test_stale_data_holds_limits() -> None:
    prev = LimitState(37, 500)
    d = decide_pool(replace(CALM, ttft_at_slo_s=9.0), prev, CFG, stale=True)
    assert d.new == prev and d.reason == "StaleData"


def test_worst_pressure_names_the_reason() -> None:
    d = decide_pool(replace(CALM_P, kv_usage=0.93, ttft_at_slo_s=2.2), None, CFG, stale=False)
    assert d.reason == "KVHeadroomLow"
