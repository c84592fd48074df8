"""A routing report speaks only for its own proxy: forged, squatted and borrowed reports.

The real proxy's part and its table updates must survive what anyone who reaches
``GET /v1/routing`` can send: inflated in-flight figures, made-up ids, another process under its
id, another proxy's credential. Runs on SQLite and PostgreSQL (the ``store_url`` fixture).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from controller.api import create_app
from pdscope.routing import ProxyReport, proxy_token
from proxy.routing import RoutingState, poll_once
from tests.controller.conftest import World

LIMIT = 256  # the settings' proxy.admission.max_inflight_requests (no pool limit in the table)
HUGE = 10**9
SECRET = "fleet-secret-0123456789"


def report(
    pid: str, *, boot: str = "b0", started: float = 1.0, inflight: int = 0, demand: int = 0
) -> ProxyReport:
    return ProxyReport(pid, boot, started, 1, {"prefill": demand, "decode": demand}, {"prefill": inflight})


def poll(c: TestClient, r: ProxyReport, token: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return c.get("/v1/routing", params=r.params(), headers=headers)


def part(body: dict[str, Any], pool: str = "prefill") -> int:
    n: int = body["proxy"]["pools"][pool]["max_inflight_requests"]
    return n


@pytest.fixture
def open_app(world: World) -> Iterator[FastAPI]:
    """No proxy credentials: the default, and what an adversary on the network meets."""
    world.step()
    yield create_app(world.reconciler, token="t", notifier=world.notifier)


def test_forged_reports_and_40_made_up_ids_leave_the_real_proxys_part_intact(
    open_app: FastAPI, world: World
) -> None:
    with TestClient(open_app) as c:
        real = report("real:8000")
        assert part(poll(c, real).json()) == LIMIT
        for second in range(20):  # one forged round a second, beside the real proxy's polls
            world.clock.advance(1.0)
            for i in range(40):
                forged = poll(c, report(f"made-up-{i}:1", boot="f0", inflight=HUGE, demand=HUGE * second))
                assert forged.status_code == 200 and forged.json()["proxy"] is None
                assert "no seat" in forged.json()["proxy_withheld"]
            got = poll(c, real).json()
            assert got["proxy"]["live"] == 1 and part(got) == LIMIT, second
        assert [p["id"] for p in c.get("/v1/proxies").json()] == ["real:8000"]
        assert 'outcome="over_limit"} 800.0' in c.get("/metrics").text


def test_a_credentialed_proxy_cannot_claim_more_in_flight_than_its_part(world: World) -> None:
    world.step()
    app = create_app(
        world.reconciler, token="t", notifier=world.notifier, proxy_tokens={"ta": "a", "tb": "b"}
    )
    with TestClient(app) as c:
        poll(c, report("a:1"), "ta")
        poll(c, report("b:1"), "tb")
        for _ in range(10):
            world.clock.advance(1.0)
            b = poll(c, report("b:1", inflight=HUGE), "tb").json()  # b lies about what it holds
            a = poll(c, report("a:1"), "ta").json()
            assert part(a) >= LIMIT // 2 - 16, part(a)  # b's claim is clipped near its own part
        assert part(a) + part(b) <= LIMIT
        listing = {p["id"]: p for p in c.get("/v1/proxies").json()}
        assert listing["b:1"]["inflight"]["prefill"] <= part(b) + max(2, part(b) // 10) + LIMIT // 2
        assert 'pdscope_controller_proxy_claims_clipped_total{kind="inflight"} 10.0' in c.get("/metrics").text


async def _proxy_polls(
    state: RoutingState, app: FastAPI, rounds: int, squat: ProxyReport, world: World
) -> None:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://ctl") as client:
        url = "http://ctl/v1/routing"
        for _ in range(rounds):
            world.clock.advance(1.0)
            assert await poll_once(state, client, url, world.clock, state.report({}, {"prefill": 3}))
            squatted = await client.get(url, params=squat.params())  # same id, a newer boot
            assert squatted.status_code == 200 and squatted.json()["proxy"] is None
            assert "held by another live process" in squatted.json()["proxy_withheld"]


def test_a_squatted_id_leaves_the_real_proxys_table_updates_and_part_intact(
    open_app: FastAPI, world: World, caplog: pytest.LogCaptureFixture
) -> None:
    state = RoutingState(world.settings, world.clock())
    squat = ProxyReport(
        state.proxy_id, "ffff", state.started_unix + 100, 1, {"prefill": HUGE}, {"prefill": HUGE}
    )
    caplog.set_level(logging.INFO)
    asyncio.run(_proxy_polls(state, open_app, 3, squat, world))
    assert state.state == "fresh" and state.share is not None and state.share.pools["prefill"].share == 1.0
    with TestClient(open_app) as c:  # a drain made after the squat began
        r = c.post(
            "/v1/instances/decode-1/drain", json={"reason": "x"}, headers={"Authorization": "Bearer t"}
        )
        assert r.status_code == 200, r.text
    world.step()
    asyncio.run(_proxy_polls(state, open_app, 5, squat, world))
    assert "decode-1" not in {t.name for t in state.view.decode}  # the real proxy sees the drain
    assert state.state == "fresh" and state.view.limits["prefill"].max_inflight_requests == LIMIT
    assert state.share_refusal is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    squat_lines = [r for r in caplog.records if "polled by two processes" in r.getMessage()]
    assert len(squat_lines) == 1  # once per episode, not on every poll
    row = TestClient(open_app).get("/v1/proxies").json()[0]
    assert row["duplicates"] == 8 and row["inflight"] == {"prefill": 3}


def test_a_token_used_for_another_id_is_refused_and_does_not_count(world: World) -> None:
    world.step()
    app = create_app(
        world.reconciler, token="t", notifier=world.notifier, proxy_tokens={"ta": "a", "tb": "b"}
    )
    with TestClient(app) as c:
        assert part(poll(c, report("a:8000"), "ta").json()) == LIMIT
        borrowed = poll(c, report("b:8000", inflight=HUGE), "ta")
        assert (
            borrowed.status_code == 403
            and "does not speak for proxy id 'b:8000'" in borrowed.json()["detail"]
        )
        assert poll(c, report("a:8000/w1"), "ta").status_code == 200  # a's workers are a's
        assert {p["id"] for p in c.get("/v1/proxies").json()} == {"a:8000", "a:8000/w1"}
        assert 'outcome="wrong_id"} 1.0' in c.get("/metrics").text


def test_with_the_fleet_secret_a_token_speaks_for_its_own_id_only(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    world.step()
    monkeypatch.setenv(world.settings.controller.proxy_secret_env, SECRET)
    app = create_app(world.reconciler, token="t", notifier=world.notifier)
    with TestClient(app) as c:
        mine = proxy_token(SECRET, "pdscope-proxy-7d9f-x2k4:8000")
        assert part(poll(c, report("pdscope-proxy-7d9f-x2k4:8000"), mine).json()) == LIMIT
        other = poll(c, report("pdscope-proxy-7d9f-q8z1:8000", inflight=HUGE), mine)
        assert other.status_code == 403
        assert poll(c, report("pdscope-proxy-7d9f-q8z1:8000")).status_code == 401  # no token at all
        assert [p["id"] for p in c.get("/v1/proxies").json()] == ["pdscope-proxy-7d9f-x2k4:8000"]
        assert c.get("/v1/routing").status_code == 200  # a poll without a report stays open


def test_a_short_proxy_secret_is_a_config_error_naming_the_variable(world: World) -> None:
    from pdscope.config import ConfigError

    with pytest.raises(ConfigError, match="PDSCOPE_PROXY_SECRET"):
        world.settings.proxy_secret({"PDSCOPE_PROXY_SECRET": "short"})


def test_an_address_guessing_report_tokens_is_throttled_and_still_gets_its_table(world: World) -> None:
    """Wrong report credentials count against the address like wrong API tokens; past the limit its
    reports are not read (no part, ``proxy_withheld: throttled``) but the table is still served."""
    world.step()
    app = create_app(world.reconciler, token="t", notifier=world.notifier, proxy_tokens={"ta": "a"})
    limit = world.settings.controller.auth_throttle.max_failures
    with TestClient(app) as c:
        for i in range(limit + 1):
            assert poll(c, report("a:8000", inflight=HUGE), f"guess-{i}").status_code == 401
        right = poll(c, report("a:8000"), "ta")
        assert right.status_code == 200 and right.json()["proxy"] is None
        assert right.json()["proxy_withheld"] == "throttled" and right.json()["instances"]
        assert c.get("/v1/proxies").json() == []
        text = c.get("/metrics").text
        assert f'pdscope_controller_auth_failures_total{{reason="invalid"}} {float(limit + 1)}' in text
