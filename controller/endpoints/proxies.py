"""The proxies in front of the fleet: who polls, what each holds and the part of the limits it has."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter

from controller.endpoints.context import ApiContext
from controller.schemas import ProxyOut


def router(ctx: ApiContext) -> APIRouter:
    r = APIRouter()

    @r.get(
        "/v1/proxies",
        response_model=list[ProxyOut],
        tags=["routing"],
        summary="Every proxy heard from in the last hour (live first): its share, last poll, "
        "in-flight and the table version it applies",
    )
    def get_proxies() -> list[ProxyOut]:
        return [ProxyOut.model_validate(asdict(v)) for v in ctx.proxies.listing()]

    return r
