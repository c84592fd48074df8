"""Replay helpers for policy tests: a virtual clock and an observation builder.

A timeline maps a tick number to per-instance signal changes; :func:`replay` builds one
``Observation`` per tick on a virtual clock and feeds it through the pure ``decide``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from controller.policy import (
    AlertConfig,
    InstanceSignals,
    InstanceSpec,
    Observation,
    Override,
    PolicyConfig,
    PolicyState,
    PoolSignals,
    PoolSpec,
    SLOFigures,
    TickInput,
    TickOutput,
    decide,
    default_rules,
)

T0 = 1_800_000_000.0


@dataclass
class VirtualClock:
    now: float = T0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def healthy(name: str, role: str, pool: str | None = None) -> InstanceSignals:
    pool = pool or role
    base: dict[str, Any] = dict(
        name=name,
        pool=pool,
        role=role,
        up=True,
        kv_usage=0.4,
        num_running=4.0,
        num_waiting=0.0,
        requests=40,
        contribution_rse=0.03,
        handoff_rse=0.03,
    )
    if role == "prefill":
        base.update(
            contribution_s=0.20,
            ttft_mean_s=0.2,
            handoff_p50_s=0.05,
            handoff_p99_s=0.08,
            load_now=4.0,
            ttft_recent_s=0.2,
            ttft_recent_count=15.0,
            hold_time_now_s=0.8,
        )
    else:
        base.update(
            contribution_s=0.06,
            handoff_p50_s=0.05,
            handoff_p99_s=0.08,
            nixl_xfer_mean_s=0.01,
            queue_mean_s=0.05,
            handoff_backlog=0.0,
            nixl_transfers=40.0,
            load_now=0.0,
            nixl_recent_s=0.01,
            nixl_recent_count=10.0,
            hold_time_now_s=0.0,
        )
    return InstanceSignals(**base)


def fleet(n_p: int = 2, n_d: int = 4) -> tuple[InstanceSignals, ...]:
    return tuple(
        [healthy(f"prefill-{i}", "prefill") for i in range(n_p)]
        + [healthy(f"decode-{i}", "decode") for i in range(n_d)]
    )


def specs(insts: tuple[InstanceSignals, ...]) -> tuple[InstanceSpec, ...]:
    return tuple(InstanceSpec(i.name, i.pool, i.role, f"http://127.0.0.1/{i.name}") for i in insts)


def pool_specs() -> tuple[PoolSpec, ...]:
    return (PoolSpec("prefill", "prefill", 1.0), PoolSpec("decode", "decode", 1.0))


Changes = Mapping[str, Mapping[str, Any]]
Timeline = Callable[[int], Changes]


@dataclass
class Replay:
    outputs: list[TickOutput] = field(default_factory=list)

    def weights(self, name: str) -> list[float]:
        return [next(d.weight for d in o.weights if d.instance == name) for o in self.outputs]

    def served(self, name: str) -> list[float]:
        return [o.served[name].weight for o in self.outputs]

    def reasons(self, name: str) -> list[str]:
        return [next(d.reason for d in o.weights if d.instance == name) for o in self.outputs]

    def decision(self, tick: int, name: str) -> Any:
        return next(d for d in self.outputs[tick - 1].weights if d.instance == name)


def replay(
    timeline: Timeline,
    ticks: int,
    *,
    cfg: PolicyConfig | None = None,
    base: tuple[InstanceSignals, ...] | None = None,
    overrides: Callable[[float], tuple[Override, ...]] = lambda now: (),
    pools: Callable[[int], tuple[PoolSignals, ...]] = lambda tick: (),
    slo: Callable[[int], SLOFigures] = lambda tick: SLOFigures(window_s=300.0),
    clock: VirtualClock | None = None,
    stale: Callable[[int], bool] = lambda tick: False,
    alert_config: AlertConfig | None = None,
) -> Replay:
    """Run ``ticks`` ticks (1-based tick numbers in ``timeline``) on a virtual clock."""
    cfg = cfg or PolicyConfig.defaults()
    ac = alert_config or AlertConfig()
    clock = clock or VirtualClock()
    base = base or fleet()
    state = PolicyState()
    out = Replay()
    for tick in range(1, ticks + 1):
        now = clock.advance(cfg.interval_s)
        changes = timeline(tick)
        insts = tuple(replace(i, **changes.get(i.name, {})) for i in base)
        newest = now - 1.0 if not stale(tick) else now - 10 * cfg.stale_after_s
        obs = Observation(
            now=now, window_s=30.0, instances=insts, pools=pools(tick), slo=slo(tick), newest_data=newest
        )
        o = decide(
            TickInput(obs, state, overrides(now), specs(base), pool_specs(), "enforce"),
            cfg,
            default_rules(ac),
            ac,
        )
        state = o.state
        out.outputs.append(o)
    return out
