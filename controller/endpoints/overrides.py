"""Operator overrides (the guard has authenticated each request): an instance's weight, its
drain, a pool's weight. :class:`controller.overrides.OverridesService` validates and stores
them; this module turns the bodies into :class:`controller.overrides.Change` and the results
into answers. Only the leader takes a change: a standby answers 409 naming the leader
(:meth:`controller.loop.Reconciler.require_leader`), before anything is read or written."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Depends
from fastapi.types import DecoratedCallable

from controller.endpoints.context import MUTATION, ApiContext, caller
from controller.overrides import Change, Kind
from controller.schemas import (
    ClearIn,
    DrainIn,
    InstanceWeightOut,
    NotLeaderOut,
    PoolOut,
    UndrainIn,
    WeightIn,
)


def weight_change(kind: Kind, subject: str, action: str, body: WeightIn, actor: str) -> Change:
    """The weight override of ``subject`` that ``body`` asks for (until ``body.ttl_s`` passes)."""
    return Change(
        kind, subject, "weight", action, body.reason, actor, sets=True, weight=body.weight, ttl_s=body.ttl_s
    )


def instance_change(ctx: ApiContext, change: Change) -> InstanceWeightOut:
    """Make ``change`` and answer with the instance as served after it (and its audit event)."""
    res = ctx.overrides.change_instance(change)
    out = ctx.views.instance(ctx.reconciler.view(), change.subject, res.active, res.served)
    out.audit_id = res.audit_id
    return out


def pool_change(ctx: ApiContext, change: Change) -> PoolOut:
    """Make ``change`` and answer with the pool after it: the override it started (or none) and its
    audit event."""
    res = ctx.overrides.change_pool(change)
    out = next(p for p in ctx.views.pools() if p.name == change.subject)
    out.override = res.override
    out.audit_id = res.audit_id
    return out


def router(ctx: ApiContext) -> APIRouter:
    def leader_only() -> None:
        ctx.reconciler.require_leader()  # NotLeader: 409, the API's translation

    r = APIRouter(
        dependencies=[*MUTATION, Depends(leader_only)],
        responses={409: {"model": NotLeaderOut, "description": "a standby (or nothing to clear)"}},
    )

    def on_instance(
        method: str, action: str, summary: str | None = None
    ) -> Callable[[DecoratedCallable], DecoratedCallable]:
        """An instance's route: ``/v1/instances/{name}/<action>``, answered with the instance."""
        path = f"/v1/instances/{{name}}/{action}"
        return r.api_route(
            path, methods=[method], response_model=InstanceWeightOut, tags=["instances"], summary=summary
        )

    def on_pool(method: str, summary: str) -> Callable[[DecoratedCallable], DecoratedCallable]:
        """A pool's weight route, answered with the pool."""
        path = "/v1/pools/{pool}/weight"
        return r.api_route(path, methods=[method], response_model=PoolOut, tags=["routing"], summary=summary)

    @on_instance("PUT", "weight", "Override an instance's weight until ttl_s passes")
    def put_weight(name: str, body: WeightIn, actor: str = Depends(caller)) -> InstanceWeightOut:
        return instance_change(ctx, weight_change("instance", name, "weight.set", body, actor))

    @on_instance("DELETE", "weight", "End an instance's weight override now")
    def delete_weight(name: str, body: ClearIn, actor: str = Depends(caller)) -> InstanceWeightOut:
        return instance_change(
            ctx, Change.clear("instance", name, "weight", "weight.clear", body.reason, actor)
        )

    @on_instance(
        "POST", "drain", "Send no new work to an instance (weight 0) until undrained or ttl_s passes"
    )
    def drain(name: str, body: DrainIn, actor: str = Depends(caller)) -> InstanceWeightOut:
        return instance_change(
            ctx, Change("instance", name, "drain", "drain", body.reason, actor, sets=True, ttl_s=body.ttl_s)
        )

    @on_instance("POST", "undrain")
    def undrain(name: str, body: UndrainIn, actor: str = Depends(caller)) -> InstanceWeightOut:
        return instance_change(ctx, Change.clear("instance", name, "drain", "undrain", body.reason, actor))

    @on_pool("PUT", "Override a pool's weight (relative to pools of the same role) until ttl_s passes")
    def put_pool_weight(pool: str, body: WeightIn, actor: str = Depends(caller)) -> PoolOut:
        return pool_change(ctx, weight_change("pool", pool, "pool_weight.set", body, actor))

    @on_pool("DELETE", "End a pool's weight override now (the configured weight applies again)")
    def delete_pool_weight(pool: str, body: ClearIn, actor: str = Depends(caller)) -> PoolOut:
        return pool_change(ctx, Change.clear("pool", pool, "weight", "pool_weight.clear", body.reason, actor))

    return r
