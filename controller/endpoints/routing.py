"""Reads of what is served: the routing table (with its ETag and the polling proxy's part of the
pools' limits), pools, one instance's weight."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from controller.endpoints.context import ApiContext
from controller.schemas import InstanceWeightOut, PoolOut
from pdscope.auththrottle import bearer_failure
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
        summary="The routing table proxies apply (ETag = version, share and rates; If-None-Match -> 304). "
        "A proxy sends its report as query parameters (proxy, boot, started, applied, demand, "
        "inflight) and gets its part of every pool's limits in `proxy`, or the table without one and "
        "`proxy_withheld` saying why (another live process holds the id; no seat for a new id); "
        "400 names a bad parameter, 401: a report without the credential the controller requires, "
        "403: a credential that does not speak for the reported id",
    )
    def get_routing(request: Request, response: Response) -> Any:
        table, rates_tag = reconciler.routing()
        try:
            report = ProxyReport.from_params(request.query_params)
        except BadReport as exc:
            ctx.proxies.count("bad_report")
            return JSONResponse(
                status_code=400, content={"detail": [{"field": exc.param, "reason": str(exc)}]}
            )
        share: ProxyShare | None = None
        throttle, source = ctx.authn.throttle, request.client.host if request.client else "?"
        if report is not None and throttle is not None and throttle.blocked(source) is not None:
            # an address that guessed report credentials: its report is not read, its table still served
            throttled = table.model_copy(update={"proxy_withheld": "throttled"})
            return _served(request, response, throttled, rates_tag)
        if report is not None:
            refusal = ctx.proxies.authenticate(request.headers.get("authorization"), report.id)
            if refusal is not None:
                if throttle is not None:
                    throttle.failed(source, bearer_failure(request.headers.get("authorization")))
                headers = {"WWW-Authenticate": "Bearer"} if refusal.status == 401 else None
                return JSONResponse(
                    status_code=refusal.status, content={"detail": refusal.detail}, headers=headers
                )
            try:
                answer = ctx.proxies.poll(report, table)
            except StoreError as exc:  # the table is still right; the proxy keeps its last part
                ctx.proxies.count("store_error")
                log.warning("proxy %s: its share not worked out (store: %s)", report.id, exc)
            else:
                share = answer.share
                table = table.model_copy(update={"proxy": share, "proxy_withheld": answer.withheld})
        return _served(request, response, table, rates_tag)

    def _served(request: Request, response: Response, table: RoutingTable, rates_tag: str) -> Any:
        etag = routing_etag(reconciler.epoch, table.version, table.proxy, rates_tag)
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
