"""Why the window's requests missed their SLO: ``GET /v1/slo/attribution``
(see :mod:`controller.attribution`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from controller.attribution import DEFAULT_RECORDS, MAX_RECORDS, BadRange, resolve_range, window_attribution
from controller.endpoints.context import ApiContext


def router(ctx: ApiContext) -> APIRouter:
    r = APIRouter()
    reconciler = ctx.reconciler

    @r.get(
        "/v1/slo/attribution",
        tags=["alerts"],
        summary="The SLO misses of a range split over stages against the healthy requests' medians, "
        "grouped by stage, instance or P×D pair and cause: the top three reasons we missed, with their "
        "share and since when. 400 names a bad range parameter",
    )
    def get_attribution(
        since: Annotated[
            str | None, Query(max_length=32, description="a duration back from now: 30m, 2h, 90s")
        ] = None,
        from_: Annotated[
            float | None, Query(alias="from", description="Unix seconds (instead of since)")
        ] = None,
        until: Annotated[float | None, Query(description="Unix seconds (default: now)")] = None,
        misses: Annotated[int, Query(ge=0, le=1000, description="misses listed, most excess first")] = 100,
        limit: Annotated[
            int, Query(ge=1, le=MAX_RECORDS, description="records read at most (the newest)")
        ] = DEFAULT_RECORDS,
    ) -> Any:
        try:
            lo, hi = resolve_range(reconciler.clock(), since=since, from_=from_, until=until)
        except BadRange as exc:
            return JSONResponse(
                status_code=400, content={"detail": [{"field": exc.param, "reason": exc.reason}]}
            )
        result = window_attribution(reconciler.factory, reconciler.settings, lo, hi, limit=limit)
        return result.as_dict(max_misses=misses)

    return r
