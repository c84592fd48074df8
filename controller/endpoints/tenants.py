"""Each tenant's SLO figures over a range: ``GET /v1/tenants`` (see :mod:`controller.tenants`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from controller.attribution import BadRange, resolve_range
from controller.endpoints.context import ApiContext, From, Since, Until, bad_param
from controller.schemas import TenantsOut
from controller.tenants import read_tenants, tenants_out
from store.db import transaction
from store.tenants import DEFAULT_RECORDS, MAX_RECORDS

Tenant = Annotated[
    str | None,
    Query(max_length=64, description="one declared tenant's figures (the shares stay the fleet's)"),
]


def router(ctx: ApiContext) -> APIRouter:
    r = APIRouter()
    reconciler = ctx.reconciler

    @r.get(
        "/v1/tenants",
        response_model=TenantsOut,
        tags=["alerts"],
        summary="Each declared tenant over a range (default: slo.window_s back from now): requests, served, "
        "rejected by reason, TTFT and TPOT against its own targets, SLO attainment, goodput, admission wait, "
        "its fair share against its share of service, and Jain's index. 400 names a bad parameter",
    )
    def get_tenants(
        tenant: Tenant = None,
        since: Since = None,
        from_: From = None,
        until: Until = None,
        limit: Annotated[
            int, Query(ge=1, le=MAX_RECORDS, description="records read at most (the newest)")
        ] = DEFAULT_RECORDS,
    ) -> Any:
        settings = reconciler.settings
        if tenant is not None and tenant not in settings.tenants.tenants:
            return bad_param("tenant", "not a declared tenant (tenants.tenants)")
        if since is None and from_ is None:
            since = f"{settings.slo.window_s:g}s"
        try:
            lo, hi = resolve_range(reconciler.clock(), since=since, from_=from_, until=until)
        except BadRange as exc:
            return bad_param(exc.param, exc.reason)
        with transaction(reconciler.factory) as session:
            read = read_tenants(session, settings, lo, hi, limit=limit)
        return tenants_out(read, settings, tenant)

    return r
