"""What the tenants bench runs: its scenarios, each tenant's declaration and load, and the seeded
schedules (pure values and functions: no I/O, no clock).

Every load is declared up front as a multiple of the fleet's capacity (measured in the same run,
:mod:`bench.tenants.run`); a tenant's *share* is the capacity times its weight over the scenario's
weights, so ``of_capacity / share`` is how far past its share a tenant asks. Arrivals are Poisson, or
bursty (bursts of ``BURST`` at once) for a flood; prompt and output lengths are mixed (lognormal,
clamped) and seeded per tenant, so that one tenant's schedule is the same alone and beside the others.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from simulator.workload import LengthDist, Planned, arrival_times

PROMPT_MIX = "lognormal:1024,0.7"  # mean about 1,300 tokens: a mix of short and long
PROMPT = LengthDist.parse(PROMPT_MIX)
OUTPUT_MIX = "lognormal:24,0.6"
OUTPUT = LengthDist.parse(OUTPUT_MIX)
PROMPT_RANGE, OUTPUT_RANGE = (64, 6144), (4, 128)
MEAN_PROMPT_TOKENS = 1300.0  # PROMPT's mean within PROMPT_RANGE, rounded (the capacity steps' guess)
BURST = 10
FLEET_TTFT_MS, FLEET_TPOT_MS = 2000.0, 100.0  # bench.goodput.stack's fleet SLO
HEADER = "x-pdscope-tenant"  # tenants.header's default
CLASSES = ["interactive", "batch"]


@dataclass(frozen=True)
class TenantLoad:
    """One tenant: its declaration (``tenants.tenants.<id>``) and what it sends."""

    id: str
    of_capacity: float  # offered load, a multiple of the fleet's measured capacity
    weight: float = 1.0
    priority: str = "interactive"
    ttft_ms: float = FLEET_TTFT_MS
    tpot_ms: float = FLEET_TPOT_MS
    pattern: str = "poisson"  # or "bursty"
    behaved: bool = True  # asks no more than its share: its attainment alone is its reference
    prompt: str = PROMPT_MIX  # its prompts' lengths (simulator.workload.LengthDist), in PROMPT_RANGE
    output: str = OUTPUT_MIX  # its outputs' lengths, from OUTPUT_RANGE's least to output_max
    output_max: int = OUTPUT_RANGE[1]

    def declared(self) -> dict[str, Any]:
        return {
            "weight": self.weight,
            "priority": self.priority,
            "slo": {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms},
        }


@dataclass(frozen=True)
class Fleet:
    """A scenario's changes to the fleet: each pool's request slots in the proxy
    (``proxy.admission.max_inflight_requests``), and the simulated instances' step time per sequence in
    the batch (``simulator.decode_per_seq_s``)."""

    pool_slots: int
    decode_per_seq_s: float


@dataclass(frozen=True)
class Scenario:
    name: str
    about: str
    tenants: tuple[TenantLoad, ...]
    fleet: Fleet | None = None  # the fleet's own knobs for this scenario; None: bench/goodput's

    def share(self, tenant: TenantLoad) -> float:
        """The tenant's weighted share of the fleet, a fraction of its capacity."""
        return tenant.weight / sum(t.weight for t in self.tenants)

    def tenant(self, tid: str) -> TenantLoad:
        return next(t for t in self.tenants if t.id == tid)

    def behaved(self) -> list[TenantLoad]:
        return [t for t in self.tenants if t.behaved]


