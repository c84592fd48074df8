"""One reconcile tick as a pure function: ``decide(TickInput) -> TickOutput``.

The loop observes the store, calls :func:`decide`, persists and serves the result.
Everything the tick depends on is in its input (observation, the state carried from
the previous tick, active overrides, the fleet as configured, the mode); everything it
wants done is in its output. Replaying stored inputs reproduces the same decisions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from controller.policy.admission import LimitState, PoolDecision, decide_pools
from controller.policy.alerts import AlertConfig, AlertRule, AlertState, AlertStep, step_alerts
from controller.policy.compat import AvoidedPair, judge
from controller.policy.config import PolicyConfig
from controller.policy.routes import (
    InstanceSpec,
    Override,
    PoolSpec,
    ServedInstance,
    build_table,
    same_content,
)
from controller.policy.signals import Observation
from controller.policy.stale import StalePair, avoided, relieve_stale, stale_pairs
from controller.policy.weights import WeightDecision, WeightState, decide_weights
from pdscope.routing import RoutingTable


@dataclass(frozen=True)
class PolicyState:
    """Carried from one tick to the next (and rebuilt from stored decisions on restart)."""

    tick: int = 0
    weights: Mapping[str, WeightState] = field(default_factory=dict)
    limits: Mapping[str, LimitState] = field(default_factory=dict)
    alerts: Mapping[str, AlertState] = field(default_factory=dict)
    table: RoutingTable | None = None
    # the P x D pairs left out of routing (controller.policy.stale), by "P->D"
    stale: Mapping[str, StalePair] = field(default_factory=dict)
    # the P x D pairs left out of routing for their identities (controller.policy.compat), by "P->D"
    compat: Mapping[str, AvoidedPair] = field(default_factory=dict)


@dataclass(frozen=True)
class TickInput:
    obs: Observation
    state: PolicyState
    overrides: tuple[Override, ...]
    instances: tuple[InstanceSpec, ...]
    pools: tuple[PoolSpec, ...]
    mode: Literal["advisory", "enforce"]


@dataclass(frozen=True)
class TickOutput:
    tick: int
    weights: tuple[WeightDecision, ...]
    pools: tuple[PoolDecision, ...]
    alerts: AlertStep
    table: RoutingTable
    served: Mapping[str, ServedInstance]
    state: PolicyState
    table_changed: bool


def compose(
    state: PolicyState,
    overrides: tuple[Override, ...],
    instances: tuple[InstanceSpec, ...],
    pools: tuple[PoolSpec, ...],
    mode: Literal["advisory", "enforce"],
    now: float,
    reasons: Mapping[str, str],
    limit_reasons: Mapping[str, str],
    stale: Mapping[str, StalePair] | None = None,
) -> tuple[RoutingTable, dict[str, ServedInstance], bool]:
    """The table for the current state and overrides; a new version only if content changed."""
    prev = state.table
    version = prev.version if prev is not None else 0
    policy_weights = {n: (ws.weight, reasons.get(n, ws.reason)) for n, ws in state.weights.items()}
    table, served = build_table(
        instances=instances,
        pools=pools,
        policy_weights=policy_weights,
        limits=state.limits,
        limit_reasons=limit_reasons,
        overrides=overrides,
        mode=mode,
        now=now,
        version=version + 1,
        stale=avoided(stale if stale is not None else state.stale),
        incompatible=state.compat.values(),
    )
    if same_content(prev, table) and prev is not None:
        return table.model_copy(update={"version": prev.version}), served, False
    return table, served, True


def decide(inp: TickInput, cfg: PolicyConfig, rules: tuple[AlertRule, ...], ac: AlertConfig) -> TickOutput:
    obs, st = inp.obs, inp.state
    stale = stale_pairs(obs, st.stale, cfg.min_error_events)
    relieved, basis = relieve_stale(obs, stale)
    weights = _with_basis(decide_weights(relieved, st.weights, cfg), basis)
    new_weights = dict(st.weights)
    new_weights.update({d.instance: d.state for d in weights})
    pools = decide_pools(obs, st.limits, cfg)
    new_limits = dict(st.limits)
    new_limits.update({d.pool: d.new for d in pools})
    alerts = step_alerts(rules, obs, cfg, ac, st.alerts)
    compat = judge(obs, st.compat).by_pair()
    mid = PolicyState(
        st.tick + 1,
        new_weights,
        new_limits,
        {a.fingerprint: a for a in alerts.active},
        st.table,
        stale,
        compat,
    )
    table, served, new_version = compose(
        mid,
        inp.overrides,
        inp.instances,
        inp.pools,
        inp.mode,
        obs.now,
        {d.instance: d.reason for d in weights},
        {d.pool: d.reason for d in pools},
    )
    state = PolicyState(mid.tick, mid.weights, mid.limits, mid.alerts, table, stale, compat)
    return TickOutput(mid.tick, weights, pools, alerts, table, served, state, new_version)


def _with_basis(weights: tuple[WeightDecision, ...], basis: Mapping[str, str]) -> tuple[WeightDecision, ...]:
    """Each D's decision with what its stale pairs moved off it (``inputs.stale_peer_basis``)."""
    if not basis:
        return weights
    return tuple(
        replace(d, inputs={**d.inputs, "stale_peer_basis": basis[d.instance]}) if d.instance in basis else d
        for d in weights
    )
