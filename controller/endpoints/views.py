"""The API's answers built from the reconciler's view and the active overrides."""

from __future__ import annotations

from typing import Any

from controller.loop import Reconciler, View
from controller.overrides import OverridesService
from controller.policy import Override, PoolDecision, ServedInstance, WeightDecision
from controller.policy.routes import OverrideKey, serve_instance
from controller.schemas import InstanceWeightOut, PoolOut


class Views:
    def __init__(self, reconciler: Reconciler, overrides: OverridesService) -> None:
        self.reconciler = reconciler
        self.overrides = overrides

    def instance(
        self,
        view: View,
        name: str,
        acts: dict[OverrideKey, Override] | None = None,
        served: ServedInstance | None = None,
    ) -> InstanceWeightOut:
        """One instance as served: with ``acts`` its overrides come from them, else from what is served."""
        spec = self.overrides.instances[name]
        s = served or view.served.get(name) or serve_instance(name, 1.0, "NoDecisionYet", None, None)
        drain = weight = None
        if acts is not None:
            drain = acts.get(("instance", name, "drain"))
            weight = acts.get(("instance", name, "weight"))
        elif s.override is not None:
            drain = s.override if s.source == "drain" else None
            weight = s.override if s.source == "override" else None
        return InstanceWeightOut(
            name=name,
            pool=spec.pool,
            role=spec.role,
            weight=s.weight,
            policy_weight=s.policy_weight,
            drained=s.drained,
            source=s.source,
            reason=s.reason,
            override=weight,
            drain=drain,
            decision=_decision_of(view, name),
        )

    def pools(self) -> list[PoolOut]:
        view = self.reconciler.view()
        acts = self.overrides.active()
        decisions = {d.pool: d for d in view.last.pools} if view.last else {}
        out: list[PoolOut] = []
        for p in view.table.pools:
            d = decisions.get(p.name)
            out.append(
                PoolOut(
                    name=p.name,
                    role=p.role,
                    configured_weight=self.overrides.pools[p.name].weight,
                    weight=p.weight,
                    reason=p.reason,
                    max_inflight_requests=p.max_inflight_requests,
                    max_inflight_kv_bytes=p.max_inflight_kv_bytes,
                    max_queue_wait_s=p.max_queue_wait_s,
                    override=acts.get(("pool", p.name, "weight")),
                    decision=None if d is None else _why(d),
                    instances=[self.instance(view, r.name) for r in view.table.instances if r.pool == p.name],
                )
            )
        return out


def _why(d: PoolDecision | WeightDecision) -> dict[str, Any]:
    """What a pool's or an instance's decision says of itself: its reason, message and arithmetic, with
    the scores and inputs it was taken on."""
    return {
        "reason": d.reason,
        "message": d.message,
        "arithmetic": d.arithmetic,
        "scores": dict(d.scores),
        "inputs": dict(d.inputs),
    }


def _decision_of(view: View, name: str) -> dict[str, Any] | None:
    if view.last is None:
        return None
    for d in view.last.weights:
        if d.instance == name:
            return {
                **_why(d),
                "target": d.target,
                "smoothed": d.smoothed,
                "tick": view.last.tick,
            }
    return None
