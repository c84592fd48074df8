"""Why the window's requests missed their SLO: ``GET /v1/slo/attribution``
(see :mod:`controller.attribution`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from controller.attribution import DEFAULT_RECORDS, MAX_RECORDS, BadRange, resolve_range, window_attribution
from controller.endpoints.context import ApiContext, From, Since, Until, bad_param


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
        since: Since = None,
        from_: From = None,
        until: Until = None,
        misses: Annotated[int, Query(ge=0, le=1000, description="misses listed, most excess first")] = 100,
        limit: Annotated[
            int, Query(ge=1, le=MAX_RECORDS, description="records read at most (the newest)")
        ] = DEFAULT_RECORDS,
    ) -> Any:
        try:
            lo, hi = resolve_range(reconciler.clock(), since=since, from_=from_, until=until)
        except BadRange as exc:
            return bad_param(exc.param, exc.reason)
        result = window_attribution(reconciler.factory, reconciler.settings, lo, hi, limit=limit)
        return result.as_dict(max_misses=misses)

    return r
