"""Reads of what is served: the routing table (with its ETag and the polling proxy's part of the
pools' limits), pools, one instance's weight."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from controller.endpoints.context import ApiContext
from controller.proxies import DuplicateProxy
from controller.schemas import InstanceWeightOut, PoolOut
from pdscope.routing import BadReport, ProxyReport, ProxyShare, RoutingTable, routing_etag
from store.db import StoreError

log = logging.getLogger(__name__)


def router(ctx: ApiContext) -> APIRouter:
    r = APIRouter()
    reconciler = ctx.reconciler

    @r.get(
        "/v1/routing",
        response_model=RoutingTable,
        tags=["routing"],
        summary="The routing table proxies apply (ETag = version and share; If-None-Match -> 304). "
        "A proxy sends its report as query parameters (proxy, boot, started, applied, demand, "
        "inflight) and gets its part of every pool's limits in `proxy`; 400 names a bad parameter, "
        "401: a report without the token controller.proxy_tokens_env requires, "
        "409 refuses a second process under one proxy id",
    )
    def get_routing(request: Request, response: Response) -> Any:
        table = reconciler.table
        try:
            report = ProxyReport.from_params(request.query_params)
        except BadReport as exc:
            ctx.proxies.count("bad_report")
            return JSONResponse(
                status_code=400, content={"detail": [{"field": exc.param, "reason": str(exc)}]}
            )
        share: ProxyShare | None = None
        if report is not None:
            refusal = ctx.proxies.authenticate(request.headers.get("authorization"))
            if refusal is not None:
                return JSONResponse(
                    status_code=401, content={"detail": refusal}, headers={"WWW-Authenticate": "Bearer"}
                )
            try:
                share = ctx.proxies.poll(report, table)
            except DuplicateProxy as exc:
                return JSONResponse(status_code=409, content={"detail": exc.detail})
            except StoreError as exc:  # the table is still right; the proxy keeps its last part
                ctx.proxies.count("store_error")
                log.warning("proxy %s: its share not worked out (store: %s)", report.id, exc)
            else:
                if share is not None:
                    table = table.model_copy(update={"proxy": share})
        etag = routing_etag(reconciler.epoch, table.version, share)
        inm = request.headers.get("if-none-match")
        if inm is not None:
            tags = {t.strip().removeprefix("W/") for t in inm.split(",")}
            if etag in tags or "*" in tags:
                return Response(status_code=304, headers={"ETag": etag, "Cache-Control": "no-cache"})
        response.headers["ETag"] = etag
        response.headers["Cache-Control"] = "no-cache"
        return table

    @r.get("/v1/pools", response_model=list[PoolOut], tags=["routing"])
    def get_pools() -> list[PoolOut]:
        return ctx.views.pools()

    @r.get("/v1/instances/{name}/weight", response_model=InstanceWeightOut, tags=["instances"])
    def get_weight(name: str) -> InstanceWeightOut:
        ctx.overrides.check_instance(name)
        return ctx.views.instance(reconciler.view(), name)

    return r
