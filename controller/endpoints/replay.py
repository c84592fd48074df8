"""The policy replayed over a stored window, ``GET /v1/replay`` (see :mod:`controller.replay`), and the
shadow policy beside the live one, ``GET /v1/shadow`` (see :mod:`controller.shadow`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from controller.attribution import BadRange, resolve_range
from controller.endpoints.context import ApiContext, From, Since, Until, bad_param
from controller.replay import Candidate, NoTicks, ReplayError, as_dict, parse_changes, replay_window
from store.db import transaction

MAX_API_TICKS = 5_000  # a request answers within seconds; the CLI reads more


def router(ctx: ApiContext) -> APIRouter:
    r = APIRouter()
    reconciler = ctx.reconciler

    @r.get(
        "/v1/replay",
        tags=["decisions"],
        summary="The policy re-run over the recorded ticks of a range, under the stored config (it must "
        "reproduce every stored decision: `reproduced`) or with `set` changes (where the decisions part "
        "from the run's). 400 names a bad parameter; 404: no tick recorded in the range; 422: the window "
        "cannot be replayed (another policy version, ticks without records, a config change)",
    )
    def get_replay(
        since: Since = None,
        from_: From = None,
        until: Until = None,
        set_: Annotated[
            list[str] | None,
            Query(
                alias="set", max_length=32, description="a policy setting to change: name=value (repeatable)"
            ),
        ] = None,
        timeline: Annotated[
            bool, Query(description="each instance's served weights, run and replay")
        ] = False,
    ) -> Any:
        try:
            lo, hi = resolve_range(reconciler.clock(), since=since, from_=from_, until=until)
        except BadRange as exc:
            return bad_param(exc.param, exc.reason)
        try:
            changes = parse_changes([s[:200] for s in set_ or []])
        except ReplayError as exc:
            return bad_param("set", str(exc))
        candidate = Candidate(changes=changes) if changes else None
        try:
            with transaction(reconciler.factory) as session:
                result = replay_window(session, lo, hi, candidate, max_ticks=MAX_API_TICKS)
        except NoTicks as exc:
            return bad_param("since", str(exc), 404)
        except ReplayError as exc:
            return bad_param("window", str(exc), 422)
        return as_dict(result, timeline=timeline)

    @r.get(
        "/v1/shadow",
        tags=["decisions"],
        summary="The shadow policy (controller.shadow: changed policy settings deciding every tick "
        "beside the live policy, never served): where it parts from the live decisions since the "
        "controller started",
    )
    def get_shadow() -> Any:
        status = reconciler.shadow_status()
        return {"enabled": False} if status is None else status

    return r
