"""The control API (FastAPI; OpenAPI at ``/openapi.json``, docs at ``/docs``).

Reads are open (the proxy polls ``GET /v1/routing``); every mutation needs
``Authorization: Bearer <token>``, checked by :class:`controller.guard.RequestGuard` before
any of the body is read (which also bounds the body's size and nesting). The audit actor is
the token's identity (``identity:X-Actor`` when that header is sent; see
``controller.auth``). A mutation of one subject (an instance or a pool) is serialised: an
in-process lock per subject and, in the same transaction, the store's lock for it
(:func:`controller.persist.lock_subject`); the override, the replaced one's ``cleared`` and
the ``AuditEvent`` (who, before, after, reason) are written in that one transaction, the
audit log line only after it commits, and then the served table is recomposed at once.
Bad input is a 4xx naming the field and the reason, and nothing is written.

Errors: ``store.StoreError`` becomes 503 (a retry may help); unknown names 404.
This module does no policy: it reads the reconciler's view and writes overrides.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from sqlalchemy import select
from sqlalchemy.orm import Session

from controller.auth import API_IDENTITY, Authenticator, AuthError, audit_actor
from controller.guard import RequestGuard
from controller.loop import Reconciler, View
from controller.notify import Notifier, NullNotifier
from controller.persist import load_overrides, lock_subject, to_override
from controller.policy import Override, ServedInstance
from controller.policy.routes import active_overrides, serve_instance
from controller.schemas import (
    AlertOut,
    AlertRuleOut,
    ClearIn,
    DecisionOut,
    DrainIn,
    HealthOut,
    InstanceWeightOut,
    OverrideOut,
    PoolOut,
    SLOOut,
    UndrainIn,
    WeightIn,
    WhoAmIOut,
)
from pdscope.routing import RoutingTable, routing_etag
from store.db import StoreError, transaction
from store.models import Alert, AuditEvent, Decision, WeightOverride

log = logging.getLogger(__name__)
audit_log = logging.getLogger("controller.audit")

XActor = Annotated[str | None, Header(description="on whose behalf (UTF-8, at most 64 characters); recorded "
                                                 "as identity:X-Actor in the audit trail")]

AUDIT_ACTIONS = ("weight.set", "weight.clear", "drain", "undrain", "pool_weight.set", "pool_weight.clear")


def _override_out(o: Override | None) -> OverrideOut | None:
    if o is None:
        return None
    return OverrideOut(id=o.id, subject_kind=o.subject_kind, subject=o.subject, weight=o.weight, drained=o.drained,
                       reason=o.reason, actor=o.actor, created=o.created, expires=o.expires)


def create_app(
    reconciler: Reconciler,
    *,
    token: str | None,
    tokens: Mapping[str, str] | None = None,
    registry: CollectorRegistry | None = None,
    notifier: Notifier | None = None,
    run_loop: bool = False,
) -> FastAPI:
    """The app. ``token`` is identity ``"api"``'s; ``tokens`` maps more identities to theirs.
    With ``run_loop`` the reconcile loop runs for the app's lifetime."""
    settings = reconciler.settings
    ids = dict(tokens or {})
    if token:
        ids[API_IDENTITY] = token
    authn = Authenticator(ids, disabled_detail=f"mutations are disabled: no API token is configured "
                          f"(set ${settings.controller.api_token_env} or ${settings.controller.api_tokens_env})")
    notif = notifier or NullNotifier()
    if registry is None:
        from controller.metrics import make_registry

        registry = make_registry(reconciler, notif)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stop = asyncio.Event()
        task = asyncio.create_task(reconciler.run_forever(stop)) if run_loop else None
        try:
            yield
        finally:
            stop.set()
            if task is not None:
                await task
            await asyncio.to_thread(notif.close)

    app = FastAPI(
        title="pdscope controller",
        version="1",
        description="Routing table for proxies, manual overrides with TTL and reason, drain, decisions, "
        "alerts, SLO status. Mutations need `Authorization: Bearer <token>`.",
        lifespan=lifespan,
    )
    app.add_middleware(RequestGuard, auth=authn, max_body_bytes=settings.controller.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for e in exc.errors():
            loc = [str(p) for p in e.get("loc", ()) if p not in ("body", "query", "path", "header")]
            if e.get("type") == "json_invalid":  # loc is a character position, not a field
                loc = []
            problems.append({"field": ".".join(loc) or "body", "reason": e.get("msg", "invalid"),
                             "loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")})
        return JSONResponse(status_code=422, content=jsonable_encoder({"detail": problems}))

    @app.exception_handler(StoreError)
    async def _store_down(request: Request, exc: StoreError) -> JSONResponse:
        log.warning("store error on %s %s: %s", request.method, request.url.path, exc)
        return JSONResponse(status_code=503, content={"detail": f"store unavailable: {exc}"},
                            headers={"Retry-After": "2"})

    def caller(request: Request) -> str:
        """The audit actor of a mutation: the guard authenticated it before the body was read."""
        identity = request.scope.get("state", {}).get("identity")
        if not isinstance(identity, str):  # the guard runs first; this only guards against misuse
            raise HTTPException(401, detail="not authenticated", headers={"WWW-Authenticate": "Bearer"})
        return audit_actor(identity, request.scope["state"].get("x_actor"))

    def _documents_x_actor(x_actor: XActor = None) -> None:
        """Lists X-Actor in the OpenAPI document; the guard reads and sanitises the raw header."""

    auth = [Depends(_documents_x_actor)]

    locks = {(kind, name): threading.Lock() for kind, names in
             (("instance", [i.name for i in reconciler.instances]), ("pool", [p.name for p in reconciler.pools]))
             for name in names}

    @contextmanager
    def serialised(kind: str, subject: str) -> Iterator[tuple[Session, float]]:
        """One mutation of one subject at a time, in one transaction, with ``now`` read inside it."""
        with locks[(kind, subject)], transaction(reconciler.factory) as session:
            lock_subject(session, kind, subject)
            yield session, reconciler.clock()

    # -- helpers ------------------------------------------------------------------------

    specs = {s.name: s for s in reconciler.instances}
    pools = {p.name: p for p in reconciler.pools}

    def instance_or_404(name: str) -> None:
        if name not in specs:
            raise HTTPException(404, detail=f"instance {name!r} is not in the config")

    def decision_of(view: View, name: str) -> dict[str, Any] | None:
        if view.last is None:
            return None
        for d in view.last.weights:
            if d.instance == name:
                return {"reason": d.reason, "message": d.message, "arithmetic": d.arithmetic,
                        "scores": dict(d.scores), "inputs": dict(d.inputs), "target": d.target,
                        "smoothed": d.smoothed, "tick": view.last.tick}
        return None

    def instance_out(view: View, name: str, acts: dict[Any, Override] | None = None,
                     served: ServedInstance | None = None) -> InstanceWeightOut:
        spec = specs[name]
        s = served or view.served.get(name) or serve_instance(name, 1.0, "NoDecisionYet", None, None)
        drain = weight = None
        if acts is not None:
            drain = acts.get(("instance", name, "drain"))
            weight = acts.get(("instance", name, "weight"))
        elif s.override is not None:
            drain = s.override if s.source == "drain" else None
            weight = s.override if s.source == "override" else None
        return InstanceWeightOut(name=name, pool=spec.pool, role=spec.role, weight=s.weight,
                                 policy_weight=s.policy_weight, drained=s.drained, source=s.source, reason=s.reason,
                                 override=_override_out(weight), drain=_override_out(drain),
                                 decision=decision_of(view, name))

    def state_dict(s: ServedInstance) -> dict[str, Any]:
        return {"weight": s.weight, "drained": s.drained, "source": s.source, "policy_weight": s.policy_weight,
                "override_id": None if s.override is None else s.override.id}

    def audit(session: Session, *, now: float, actor: str, action: str, subject: str, before: dict[str, Any],
              after: dict[str, Any], reason: str, override_id: int | None) -> tuple[int, str]:
        """Add the audit row; returns its id and the log line to write once the transaction commits."""
        ev = AuditEvent(ts=now, actor=actor, action=action, subject=subject, before=before, after=after,
                        reason=reason, override_id=override_id)
        session.add(ev)
        session.flush()
        return ev.id, json.dumps({"event": action, "audit_id": ev.id, "override_id": override_id,
                                  "subject": subject, "actor": actor, "reason": reason, "before": before,
                                  "after": after}, sort_keys=True)

    def clear(session: Session, kind: str, subject: str, drained: bool, now: float) -> int:
        rows = session.scalars(select(WeightOverride).where(
            WeightOverride.subject_kind == kind, WeightOverride.subject == subject,
            WeightOverride.drained.is_(drained), WeightOverride.cleared.is_(None),
            WeightOverride.expires.is_(None) | (WeightOverride.expires > now)))
        n = 0
        for r in rows:
            r.cleared = now
            n += 1
        return n

    def mutate_instance(name: str, actor: str, action: str, reason: str,
                        new: Callable[[float], WeightOverride] | None,
                        slot: Literal["drain", "weight"]) -> InstanceWeightOut:
        """Clear the matching slot (drain or weight), add ``new(now)``, audit, commit, log, then serve."""
        instance_or_404(name)
        policy_weight, policy_reason = reconciler.policy_of(name)
        with serialised("instance", name) as (session, now):
            acts = active_overrides(load_overrides(session, now), now)
            before = serve_instance(name, policy_weight, policy_reason, acts.get(("instance", name, "drain")),
                                    acts.get(("instance", name, "weight")))
            cleared = clear(session, "instance", name, slot == "drain", now)
            if new is None and cleared == 0:
                what = "drain" if slot == "drain" else "weight override"
                raise HTTPException(409, detail=f"instance {name!r} has no active {what}")
            row = None if new is None else new(now)
            if row is not None:
                session.add(row)
            session.flush()
            acts = active_overrides(load_overrides(session, now), now)
            after = serve_instance(name, policy_weight, policy_reason, acts.get(("instance", name, "drain")),
                                   acts.get(("instance", name, "weight")))
            audit_id, line = audit(session, now=now, actor=actor, action=action, subject=name,
                                   before=state_dict(before), after=state_dict(after), reason=reason,
                                   override_id=None if row is None else row.id)
        audit_log.info(line)  # committed
        refresh()
        out = instance_out(reconciler.view(), name, acts, after)
        out.audit_id = audit_id
        return out

    def mutate_pool(pool: str, actor: str, action: str, reason: str,
                    new: Callable[[float], WeightOverride] | None) -> PoolOut:
        if pool not in pools:
            raise HTTPException(404, detail=f"pool {pool!r} is not in the config")
        spec = pools[pool]
        with serialised("pool", pool) as (session, now):
            acts = active_overrides(load_overrides(session, now), now)
            old = acts.get(("pool", pool, "weight"))
            before = {"weight": spec.weight if old is None else old.weight,
                      "override_id": None if old is None else old.id}
            cleared = clear(session, "pool", pool, False, now)
            if new is None and cleared == 0:
                raise HTTPException(409, detail=f"pool {pool!r} has no active weight override")
            row = None if new is None else new(now)
            if row is not None:
                session.add(row)
            session.flush()
            after = {"weight": spec.weight if row is None else row.weight,
                     "override_id": None if row is None else row.id}
            audit_id, line = audit(session, now=now, actor=actor, action=action, subject=pool, before=before,
                                   after=after, reason=reason, override_id=None if row is None else row.id)
            ov = None if row is None else to_override(row)
        audit_log.info(line)  # committed
        refresh()
        out = next(p for p in get_pools() if p.name == pool)
        out.override = _override_out(ov)
        out.audit_id = audit_id
        return out

    def refresh() -> None:
        try:
            reconciler.refresh()
        except StoreError as exc:  # committed; the next tick serves it
            log.warning("refresh after a mutation failed: %s", exc)

    # -- reads --------------------------------------------------------------------------

    @app.get("/v1/routing", response_model=RoutingTable, tags=["routing"],
             summary="The routing table proxies apply (ETag = version; If-None-Match -> 304)")
    def get_routing(request: Request, response: Response) -> Any:
        table = reconciler.table
        etag = routing_etag(reconciler.epoch, table.version)
        inm = request.headers.get("if-none-match")
        if inm is not None:
            tags = {t.strip().removeprefix("W/") for t in inm.split(",")}
            if etag in tags or "*" in tags:
                return Response(status_code=304, headers={"ETag": etag, "Cache-Control": "no-cache"})
        response.headers["ETag"] = etag
        response.headers["Cache-Control"] = "no-cache"
        return table

    @app.get("/v1/pools", response_model=list[PoolOut], tags=["routing"])
    def get_pools() -> list[PoolOut]:
        view = reconciler.view()
        now = reconciler.clock()
        with transaction(reconciler.factory) as session:
            acts = active_overrides(load_overrides(session, now), now)
        out: list[PoolOut] = []
        decisions = {d.pool: d for d in view.last.pools} if view.last else {}
        for p in view.table.pools:
            spec = pools[p.name]
            d = decisions.get(p.name)
            ov = acts.get(("pool", p.name, "weight"))
            out.append(PoolOut(
                name=p.name, role=p.role, configured_weight=spec.weight, weight=p.weight, reason=p.reason,
                max_inflight_requests=p.max_inflight_requests, max_inflight_kv_bytes=p.max_inflight_kv_bytes,
                max_queue_wait_s=p.max_queue_wait_s, override=_override_out(ov),
                decision=None if d is None else {"reason": d.reason, "message": d.message, "arithmetic": d.arithmetic,
                                                 "scores": dict(d.scores), "inputs": dict(d.inputs)},
                instances=[instance_out(view, r.name) for r in view.table.instances if r.pool == p.name],
            ))
        return out

    @app.get("/v1/instances/{name}/weight", response_model=InstanceWeightOut, tags=["instances"])
    def get_weight(name: str) -> InstanceWeightOut:
        instance_or_404(name)
        return instance_out(reconciler.view(), name)

    @app.get("/v1/decisions", response_model=list[DecisionOut], tags=["history"])
    def get_decisions(
        subject: str | None = None,
        field: str | None = None,
        since: Annotated[float | None, Query(description="Unix seconds")] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> list[DecisionOut]:
        stmt = select(Decision).order_by(Decision.id.desc()).limit(limit)
        if subject is not None:
            stmt = stmt.where(Decision.subject == subject)
        if field is not None:
            stmt = stmt.where(Decision.field == field)
        if since is not None:
            stmt = stmt.where(Decision.ts >= since)
        with transaction(reconciler.factory) as session:
            return [DecisionOut.model_validate(d, from_attributes=True) for d in session.scalars(stmt)]

    @app.get("/v1/alerts", response_model=list[AlertOut], tags=["alerts"])
    def get_alerts(
        state: Literal["active", "pending", "firing", "resolved", "all"] = "active",
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> list[AlertOut]:
        stmt = select(Alert).order_by(Alert.last_eval.desc(), Alert.id.desc()).limit(limit)
        if state == "active":
            stmt = stmt.where(Alert.state.in_(("pending", "firing")))
        elif state != "all":
            stmt = stmt.where(Alert.state == state)
        with transaction(reconciler.factory) as session:
            return [AlertOut.model_validate(a, from_attributes=True) for a in session.scalars(stmt)]

    @app.get("/v1/alerts/rules", response_model=list[AlertRuleOut], tags=["alerts"])
    def get_alert_rules() -> list[AlertRuleOut]:
        return [AlertRuleOut(name=r.name, severity=r.severity, for_s=r.for_s, enabled=r.enabled, summary=r.summary)
                for r in reconciler.rules]

    @app.get("/v1/slo", response_model=SLOOut, tags=["alerts"])
    def get_slo() -> SLOOut:
        view = reconciler.view()
        cfg = reconciler.cfg
        obs = view.obs
        slo = obs.slo if obs is not None else None
        ttft = slo.ttft_p_s if slo else None
        tpot = slo.tpot_p_s if slo else None
        att = slo.attainment if slo else None
        enough = slo is not None and slo.completed >= reconciler.alert_config.min_requests
        ok = None
        if enough and slo is not None and ttft is not None and att is not None:
            ok = ttft <= cfg.ttft_target_s and (tpot is None or tpot <= cfg.tpot_target_s) and (
                att >= cfg.goodput_attainment)
        return SLOOut(
            window_s=settings.slo.window_s, ttft_target_ms=cfg.ttft_target_s * 1000,
            ttft_percentile=cfg.ttft_percentile, ttft_observed_ms=None if ttft is None else ttft * 1000,
            tpot_target_ms=cfg.tpot_target_s * 1000, tpot_percentile=cfg.tpot_percentile,
            tpot_observed_ms=None if tpot is None else tpot * 1000, goodput_attainment_target=cfg.goodput_attainment,
            attainment=att, goodput_rps=slo.goodput_rps if slo else 0.0, completed=slo.completed if slo else 0,
            met=slo.met if slo else 0, rejected=slo.rejected if slo else 0,
            handoff_p99_ms=None if slo is None or slo.handoff_p99_s is None else slo.handoff_p99_s * 1000,
            handoff_budget_ms=cfg.handoff_budget_s * 1000, ok=ok,
            evaluated_at=None if obs is None else obs.now,
        )

    @app.get("/healthz", response_model=HealthOut, tags=["ops"])
    def healthz(response: Response) -> HealthOut:
        view = reconciler.view()
        now = reconciler.clock()
        age = None if view.last_ok is None else max(0.0, now - view.last_ok)
        limit = max(10.0, 5 * settings.controller.interval_s)
        status: Literal["ok", "starting", "degraded"]
        if view.last_ok is None:
            status = "starting" if view.failed_ticks == 0 else "degraded"
        else:
            status = "ok" if age is not None and age <= limit else "degraded"
        if status == "degraded":
            response.status_code = 503
        return HealthOut(status=status, mode=reconciler.mode, ticks=view.ticks, failed_ticks=view.failed_ticks,
                         last_success=view.last_ok, last_success_age_s=age, last_error=view.last_error,
                         routing_version=view.table.version, routing_epoch=reconciler.epoch)

    @app.get("/v1/whoami", response_model=WhoAmIOut, tags=["ops"],
             summary="The identity of the bearer token sent (401 without a valid one)")
    def whoami(authorization: Annotated[str | None, Header()] = None) -> WhoAmIOut:
        try:
            return WhoAmIOut(identity=authn.identify(authorization, missing_status=401))
        except AuthError as exc:
            raise HTTPException(exc.status, detail=exc.detail, headers={"WWW-Authenticate": "Bearer"}) from None

    @app.get("/metrics", tags=["ops"], response_class=Response)
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    # -- mutations (the guard has authenticated them) ----------------------------------------

    @app.put("/v1/instances/{name}/weight", dependencies=auth, response_model=InstanceWeightOut, tags=["instances"],
             summary="Override an instance's weight until ttl_s passes")
    def put_weight(name: str, body: WeightIn, actor: str = Depends(caller)) -> InstanceWeightOut:
        def row(now: float) -> WeightOverride:
            return WeightOverride(subject_kind="instance", subject=name, weight=body.weight, drained=False,
                                  reason=body.reason, actor=actor, created=now, expires=now + body.ttl_s)
        return mutate_instance(name, actor, "weight.set", body.reason, row, slot="weight")

    @app.delete("/v1/instances/{name}/weight", dependencies=auth, response_model=InstanceWeightOut, tags=["instances"],
                summary="End an instance's weight override now")
    def delete_weight(name: str, body: ClearIn, actor: str = Depends(caller)) -> InstanceWeightOut:
        return mutate_instance(name, actor, "weight.clear", body.reason, None, slot="weight")

    @app.post("/v1/instances/{name}/drain", dependencies=auth, response_model=InstanceWeightOut, tags=["instances"],
              summary="Send no new work to an instance (weight 0) until undrained or ttl_s passes")
    def drain(name: str, body: DrainIn, actor: str = Depends(caller)) -> InstanceWeightOut:
        def row(now: float) -> WeightOverride:
            return WeightOverride(subject_kind="instance", subject=name, weight=0.0, drained=True, reason=body.reason,
                                  actor=actor, created=now, expires=None if body.ttl_s is None else now + body.ttl_s)
        return mutate_instance(name, actor, "drain", body.reason, row, slot="drain")

    @app.post("/v1/instances/{name}/undrain", dependencies=auth, response_model=InstanceWeightOut, tags=["instances"])
    def undrain(name: str, body: UndrainIn, actor: str = Depends(caller)) -> InstanceWeightOut:
        return mutate_instance(name, actor, "undrain", body.reason, None, slot="drain")

    @app.put("/v1/pools/{pool}/weight", dependencies=auth, response_model=PoolOut, tags=["routing"],
             summary="Override a pool's weight (relative to pools of the same role) until ttl_s passes")
    def put_pool_weight(pool: str, body: WeightIn, actor: str = Depends(caller)) -> PoolOut:
        def row(now: float) -> WeightOverride:
            return WeightOverride(subject_kind="pool", subject=pool, weight=body.weight, drained=False,
                                  reason=body.reason, actor=actor, created=now, expires=now + body.ttl_s)
        return mutate_pool(pool, actor, "pool_weight.set", body.reason, row)

    @app.delete("/v1/pools/{pool}/weight", dependencies=auth, response_model=PoolOut, tags=["routing"],
                summary="End a pool's weight override now (the configured weight applies again)")
    def delete_pool_weight(pool: str, body: ClearIn, actor: str = Depends(caller)) -> PoolOut:
        return mutate_pool(pool, actor, "pool_weight.clear", body.reason, None)

    return app
