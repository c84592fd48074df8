"""Pool admission limits (AIMD on pressure from KV headroom, handoff backlog, TTFT) as tables."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import pytest

from controller.policy import LimitState, PolicyConfig, PoolSignals
from controller.policy.admission import decide_pool, measured_wait

# the controller's own latency cuts: proxies that do not admit by prediction (PREDICTING: those that do)
CFG = PolicyConfig.defaults(
    ttft_target_s=2.0,
    handoff_budget_s=1.0,
    default_max_inflight_requests=100,
    default_max_inflight_kv_bytes=1000,
    proxies_predict=False,
)
PREDICTING = replace(CFG, proxies_predict=True)
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
        "calm again: one additive step (+30 %) per 3 calm ticks back to the default, a decision each",
        [CALM] * 9,
        LimitState(20, 1000),
        [20, 20, 26, 26, 26, 34, 34, 34, 45],
    ),
    Case(
        "calm, and the cut limit holds over twice what is in flight (+ 2 sqrt): home in one decision",
        [replace(CALM, inflight_requests=10.0)] * 4,
        LimitState(30, 1000),
        [30, 30, 100, 100],
    ),
    Case(
        "pressure in between restarts the calm count",
        [CALM, CALM, replace(CALM, kv_usage=0.82), CALM, CALM, CALM],
        LimitState(20, 1000),
        [20, 20, 20, 20, 20, 26],
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
    ("service_s", "wait"),
    [
        (1.5, 0.5),  # 2.0 target - 1.5 the fleet takes
        (1.72, 0.25),  # rounded down to 0.05 s steps
        (2.5, 0.0),  # the fleet alone breaks the target: no waiting at all
        (None, None),  # too few requests to measure
    ],
)
def test_measured_wait_is_the_ttft_left(service_s: float | None, wait: float | None) -> None:
    assert measured_wait(replace(CALM_P, service_ttft_at_slo_s=service_s), CFG)[0] == wait


# 1 s ticks over a 4 s window: a measured wait must sit past the band (0.15 x 2 s = 0.3 s) for 5 ticks
WCFG = replace(CFG, interval_s=1.0, window_s=4.0, default_queue_wait_s=1.0)


def _waits(service: Sequence[float | None], prev: float | None, ttft_s: float = 0.8) -> list[float | None]:
    state = LimitState(100, 1000, 0, prev)
    out = []
    for s in service:
        d = decide_pool(
            replace(CALM_P, service_ttft_at_slo_s=s, ttft_at_slo_s=ttft_s), state, WCFG, stale=False
        )
        state = d.new
        out.append(d.new.max_queue_wait_s)
    return out


@dataclass(frozen=True)
class WaitCase:
    name: str
    service: Sequence[float | None]  # the fleet's TTFT without the admission wait, per tick (wait = 2 s - it)
    prev: float | None
    waits: list[float | None]
    ttft_s: float = 0.8


WAIT_CASES = [
    WaitCase(
        "a dip no longer than a window (one slow request in it) moves nothing",
        [1.0] + [2.5] * 4 + [1.0] * 3,
        None,
        [None] * 8,
    ),
    WaitCase(
        "a fall that outlasts a window is published, at the least cut every tick agreed on",
        [1.58, 1.68, 1.58, 1.63, 1.68, 1.68],
        None,
        [None, None, None, None, 0.4, 0.4],
    ),
    WaitCase("a move inside the band moves nothing", [1.3] * 8, 0.5, [0.5] * 8),
    WaitCase(
        "a rise is published after a window too, at the lowest of the run",
        [1.2, 1.15, 1.2, 1.25, 1.2],
        0.2,
        [0.2, 0.2, 0.2, 0.2, 0.75],
    ),
    WaitCase(
        "a rise to the proxy's timeout or past it is the proxy's default", [0.5] * 5, 0.3, [0.3] * 4 + [None]
    ),
    WaitCase(
        "a run broken by one tick inside the band starts again",
        [1.6] * 4 + [1.0] + [1.6] * 4,
        None,
        [None] * 9,
    ),
    WaitCase("too few requests to measure: held", [None, None], 0.3, [0.3, 0.3]),
    WaitCase(
        "a tick that cuts the request limit (TTFT 2x the target) lowers the wait at once, by any step",
        [1.78, 1.78],
        0.3,
        [0.2, 0.2],
        ttft_s=4.0,
    ),
]


@pytest.mark.parametrize("case", WAIT_CASES, ids=[c.name for c in WAIT_CASES])
def test_wait_budget_moves_only_past_its_dead_band(case: WaitCase) -> None:
    assert WCFG.wait_confirm_ticks == 5
    assert _waits(case.service, case.prev, case.ttft_s) == case.waits


def test_a_published_wait_says_so() -> None:
    state = LimitState(100, 1000, 0, None)
    for _ in range(5):
        d = decide_pool(replace(CALM_P, service_ttft_at_slo_s=1.58), state, WCFG, stale=False)
        state = d.new
    assert d.changed("max_queue_wait_s") and "may wait 0.40s" in d.message
    assert "wait = 0.40s (nearest of 5 ticks in a row past ±0.30s of default" in d.arithmetic
    assert state.wait_streak == 0 and state.wait_seen is None


# The measured wait per tick of that run (bench/goodput --healthy --fleets 2p4d --loads 90, 240 s; 1 = the
# proxy's timeout or more)
HEALTHY_90_WAITS = [
    float(v)
    for v in (  # noqa: SIM905
        "1 1 1 1 1 1 1 0.75 1 1 1 0.85 0.85 0.85 0.85 0.65 0.4 0.35 0.3 0.3 0.3 0.3 0.3 0.3 0.75 1 1 1 1 "
        "1 1 1 1 1 0.85 0.7 0.7 0.7 0.75 0.75 0.75 0.75 0.75 0.75 0.85 0.85 0.85 0.85 0.85 0.85 1 1 1 1 1 "
        "0.9 0.8 0.8 0.8 0.75 0.75 0.75 0.75 0.8 1 1 0.95 0.95 0.9 0.9 0.9 0.75 0.8 0.8 0.85 0.95 1 1 1 1 "
        "1 1 1 1 1 1 1 1 1 0.8 0.55 0.35 0.05 0 0.05 0.05 0.05 0.05 0.05 0.35 0.6 0.95 0.95 0.9 0.9 0.95 "
        "0.95 0.9 0.8 0.8 0.75 0.5 0.35 0.4 0.3 0.3 0.3 0.3 0.3 0.45 0.5 0.75 0.9 0.9 0.75 0.75 0.75 0.65 "
        "0.65 0.75 0.75 0.5 0 0 0 0 0 0 0 0.3 0.5 0.7 0.7 0.3 0.1 0 0 0 0 0 0 0.6 0.8 0.85 0.75 0.75 0.65 "
        "0.85 0.85 0.85 0.85 0.9 0.9 1 1 1 1 0.9 0.85 0.85 0.85 0.85 0.85 0.85 0.7 0.65 0.7 0.7 0.85 0.65 "
        "0.65 0.65 0.65 0.65 0.7 0.7 0.7 0.8 0.85 0.8 0.75 0.7 0.6 0.7 0.7 0.8 0.7 0.8 0.95 1 0.9 0.9 0.9 "
        "0.75 0.6 0.6 0.6 0.6 0.4 0.4 0.4 0.3 0.3 0.4 0.3 0.45 0.5 0.65 0.9 0.8 0.8 0.9 0.8 0.85 1 0.8 "
        "0.75 0.75 0.75 0.75 0.4 0.4 0.4 0.4 0.4 0.4 0.4 0.4 0.9 0.9 0.95 1 0.8 0.8 0.5 0.1 0.45 0.25 0.2 "
        "0.15 0.1 0.3 0.35 0.35 0.15 0 0 0 0 0 0 0 0.65 0.5 0.5 0.25 "
    ).split()
]


def test_a_noisy_healthy_fleet_publishes_few_waits() -> None:
    """The measured wait of a healthy 2P+4D run at 90 % (bench/goodput --healthy, 1 s ticks, 10 s window,
    one value per tick as it moved): 124 changes of the measure; published, 1."""
    cfg = replace(CFG, interval_s=1.0, window_s=10.0, default_queue_wait_s=1.0)
    state, changes = LimitState(256, 1000, 0, None), 0
    for w in HEALTHY_90_WAITS:
        d = decide_pool(replace(CALM_P, service_ttft_at_slo_s=2.0 - w), state, cfg, stale=False)
        changes += d.changed("max_queue_wait_s")
        state = d.new
    assert changes <= 2


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


def test_with_admission_by_prediction_latency_pressures_are_explained_but_cut_nothing() -> None:
    """TTFT over target and P's queue are the proxies' predictor's to act on; KV headroom still cuts."""
    hot = replace(CALM_P, ttft_at_slo_s=6.0, waiting_now=200.0, service_ttft_at_slo_s=1.9)
    own = decide_pool(hot, decide_pool(hot, None, CFG, stale=False).new, CFG, stale=False)
    assert own.new.max_inflight_requests < 100, own.arithmetic  # the controller alone cuts on it
    prev: LimitState | None = None
    for _ in range(5):
        d = decide_pool(hot, prev, PREDICTING, stale=False)
        prev = d.new
        assert d.new.max_inflight_requests == 100 and d.new.max_queue_wait_s is None, d.arithmetic
        assert d.scores["ttft"] < 0.5 and "admission by prediction" in d.message
    full = replace(hot, kv_usage=0.97)
    full = decide_pool(full, decide_pool(full, None, PREDICTING, stale=False).new, PREDICTING, stale=False)
    assert full.new.max_inflight_requests < 100 and full.new.max_inflight_kv_bytes < 1000
