"""Reads of what is served: the routing table (with its ETag), pools, one instance's weight."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from controller.endpoints.context import ApiContext
from controller.schemas import InstanceWeightOut, PoolOut
from pdscope.routing import RoutingTable, routing_etag


def router(ctx: ApiContext) -> APIRouter:
    r = APIRouter()
    reconciler = ctx.reconciler

    @r.get(
        "/v1/routing",
        response_model=RoutingTable,
        tags=["routing"],
        summary="The routing table proxies apply (ETag = version; If-None-Match -> 304)",
    )
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

    @r.get("/v1/pools", response_model=list[PoolOut], tags=["routing"])
    def get_pools() -> list[PoolOut]:
        return ctx.views.pools()

    @r.get("/v1/instances/{name}/weight", response_model=InstanceWeightOut, tags=["instances"])
    def get_weight(name: str) -> InstanceWeightOut:
        ctx.overrides.check_instance(name)
        return ctx.views.instance(reconciler.view(), name)

    return r
