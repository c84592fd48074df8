"""What followed the controller's cuts over a range: ``GET /v1/decisions/regret``
(see :mod:`controller.regret`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from controller.attribution import BadRange, resolve_range
from controller.endpoints.context import ApiContext, From, Until, bad_param
from controller.regret import DEFAULT_FLAP_TICKS, window_regret


def router(ctx: ApiContext) -> APIRouter:
    r = APIRouter()
    reconciler = ctx.reconciler

    @r.get(
        "/v1/decisions/regret",
        tags=["history"],
        summary="For every weight or limit cut of a range: did the instance's signals recover and when, "
        "the fleet's SLO attainment before and after, was it undone and after how many ticks; and per "
        "reason: cuts, undone, flapped (undone within flap_ticks), flapping rate, median time to undo, "
        "mean SLO delta. 400 names a bad range parameter",
    )
    def get_regret(
        since: Annotated[
            str | None, Query(max_length=32, description="a duration back from now: 30m, 2h (default 1h)")
        ] = None,
        from_: From = None,
        until: Until = None,
        flap_ticks: Annotated[
            int, Query(ge=1, le=100_000, description="a cut undone within this many ticks flapped")
        ] = DEFAULT_FLAP_TICKS,
        cuts: Annotated[int, Query(ge=0, le=10_000, description="cuts listed at most (the newest)")] = 200,
    ) -> Any:
        now = reconciler.clock()
        try:
            lo, hi = resolve_range(
                now, since="1h" if since is None and from_ is None else since, from_=from_, until=until
            )
        except BadRange as exc:
            return bad_param(exc.param, exc.reason)
        result = window_regret(
            reconciler.factory, reconciler.settings, lo, hi, now=now, flap_ticks=flap_ticks
        )
        return result.as_dict(max_cuts=cuts)

    return r
