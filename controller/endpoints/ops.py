"""Operations: health (503 when degraded; leader or standby, and the leader epoch; the bundle writer's
counters), the bearer token's identity, Prometheus metrics."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Header, HTTPException, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from controller.auth import AuthError
from controller.effects import Bundler
from controller.endpoints.context import ApiContext
from controller.guard import client_address
from controller.leader import LeaderInfo, leader_url, mode_warning
from controller.schemas import BundlesHealthOut, HealthOut, LeaderOut, WhoAmIOut


def router(ctx: ApiContext) -> APIRouter:
    r = APIRouter()
    reconciler = ctx.reconciler

    @r.get("/healthz", response_model=HealthOut, tags=["ops"])
    def healthz(response: Response) -> HealthOut:
        view = reconciler.view()
        now = reconciler.clock()
        age = None if view.last_ok is None else max(0.0, now - view.last_ok)
        limit = max(10.0, 5 * reconciler.settings.controller.interval_s)
        status: Literal["ok", "starting", "degraded"]
        if view.last_ok is None:
            status = "starting" if view.failed_ticks == 0 else "degraded"
        else:
            status = "ok" if age is not None and age <= limit else "degraded"
        if status == "degraded":
            response.status_code = 503
        return HealthOut(
            status=status,
            mode=reconciler.mode,
            ticks=view.ticks,
            failed_ticks=view.failed_ticks,
            last_success=view.last_ok,
            last_success_age_s=age,
            last_error=view.last_error,
            routing_version=view.table.version,
            routing_epoch=reconciler.epoch,
            role=view.role,
            leader_epoch=view.epoch,
            leader=_leader(view.leader),
            mode_warning=mode_warning(view.role, reconciler.mode, view.leader),
            bundles=_bundles(reconciler.bundler),
        )

    @r.get(
        "/v1/whoami",
        response_model=WhoAmIOut,
        tags=["ops"],
        summary="The identity of the bearer token sent (401 without a valid one)",
    )
    def whoami(request: Request, authorization: Annotated[str | None, Header()] = None) -> WhoAmIOut:
        source = client_address(request.scope)
        try:
            return WhoAmIOut(identity=ctx.authn.identify(authorization, missing_status=401, source=source))
        except AuthError as exc:
            raise HTTPException(exc.status, detail=exc.detail, headers=exc.headers()) from None

    @r.get("/metrics", tags=["ops"], response_class=Response)
    def metrics() -> Response:
        return Response(generate_latest(ctx.registry), media_type=CONTENT_TYPE_LATEST)

    return r


def _bundles(b: Bundler) -> BundlesHealthOut:
    return BundlesHealthOut(
        enabled=b.folder is not None,
        written=b.written,
        failed=b.failed,
        dropped=b.dropped,
        pending=b.pending,
        last_error=b.last_error,
    )


def _leader(info: LeaderInfo | None) -> LeaderOut | None:
    if info is None or not info.holder:  # the row before any takeover
        return None
    mode = info.mode if info.mode in ("advisory", "enforce") else None
    return LeaderOut(
        holder=info.holder,
        epoch=info.epoch,
        since=info.since,
        url=leader_url(info.holder),
        mode=mode,  # type: ignore[arg-type]  # narrowed to the Literal just above
    )
