"""The fleet bench's pure parts: the workload plan, the figures from what was measured, the table.

No I/O here (``bench/fleet/run.py`` runs the fleets); ``tests/bench/test_fleet_bench.py`` checks
these on made-up measurements.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

from pdscope import stats

OVERSHOOT_TARGET = 0.10  # the in-flight sum within 10% of each pool's limit
GOODPUT_TARGET = 0.10  # 3 proxies within 10% of one proxy's goodput


@dataclass(frozen=True)
class Plan:
    """One bench run's shape and workload (the same for every contender)."""

    prefill: int
    decode: int
    limit: int  # each pool's max_inflight_requests
    factor: float  # offered in-flight demand / limit
    burst_s: float
    max_tokens: int
    prompt_tokens: int
    slo_e2e_s: float  # a request counts toward goodput when it succeeded within this
    seed: int
    calibrate_requests: int

    @property
    def name(self) -> str:
        return f"{self.prefill}P+{self.decode}D"


FULL = Plan(
    prefill=8,
    decode=16,
    limit=48,
    factor=1.5,
    burst_s=20.0,
    max_tokens=16,
    prompt_tokens=64,
    slo_e2e_s=4.0,
    seed=16,
    calibrate_requests=32,
)
QUICK = replace(FULL, prefill=2, decode=4, limit=16, burst_s=6.0, calibrate_requests=20)


def burst_rate(limit: int, service_s: float, factor: float) -> float:
    """Arrivals per second that keep ``factor`` x ``limit`` requests in flight (Little's law) when a
    request takes ``service_s`` unqueued."""
    if service_s <= 0 or limit <= 0 or factor <= 0:
        raise ValueError(
            f"burst_rate needs positive limit, service and factor: {limit}, {service_s}, {factor}"
        )
    return factor * limit / service_s


def overshoot(peak: float, limit: int) -> float:
    """How far the in-flight sum went over the limit, as a fraction of it (0 when it stayed under)."""
    return max(0.0, peak / limit - 1.0)


def percentiles(xs: Sequence[float], ps: Sequence[int] = (50, 90, 99)) -> dict[str, float]:
    """The kernel's percentiles (``p50`` ...: :func:`pdscope.stats.percentiles`, interpolated between
    order statistics, as every pdscope figure); empty when there is nothing to rank."""
    if not xs:
        return {}
    return {f"p{p}": float(v or 0.0) for p, v in zip(ps, stats.percentiles(xs, ps), strict=True)}


def median(xs: Sequence[float]) -> float:
    """The kernel's 50th percentile: the middle value, or the mean of the two middle ones."""
    if not xs:
        raise ValueError("median of nothing")
    return float(stats.percentile(xs, 50.0) or 0.0)


@dataclass(frozen=True)
class RunResult:
    """What one contender's run measured."""

    contender: str
    proxies: int
    rate: float
    sent: int
    ok: int
    rejected: int  # 429: over a limit, the admission's answer
    failed: int  # anything else that did not succeed
    good: int  # ok within the e2e SLO
    wall_s: float  # the burst and its tail (the last answers)
    burst_s: float  # the arrivals' span: goodput is per second of it
    peak_inflight: Mapping[str, float]  # pool -> the largest sum across proxies sampled
    samples: int
    takeover_s: float | None = None
    records_expected: int | None = None
    records_stored: int | None = None
    not_ok: Mapping[str, int] = field(default_factory=dict)  # "<status>:<reason>" -> count
    sim_loop_lag_max_s: float | None = None  # the simulator's own trust figure (0.05 s threshold)
    e2e_ok_s: Mapping[str, float] = field(default_factory=dict)  # p50/p90/p99 of the requests that succeeded

    @property
    def goodput_rps(self) -> float:
        return self.good / self.burst_s if self.burst_s > 0 else 0.0

    @property
    def records_lost(self) -> int | None:
        if self.records_expected is None or self.records_stored is None:
            return None
        return max(0, self.records_expected - self.records_stored)


def summary(plan: Plan, runs: Mapping[str, RunResult], service_s: float) -> dict[str, object]:
    """The JSON the bench writes: the plan, each run, and the figures against their targets."""
    out: dict[str, object] = {
        "plan": asdict(plan),
        "service_s": service_s,
        "runs": {
            name: {**asdict(r), "goodput_rps": r.goodput_rps, "records_lost": r.records_lost}
            for name, r in runs.items()
        },
    }
    figures: dict[str, object] = {}
    for name, r in runs.items():
        figures[f"{name}_worst_overshoot"] = max(
            (overshoot(v, plan.limit) for v in r.peak_inflight.values()), default=None
        )
    fleet, one = runs.get("apportioned"), runs.get("one_proxy")
    ratio = fleet.goodput_rps / one.goodput_rps if fleet and one and one.goodput_rps > 0 else None
    figures["goodput_ratio_3_vs_1"] = ratio
    figures["takeover_s"] = None if fleet is None else fleet.takeover_s
    figures["records_lost"] = None if fleet is None else fleet.records_lost
    worst = (
        None
        if fleet is None
        else max((overshoot(v, plan.limit) for v in fleet.peak_inflight.values()), default=None)
    )
    figures["targets"] = {
        "overshoot_within_10pct": None if worst is None else worst <= OVERSHOOT_TARGET,
        "goodput_within_10pct": None if ratio is None else abs(ratio - 1.0) <= GOODPUT_TARGET,
        "no_records_lost": None if fleet is None or fleet.records_lost is None else fleet.records_lost == 0,
    }
    out["figures"] = figures
    return out


def table(plan: Plan, runs: Mapping[str, RunResult]) -> str:
    """One line per run: the in-flight peaks per pool against the limit, outcomes and goodput."""
    head = (
        f"{'run':<12} {'proxies':>7} {'rate/s':>7} {'sent':>6} {'ok':>6} {'429':>5} {'fail':>5} "
        f"{'peak P':>7} {'peak D':>7} {'over':>6} {'goodput/s':>9} {'takeover':>8} {'lost':>5}"
    )
    lines = [f"fleet bench {plan.name}, each pool's limit {plan.limit}, burst {plan.factor:g}x", head]
    for name, r in runs.items():
        peak_p = r.peak_inflight.get("prefill", 0.0)
        peak_d = r.peak_inflight.get("decode", 0.0)
        over = max(overshoot(peak_p, plan.limit), overshoot(peak_d, plan.limit))
        lines.append(
            f"{name:<12} {r.proxies:>7} {r.rate:>7.1f} {r.sent:>6} {r.ok:>6} {r.rejected:>5} {r.failed:>5} "
            f"{peak_p:>7.0f} {peak_d:>7.0f} {over:>6.0%} {r.goodput_rps:>9.1f} "
            f"{'-' if r.takeover_s is None else f'{r.takeover_s:.2f}s':>8} "
            f"{'-' if r.records_lost is None else r.records_lost:>5}"
        )
    return "\n".join(lines)