SCENARIOS = {
    "flood": Scenario(
        "flood",
        "equal weights; two tenants at 3/4 of their share, one flooding at 5x its share in bursts",
        (
            TenantLoad("alpha", 0.25),
            TenantLoad("beta", 0.25),
            TenantLoad("flood", 5 / 3, pattern="bursty", behaved=False),
        ),
    ),
    "priority": Scenario(
        "priority",
        "an interactive tenant (tighter TTFT) at 0.3x capacity beside a batch tenant at 1.5x",
        (
            TenantLoad("chat", 0.3, ttft_ms=1500.0),
            TenantLoad("batch", 1.5, priority="batch", ttft_ms=10_000.0, tpot_ms=200.0, behaved=False),
        ),
    ),
    "longprompt": Scenario(
        "longprompt",
        "equal weights; a tenant of long prompts (about 4,000 tokens) at 0.1x capacity in requests (about"
        " 0.6 of its share in tokens) beside a flood at 5/3x capacity (3.3x its share) in bursts",
        (
            TenantLoad("rag", 0.1, prompt="lognormal:4000,0.2"),
            TenantLoad("flood", 5 / 3, pattern="bursty", behaved=False),
        ),
    ),
    "shapes": Scenario(
        "shapes",
        "equal weights, D's slots the bottleneck (32 a pool, decode slower with the batch); a tenant of"
        " long prompts and short answers (about 4,000 and 24 tokens) at 0.15x capacity in requests (about"
        " half of P) beside one of short prompts and long answers (about 256 and 150 tokens) at 0.6x,"
        " past what D's slots hold: each heavy in its own pool",
        (
            TenantLoad("rag", 0.15, prompt="lognormal:4000,0.2"),
            TenantLoad(
                "writer",
                0.6,
                prompt="lognormal:256,0.5",
                output="lognormal:150,0.3",
                output_max=512,
                behaved=False,
            ),
        ),
        Fleet(pool_slots=32, decode_per_seq_s=0.002),
    ),
    "mixed": Scenario(
        "mixed",
        "weights 3:1:1:1 and three SLOs: a heavy interactive tenant (1.5 s TTFT) at 0.7 of its share and"
        " a light one (3 s) at 0.6 of its, beside a batch tenant at 1x capacity and a bursty flood, 1.2x",
        (
            TenantLoad("gold", 0.35, weight=3.0, ttft_ms=1500.0),
            TenantLoad("web", 0.1, ttft_ms=3000.0),
            TenantLoad("bulk", 1.0, priority="batch", ttft_ms=10_000.0, tpot_ms=200.0, behaved=False),
            TenantLoad("flood", 1.2, pattern="bursty", behaved=False),
        ),
    ),
    "backlog": Scenario(
        "backlog",
        "weights 2:1:1, each tenant offering 3/4 of capacity: all three past their share (Jain's index)",
        (
            TenantLoad("gold", 0.75, weight=2.0, behaved=False),
            TenantLoad("silver", 0.75, behaved=False),
            TenantLoad("bronze", 0.75, behaved=False),
        ),
    ),
}


def tenants_section(scenario: Scenario, enabled: bool) -> dict[str, Any]:
    """The run's ``tenants`` section: the scenario's tenants declared, on (fair) or off (the baseline:
    the proxy ignores the section, every request is ``default``'s)."""
    return {
        "enabled": enabled,
        "header": HEADER,
        "unknown": "default",
        "classes": CLASSES,
        "tenants": {t.id: t.declared() for t in scenario.tenants},
    }


def _clamp(n: int, bounds: tuple[int, int]) -> int:
    return min(max(n, bounds[0]), bounds[1])


def tenant_plan(t: TenantLoad, capacity_rps: float, duration_s: float, seed: int) -> list[Planned]:
    """One tenant's schedule over ``duration_s``; its seed is the run's and its id's, so it is the same
    in every run of the scenario (alone or not)."""
    rng = random.Random(f"{seed}:{t.id}")
    rate = t.of_capacity * capacity_rps
    times = arrival_times(t.pattern, rate, 10**6, duration_s, rng, BURST)
    prompt, output = LengthDist.parse(t.prompt), LengthDist.parse(t.output)
    outputs = (OUTPUT_RANGE[0], t.output_max)
    return [
        Planned(at, _clamp(prompt.sample(rng), PROMPT_RANGE), _clamp(output.sample(rng), outputs))
        for at in times
    ]


def schedule(
    scenario: Scenario, capacity_rps: float, duration_s: float, seed: int, only: str | None = None
) -> list[tuple[str, Planned]]:
    """Every tenant's requests (or ``only``'s), merged in time order, each with its tenant id."""
    out = [
        (t.id, p)
        for t in scenario.tenants
        if only is None or t.id == only
        for p in tenant_plan(t, capacity_rps, duration_s, seed)
    ]
    return sorted(out, key=lambda x: x[1].at)
