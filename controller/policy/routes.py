"""Manual overrides on top of the policy's output, and the routing table they make.

An active override (not cleared, ``expires`` in the future or never) wins over the
policy: an instance weight override sets the weight; a drain sets weight 0 and
``drained``; a pool override sets the pool's weight. When an override ends the policy's
weight (computed underneath all along) applies again. Pure: ``now`` is passed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from controller.policy.admission import LimitState
from controller.policy.compat import AvoidedPair
from controller.policy.signals import Role
from controller.policy.stale import StalePair
from pdscope.reasons import Reason
from pdscope.routing import InstanceRoute, PairRoute, PoolRoute, RoutingTable


@dataclass(frozen=True)
class Override:
    id: int
    subject_kind: Literal["instance", "pool"]
    subject: str
    weight: float | None
    drained: bool
    reason: str
    actor: str
    created: float
    expires: float | None

    def active(self, now: float) -> bool:
        return self.expires is None or self.expires > now


@dataclass(frozen=True)
class InstanceSpec:
    name: str
    pool: str
    role: Role
    url: str


@dataclass(frozen=True)
class PoolSpec:
    name: str
    role: Role
    weight: float


@dataclass(frozen=True)
class ServedInstance:
    """The weight served for one instance, and where it came from."""

    name: str
    weight: float
    policy_weight: float
    drained: bool
    source: Literal["policy", "override", "drain"]
    reason: str
    override: Override | None


OverrideKey = tuple[str, str, Literal["drain", "weight"]]


def active_overrides(overrides: Iterable[Override], now: float) -> dict[OverrideKey, Override]:
    """The newest active override per (kind, subject, drain|weight): a drain and a weight
    override are separate slots, and a drain wins over a weight while both are active."""
    out: dict[OverrideKey, Override] = {}
    for o in sorted(overrides, key=lambda o: (o.created, o.id)):
        if o.active(now):
            out[(o.subject_kind, o.subject, "drain" if o.drained else "weight")] = o
    return out


def serve_instance(
    name: str, policy_weight: float, policy_reason: str, drain: Override | None, weight: Override | None
) -> ServedInstance:
    if drain is not None:
        return ServedInstance(name, 0.0, policy_weight, True, "drain", Reason.DRAINED, drain)
    if weight is not None and weight.weight is not None:
        return ServedInstance(
            name, weight.weight, policy_weight, False, "override", Reason.MANUAL_OVERRIDE, weight
        )
    return ServedInstance(name, policy_weight, policy_weight, False, "policy", policy_reason, None)


def build_table(
    *,
    instances: Sequence[InstanceSpec],
    pools: Sequence[PoolSpec],
    policy_weights: Mapping[str, tuple[float, str]],
    limits: Mapping[str, LimitState],
    limit_reasons: Mapping[str, str],
    overrides: Iterable[Override],
    mode: Literal["advisory", "enforce"],
    now: float,
    version: int,
    stale: Iterable[StalePair] = (),
    incompatible: Iterable[AvoidedPair] = (),
) -> tuple[RoutingTable, dict[str, ServedInstance]]:
    """The routing table for ``now``; ``policy_weights`` maps name -> (weight, reason); ``stale`` and
    ``incompatible``: the pairs left out of routing (``avoid_pairs``), a pair both is only once, as
    incompatible (which the proxy never probes)."""
    act = active_overrides(overrides, now)
    served: dict[str, ServedInstance] = {}
    routes: list[InstanceRoute] = []
    for spec in instances:
        w, why = policy_weights.get(spec.name, (1.0, Reason.NO_DECISION_YET))
        s = serve_instance(
            spec.name,
            w,
            why,
            act.get(("instance", spec.name, "drain")),
            act.get(("instance", spec.name, "weight")),
        )
        served[spec.name] = s
        routes.append(
            InstanceRoute(
                name=spec.name,
                pool=spec.pool,
                role=spec.role,
                url=spec.url,
                weight=s.weight,
                drained=s.drained,
                reason=s.reason,
            )
        )
    pool_routes: list[PoolRoute] = []
    for p in pools:
        ov = act.get(("pool", p.name, "weight"))
        weight, reason = p.weight, str(Reason.CONFIGURED)
        if ov is not None and ov.weight is not None:
            weight, reason = ov.weight, Reason.MANUAL_OVERRIDE
        lim = limits.get(p.name)
        if lim is not None and reason == Reason.CONFIGURED:
            reason = limit_reasons.get(p.name, reason)
        pool_routes.append(
            PoolRoute(
                name=p.name,
                role=p.role,
                weight=weight,
                max_inflight_requests=None if lim is None else lim.max_inflight_requests,
                max_inflight_kv_bytes=None if lim is None else lim.max_inflight_kv_bytes,
                max_queue_wait_s=None if lim is None else lim.max_queue_wait_s,
                reason=reason,
            )
        )
    table = RoutingTable(
        version=version,
        generated_at=now,
        mode=mode,
        enforce=mode == "enforce",
        instances=routes,
        pools=pool_routes,
        avoid_pairs=_avoid_pairs(stale, incompatible),
    )
    return table, served


def _avoid_pairs(stale: Iterable[StalePair], incompatible: Iterable[AvoidedPair]) -> list[PairRoute]:
    """The table's ``avoid_pairs``, by P and D; each text cut to the field's bound (instance names go to
    128 characters)."""
    out = {
        (a.p_instance, a.d_instance): PairRoute(
            prefill=a.p_instance,
            decode=a.d_instance,
            reason=Reason.INCOMPATIBLE_PAIR,
            since=a.since,
            text=f"{a.status}: {a.text}"[:500],
        )
        for a in incompatible
    }
    for sp in stale:
        out.setdefault(
            (sp.p_instance, sp.d_instance),
            PairRoute(
                prefill=sp.p_instance,
                decode=sp.d_instance,
                reason=Reason.STALE_PEER_AFTER_RESTART,
                since=sp.since,
                text=sp.text[:500],
            ),
        )
    return [out[k] for k in sorted(out)]


def same_content(a: RoutingTable | None, b: RoutingTable) -> bool:
    """Equal apart from ``version`` and ``generated_at`` (a new version only when this is False)."""
    if a is None:
        return False
    skip = {"version", "generated_at"}
    return a.model_dump(exclude=skip) == b.model_dump(exclude=skip)
