"""A proxy whose report the controller refuses, or whose part it withholds, keeps applying tables.

The table (weights, drains) always applies; only the part of the limits is dropped, and each
episode is logged once, when it starts.
"""

from __future__ import annotations

import asyncio
import functools
import logging

import httpx
import pytest

from pdscope.routing import PoolShare, ProxyShare, RoutingTable, proxy_token
from proxy.routing import RoutingState, poll_once, report_auth
from tests.proxy.conftest import make_settings
from tests.support.controllers import table

ROWS = [
    ("p0", "prefill", "prefill", "http://p0", 1.0, False),
    ("d0", "decode", "decode", "http://d0", 1.0, False),
    ("d1", "decode", "decode", "http://d1", 1.0, False),
]


def _state() -> RoutingState:
    settings = make_settings(
        ["http://p0"], ["http://d0"], proxy={"id": "me:1", "admission": {"max_inflight_requests": 90}}
    )
    return RoutingState(settings, now=0.0)


def _table(version: int, *, drained: str | None = None, **update: object) -> RoutingTable:
    rows = [(*r[:5], r[0] == drained) for r in ROWS]
    return RoutingTable.model_validate({**table(rows), "version": version}).model_copy(update=update)


def _share(req: int) -> ProxyShare:
    part = PoolShare(share=req / 90, max_inflight_requests=req, max_inflight_kv_bytes=1000)
    return ProxyShare(id="me:1", live=2, pools={"prefill": part, "decode": part})


def test_refusals_log_once_per_episode_and_the_table_still_applies(caplog: pytest.LogCaptureFixture) -> None:
    state = _state()
    state.on_table(_table(1, proxy=_share(40)), '"1"', now=1.0)
    assert state.view.limits["prefill"].max_inflight_requests == 40
    caplog.set_level(logging.INFO, logger="proxy.routing")
    seen: list[bool] = []

    def controller(request: httpx.Request) -> httpx.Response:
        if "proxy" in request.url.params:  # every report refused, with a detail that changes
            seen.append(True)
            return httpx.Response(403, json={"detail": f"not yours (poll {len(seen)})"})
        return httpx.Response(200, content=_table(2, drained="d1").model_dump_json(), headers={"etag": '"2"'})

    async def polls() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(controller)) as client:
            for i in range(5):
                at = functools.partial(float, 2.0 + i)
                assert await poll_once(state, client, "http://ctl/v1/routing", at, state.report({}, {}))

    asyncio.run(polls())
    assert [t.name for t in state.view.decode] == ["d0"]  # the drain applied although refused
    assert state.state == "fresh" and state.share is None
    assert state.view.limits["prefill"].max_inflight_requests == 90  # no part: limit / expected_replicas
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "not yours (poll 1)" in errors[0].getMessage()
    state.on_table(_table(3, proxy=_share(30)), '"3"', now=9.0)  # the part is back: the episode ends
    assert state.share_refusal is None and state.view.limits["prefill"].max_inflight_requests == 30


def test_a_withheld_part_is_dropped_at_once_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    state = _state()
    state.on_table(_table(1, proxy=_share(40)), '"1"', now=1.0)
    caplog.set_level(logging.INFO, logger="proxy.routing")
    for i in range(4):
        state.on_table(_table(2 + i, proxy_withheld=f"held by another process ({i})"), None, now=2.0 + i)
    assert state.share is None and state.view.limits["prefill"].max_inflight_requests == 90
    assert len([r for r in caplog.records if "no part of the limits" in r.getMessage()]) == 1


def test_the_report_token_is_derived_from_the_fleet_secret_and_the_id() -> None:
    state = _state()
    env = {"PDSCOPE_PROXY_SECRET": "fleet-secret-0123456789", "PDSCOPE_PROXY_TOKEN": "ignored"}
    assert report_auth(state, env) == {
        "Authorization": f"Bearer {proxy_token(env['PDSCOPE_PROXY_SECRET'], 'me:1')}"
    }
    assert report_auth(state, {"PDSCOPE_PROXY_TOKEN": "tok"}) == {"Authorization": "Bearer tok"}
    assert report_auth(state, {}) == {}
