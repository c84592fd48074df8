"""A proxy among several: it reports itself on every poll and enforces its part of the pools' limits.

The part comes back in ``RoutingTable.proxy``; a table without one keeps the last part for
``fail_static_s``; with no part at all the proxy admits the limits divided by
``proxy.expected_replicas``, never the whole limit. The poller fails over between
``proxy.controller_urls``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from controller.api import create_app
from controller.loop import Reconciler
from controller.wiring import default_effects
from pdscope.routing import PoolShare, ProxyShare, RoutingTable
from proxy.routing import RoutingState, poll_forever
from store.db import make_engine, session_factory
from store.migrate import upgrade
from tests.proxy.conftest import fake_fleet, make_settings, running_proxy
from tests.support.controllers import FakeController, table
from tests.support.serving import serve, serve_in_thread
from tests.support.sockets import closed_port_url
from tests.support.waiting import async_wait_until

COMPLETION = {"model": "fake", "prompt": "a b c", "max_tokens": 4}
ROWS = [
    ("p0", "prefill", "prefill", "http://p0", 1.0, False),
    ("d0", "decode", "decode", "http://d0", 1.0, False),
]


def _table(share: ProxyShare | None = None, pools: list[dict[str, object]] | None = None) -> RoutingTable:
    t = RoutingTable.model_validate(table(ROWS, pools=pools or []))
    return t.model_copy(update={"proxy": share})


def _share(pid: str, req: int, kv: int = 1000, live: int = 3) -> ProxyShare:
    part = PoolShare(share=req / 90, max_inflight_requests=req, max_inflight_kv_bytes=kv)
    return ProxyShare(id=pid, live=live, pools={"prefill": part, "decode": part})


def _state(**proxy: object) -> RoutingState:
    settings = make_settings(
        ["http://p0"],
        ["http://d0"],
        proxy={"id": "me:1", "admission": {"max_inflight_requests": 90}, **proxy},
    )
    return RoutingState(settings, now=0.0)


def test_with_a_part_the_proxy_enforces_it() -> None:
    state = _state(fail_static_s=10)
    state.on_table(_table(_share("me:1", 30)), '"1"', now=1.0)
    assert state.view.limits["prefill"].max_inflight_requests == 30
    assert state.view.limits["decode"].max_inflight_kv_bytes == 1000


def test_a_part_for_another_id_is_not_taken() -> None:
    state = _state(expected_replicas=3)
    state.on_table(_table(_share("someone-else:1", 80)), '"1"', now=1.0)
    assert state.view.limits["prefill"].max_inflight_requests == 30  # 90 / expected_replicas


def test_a_table_without_a_part_keeps_the_last_for_fail_static_s_then_divides() -> None:
    state = _state(fail_static_s=10, expected_replicas=3)
    pools = [{"name": "prefill", "role": "prefill", "max_inflight_requests": 60}]
    state.on_table(_table(_share("me:1", 25), pools), '"1"', now=1.0)
    state.on_table(_table(None, pools), '"2"', now=5.0)  # the controller could not work a part out
    assert state.view.limits["prefill"].max_inflight_requests == 25
    state.tick(now=10.9)
    assert state.view.limits["prefill"].max_inflight_requests == 25
    state.tick(now=11.1)  # the part is older than fail_static_s: the table's limit / expected_replicas
    assert state.state == "fresh"
    assert state.view.limits["prefill"].max_inflight_requests == 20
    assert state.view.limits["decode"].max_inflight_requests == 30  # no pool limit: the config's / 3


def test_unreachable_keeps_the_part_then_falls_back_to_the_divided_config_never_the_whole() -> None:
    state = _state(fail_static_s=10, expected_replicas=3)
    assert state.view.limits["prefill"].max_inflight_requests == 30  # never reached: 90 / 3
    state.on_table(_table(_share("me:1", 40)), '"1"', now=1.0)
    state.on_failure(now=2.0)
    assert state.state == "static" and state.view.limits["prefill"].max_inflight_requests == 40
    state.tick(now=11.5)
    assert state.state == "fallback" and state.view.limits["prefill"].max_inflight_requests == 30


def test_a_refused_report_is_logged_once_and_drops_the_part(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = _state()
    state.on_table(_table(_share("me:1", 40)), '"1"', now=1.0)
    for t in (2.0, 3.0):
        state.on_refused(f"proxy id 'me:1' is in use by another process ({t} s)", now=t)
    # the poller then fetches the table without the report (tests/proxy/test_routing_refusals.py)
    assert state.share is None and state.poll_failures == 0
    assert [r.levelname for r in caplog.records if "in use" in r.getMessage()] == ["ERROR"]


async def test_the_poller_reports_itself_and_fails_over_to_the_next_controller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PDSCOPE_PROXY_TOKEN", "tok-1")
    ctl = FakeController(table(ROWS))
    async with serve(ctl.app()) as url:
        state = _state(controller_urls=[closed_port_url(), url])
        task = asyncio.create_task(
            poll_forever(
                state,
                state.settings.controller_urls,
                0.05,
                report=lambda: state.report({"prefill": 7, "decode": 7}, {"decode": 2}),
            )
        )
        try:
            await async_wait_until("a table from the second controller", lambda: state.state == "fresh")
            await async_wait_until("two polls", lambda: len(ctl.requests) >= 2)
        finally:
            task.cancel()
    q = parse_qs(urlsplit(ctl.requests[-1].path).query)
    assert q["proxy"] == ["me:1"] and q["boot"] == [state.boot]
    assert q["demand"] == ["decode:7,prefill:7"] and q["inflight"] == ["decode:2"]
    assert q["applied"] == ["1"]
    assert ctl.requests[-1].headers["authorization"] == "Bearer tok-1"  # proxy.controller_token_env


async def test_two_proxies_against_a_real_controller_split_the_limit_and_count_demand(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade(url)
    engine = make_engine(url)
    async with fake_fleet(1, 1) as fleet:
        base = make_settings([fleet.prefill[0].url], [fleet.decode[0].url], proxy={"expected_replicas": 2})
        factory = session_factory(engine)
        reconciler = Reconciler(base, factory, effects=default_effects(base, factory))
        reconciler.tick()
        with serve_in_thread(create_app(reconciler, token=None)) as ctl_url:

            def settings(pid: str) -> object:
                return make_settings(
                    [fleet.prefill[0].url],
                    [fleet.decode[0].url],
                    proxy={"id": pid, "controller_url": ctl_url, "expected_replicas": 2},
                )

            async with (
                running_proxy(settings("a:1")) as (url_a, a),
                running_proxy(settings("b:1")) as (_, b),
                httpx.AsyncClient(timeout=10) as client,
            ):
                limit = base.proxy.admission.max_inflight_requests

                def parts() -> list[int]:
                    return [app.parts.routing.view.limits["prefill"].max_inflight_requests for app in (a, b)]

                for app in (a, b):
                    await async_wait_until(
                        "a part from the controller",
                        lambda app=app: (s := app.parts.routing.share) is not None and s.live == 2,
                    )
                # a part grows only once the other has shrunk: the limit is shared out within a few polls
                got = await async_wait_until(
                    "the whole limit shared out", parts, done=lambda p: sum(p) == limit
                )
                assert min(got) >= limit // 4
                assert (await client.post(url_a + "/v1/completions", json=COMPLETION)).status_code == 200
                assert a.parts.admission.demand == {"prefill": 1, "decode": 1}
                metrics = (await client.get(url_a + "/metrics")).text
                assert 'pdscope_proxy_pool_limit{kind="requests",pool="prefill"}' in metrics
                assert 'pdscope_proxy_limit_share{pool="prefill"}' in metrics
                health = (await client.get(url_a + "/healthz")).json()
                assert health["proxy_id"] == "a:1" and health["live_proxies"] == 2
                listing = (await client.get(ctl_url + "/v1/proxies")).json()
                assert {p["id"] for p in listing} == {"a:1", "b:1"}
    engine.dispose()
