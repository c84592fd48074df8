"""The proxy following the controller's table, failing static, and pushing back (429)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from dataclasses import dataclass

import httpx
import pytest

from proxy.admission import Admission
from tests.proxy.conftest import fake_fleet, make_settings, running_proxy
from tests.support.controllers import FakeController, table
from tests.support.serving import serve
from tests.support.waiting import async_wait_until

COMPLETION = {"model": "fake", "prompt": "a b c d e f g h i j", "max_tokens": 4}


def _p_counts(fleet) -> Counter[str]:  # type: ignore[no-untyped-def]
    return Counter({p.name: len(p.calls) for p in fleet.prefill})


async def test_weights_and_drains_from_the_table_are_honoured() -> None:
    async with fake_fleet(3, 2) as fleet:
        p, d = fleet.prefill, fleet.decode
        ctl = FakeController(
            table(
                [
                    ("p0", "prefill", "prefill", p[0].url, 3.0, False),
                    ("p1", "prefill", "prefill", p[1].url, 1.0, False),
                    ("p2", "prefill", "prefill", p[2].url, 5.0, True),  # drained: no new work
                    ("d0", "decode", "decode", d[0].url, 1.0, False),
                    ("d1", "decode", "decode", d[1].url, 0.0, False),  # weight 0: no new work
                ]
            )
        )
        async with serve(ctl.app()) as ctl_url:
            settings = make_settings(
                [x.url for x in p], [x.url for x in d], proxy={"controller_url": ctl_url}
            )
            async with running_proxy(settings) as (url, app), httpx.AsyncClient(timeout=10) as client:
                await async_wait_until("a fresh routing table", lambda: app.parts.routing.state == "fresh")
                for _ in range(200):
                    assert (await client.post(url + "/v1/completions", json=COMPLETION)).status_code == 200
                health = (await client.get(url + "/healthz")).json()
                await async_wait_until("a 304 (polls use the ETag)", lambda: ctl.not_modified > 0)
        counts = _p_counts(fleet)
        assert counts["p2"] == 0 and len(d[1].calls) == 0
        assert 0.65 <= counts["p0"] / 200 <= 0.85, counts
        assert {k: health[k] for k in ("status", "routing", "version", "ejected")} == {
            "status": "ok",
            "routing": "fresh",
            "version": 1,
            "ejected": {},
        }


async def test_controller_down_keeps_the_last_table_then_falls_back_to_equal_weights() -> None:
    async with fake_fleet(2, 1) as fleet:
        p, d = fleet.prefill, fleet.decode
        ctl = FakeController(
            table(
                [
                    ("p0", "prefill", "prefill", p[0].url, 1.0, False),
                    ("p1", "prefill", "prefill", p[1].url, 1.0, True),
                    ("d0", "decode", "decode", d[0].url, 1.0, False),
                ],
                version=7,
            )
        )
        async with serve(ctl.app()) as ctl_url:
            settings = make_settings(
                [x.url for x in p],
                [x.url for x in d],
                proxy={"controller_url": ctl_url, "fail_static_s": 3.0},
            )
            async with running_proxy(settings) as (url, app), httpx.AsyncClient(timeout=10) as client:
                routing = app.parts.routing
                await async_wait_until("a fresh routing table", lambda: routing.state == "fresh")
                ctl.down = True
                await async_wait_until("the static routing state", lambda: routing.state == "static")
                for _ in range(10):  # the last table still applies: p1 stays drained
                    assert (await client.post(url + "/v1/completions", json=COMPLETION)).status_code == 200
                assert routing.state == "static", "test too slow for fail_static_s"
                assert len(p[1].calls) == 0
                metrics = (await client.get(url + "/metrics")).text
                assert 'pdscope_proxy_routing_state{state="static"} 1.0' in metrics
                await async_wait_until("the routing fallback", lambda: routing.state == "fallback")
                for _ in range(40):  # equal weights from the config: p1 gets work again
                    assert (await client.post(url + "/v1/completions", json=COMPLETION)).status_code == 200
                assert len(p[1].calls) > 5
                metrics = (await client.get(url + "/metrics")).text
                assert 'pdscope_proxy_routing_state{state="fallback"} 1.0' in metrics
                assert "pdscope_proxy_routing_poll_failures_total" in metrics
                ctl.down = False  # the controller is back: its table applies again
                await async_wait_until("a fresh routing table", lambda: routing.state == "fresh")
                assert routing.view.version == 7


async def test_no_controller_at_all_serves_with_equal_weights_and_says_never_reached(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="proxy.routing")
    async with fake_fleet(2, 1) as fleet:
        settings = make_settings([x.url for x in fleet.prefill], [fleet.decode[0].url])
        async with running_proxy(settings) as (url, app), httpx.AsyncClient(timeout=10) as client:
            for _ in range(30):
                assert (await client.post(url + "/v1/completions", json=COMPLETION)).status_code == 200
            await async_wait_until("three failed polls", lambda: app.parts.routing.poll_failures > 2)
            assert app.parts.routing.state == "never_reached"
            metrics = (await client.get(url + "/metrics")).text
            health = (await client.get(url + "/healthz")).json()
        assert 'pdscope_proxy_routing_state{state="never_reached"} 1.0' in metrics
        assert 'pdscope_proxy_routing_state{state="default"} 0.0' in metrics
        assert health["routing"] == "never_reached"
        warnings = [
            r for r in caplog.records if r.levelno == logging.WARNING and "no controller reached" in r.message
        ]
        assert len(warnings) == 1  # once, not per failed poll
        assert min(_p_counts(fleet).values()) > 3


async def test_polls_that_change_nothing_log_nothing_at_info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with fake_fleet(1, 1) as fleet:
        p, d = fleet.prefill, fleet.decode
        ctl = FakeController(
            table(
                [
                    ("p0", "prefill", "prefill", p[0].url, 1.0, False),
                    ("d0", "decode", "decode", d[0].url, 1.0, False),
                ]
            )
        )
        async with serve(ctl.app()) as ctl_url:
            settings = make_settings([p[0].url], [d[0].url], proxy={"controller_url": ctl_url})
            async with running_proxy(settings) as (_url, app):
                await async_wait_until("a fresh routing table", lambda: app.parts.routing.state == "fresh")
                await async_wait_until("ten polls", lambda: ctl.gets >= 10)
        failures = app.parts.routing.poll_failures
    logged = [r for r in caplog.records if r.levelno >= logging.INFO and r.name in ("httpx", "proxy.routing")]
    lines = [r.getMessage() for r in logged]
    if failures == 0:
        assert lines == ["routing: now fresh, table version 1"], logged
    else:  # a loaded machine timed a poll out (0.2 s): each failure may log a change of state, and
        # its recovery another, but the polls that answered and changed nothing still log nothing
        transitions = (
            "routing: now fresh,",
            "routing: no controller reached",
            "routing: controller unreachable",
        )
        assert all(line.startswith(transitions) for line in lines), logged
        assert len(lines) <= 1 + 2 * failures, logged


async def test_advisory_table_is_not_applied() -> None:
    async with fake_fleet(2, 1) as fleet:
        p, d = fleet.prefill, fleet.decode
        ctl = FakeController(
            table(
                [
                    ("p0", "prefill", "prefill", p[0].url, 1.0, False),
                    ("p1", "prefill", "prefill", p[1].url, 1.0, True),
                    ("d0", "decode", "decode", d[0].url, 1.0, False),
                ],
                enforce=False,
            )
        )
        async with serve(ctl.app()) as ctl_url:
            settings = make_settings(
                [x.url for x in p], [x.url for x in d], proxy={"controller_url": ctl_url}
            )
            async with running_proxy(settings) as (url, app), httpx.AsyncClient(timeout=10) as client:
                await async_wait_until(
                    "an advisory routing table", lambda: app.parts.routing.state == "advisory"
                )
                for _ in range(30):
                    assert (await client.post(url + "/v1/completions", json=COMPLETION)).status_code == 200
        assert len(p[1].calls) > 3  # the drain was advisory


@dataclass
class SecondRequest:
    """A request sent while a streaming one holds the decode pool's only slot."""

    response: httpx.Response
    waits: list[tuple[float, bool]]  # the second request's admission waits: (budget in s, woken by a release)
    first_still_running: bool
    metrics: str
    p_calls: int


def _record_waits(admission: Admission) -> list[tuple[float, bool]]:
    """Record each admission wait from now on as (its budget in s, whether a release woke it)."""
    waits: list[tuple[float, bool]] = []
    wait = admission.wait

    async def recording(within_s: float, deadline: float = math.inf) -> bool:
        woken = await wait(within_s, deadline)
        waits.append((within_s, woken))
        return woken

    admission.wait = recording  # type: ignore[method-assign]
    return waits


async def _while_the_only_slot_is_held(
    decode_pool: dict[str, object], admission: dict[str, object]
) -> SecondRequest:
    async with fake_fleet(1, 1, n_chunks=5, chunk_delay=0.2) as fleet:
        p, d = fleet.prefill, fleet.decode
        ctl = FakeController(
            table(
                [
                    ("p0", "prefill", "prefill", p[0].url, 1.0, False),
                    ("d0", "decode", "decode", d[0].url, 1.0, False),
                ],
                pools=[{"name": "decode", "role": "decode", "max_inflight_requests": 1, **decode_pool}],
            )
        )
        async with serve(ctl.app()) as ctl_url:
            settings = make_settings(
                [p[0].url], [d[0].url], proxy={"controller_url": ctl_url, "admission": admission}
            )
            async with running_proxy(settings) as (url, app), httpx.AsyncClient(timeout=10) as client:
                await async_wait_until("a fresh routing table", lambda: app.parts.routing.state == "fresh")
                slow = asyncio.create_task(
                    client.post(url + "/v1/completions", json={**COMPLETION, "stream": True})
                )
                await async_wait_until(
                    "a held decode slot", lambda: app.parts.admission.requests["decode"] == 1
                )
                waits = _record_waits(app.parts.admission)
                second = await client.post(url + "/v1/completions", json=COMPLETION)
                still_running = not slow.done()
                assert (await slow).status_code == 200
                metrics = (await client.get(url + "/metrics")).text
        return SecondRequest(second, waits, still_running, metrics, len(p[0].calls))


async def test_admission_rejects_with_retry_after_when_the_pool_is_full() -> None:
    got = await _while_the_only_slot_is_held({}, {"queue_timeout_s": 0.2, "retry_after_s": 3})
    rejected, metrics = got.response, got.metrics
    assert rejected.status_code == 429
    assert rejected.headers["retry-after"] == "3"
    err = rejected.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "inflight_requests"
    # the bounded wait happened first: it waited (up to the 0.2 s queue timeout) and nothing woke it
    assert got.waits and all(0 < budget <= 0.2 and not woken for budget, woken in got.waits), got.waits
    assert 'pdscope_proxy_rejections_total{pool="decode",reason="inflight_requests"} 1.0' in metrics
    assert got.p_calls == 1  # the rejected request never reached P


async def test_a_zero_wait_budget_from_the_controller_rejects_at_once() -> None:
    got = await _while_the_only_slot_is_held({"max_queue_wait_s": 0.0}, {"queue_timeout_s": 30})
    rejected = got.response
    # Rejected while the first request still held the slot: it did not wait out the 30 s timeout.
    assert rejected.status_code == 429 and got.first_still_running
    assert rejected.json()["error"]["code"] == "inflight_requests"


async def test_a_waiting_request_is_admitted_when_a_slot_frees() -> None:
    async with fake_fleet(1, 1, n_chunks=3, chunk_delay=0.1) as fleet:
        settings = make_settings(
            [fleet.prefill[0].url],
            [fleet.decode[0].url],
            proxy={"admission": {"max_inflight_requests": 1, "queue_timeout_s": 5}},
        )
        async with running_proxy(settings) as (url, app), httpx.AsyncClient(timeout=10) as client:
            first = asyncio.create_task(
                client.post(url + "/v1/completions", json={**COMPLETION, "stream": True})
            )
            await async_wait_until(
                "the decode slot to be held", lambda: app.parts.admission.requests["decode"] == 1
            )
            second = await client.post(url + "/v1/completions", json=COMPLETION)
            assert (await first).status_code == 200
        assert second.status_code == 200


async def test_admission_counts_handoff_kv_bytes() -> None:
    async with fake_fleet(1, 1) as fleet:
        fleet.decode[0].mode = "hang"  # KV stays "in handoff": P answered, D has no first token
        # 10 prompt tokens x 1000 bytes = 10 kB per request; the limit is 5 kB
        settings = make_settings(
            [fleet.prefill[0].url],
            [fleet.decode[0].url],
            proxy={
                "admission": {"max_inflight_kv_bytes": 5000, "queue_timeout_s": 0.1},
                "timeouts": {"connect_s": 1, "prefill_s": 5, "decode_first_token_s": 3, "decode_total_s": 10},
            },
        )
        async with running_proxy(settings) as (url, app), httpx.AsyncClient(timeout=10) as client:
            stuck = asyncio.create_task(
                client.post(url + "/v1/completions", json={**COMPLETION, "stream": True})
            )
            await async_wait_until(
                "handoff KV bytes on D", lambda: app.parts.admission.kv_bytes["decode"] == 10_000
            )
            assert app.parts.admission.kv_bytes["prefill"] == 10_000  # pinned on P too
            rejected = await client.post(url + "/v1/completions", json=COMPLETION)
            stuck.cancel()
        assert rejected.status_code == 429
        assert rejected.json()["error"]["code"] == "inflight_kv_bytes"


async def test_round_robin_policy_cycles_like_the_toy_proxy() -> None:
    async with fake_fleet(2, 2) as fleet:
        settings = make_settings(
            [x.url for x in fleet.prefill], [x.url for x in fleet.decode], proxy={"policy": "round-robin"}
        )
        async with running_proxy(settings) as (url, _app), httpx.AsyncClient(timeout=10) as client:
            for _ in range(6):
                assert (await client.post(url + "/v1/completions", json=COMPLETION)).status_code == 200
        assert [len(x.calls) for x in fleet.prefill] == [3, 3]
        assert [len(x.calls) for x in fleet.decode] == [3, 3]


async def test_all_drained_is_a_503_with_retry_after() -> None:
    async with fake_fleet(1, 1) as fleet:
        p, d = fleet.prefill, fleet.decode
        ctl = FakeController(
            table(
                [
                    ("p0", "prefill", "prefill", p[0].url, 1.0, True),
                    ("d0", "decode", "decode", d[0].url, 1.0, False),
                ]
            )
        )
        async with serve(ctl.app()) as ctl_url:
            settings = make_settings([p[0].url], [d[0].url], proxy={"controller_url": ctl_url})
            async with running_proxy(settings) as (url, app), httpx.AsyncClient(timeout=10) as client:
                await async_wait_until("a fresh routing table", lambda: app.parts.routing.state == "fresh")
                resp = await client.post(url + "/v1/completions", json=COMPLETION)
        assert resp.status_code == 503 and "retry-after" in resp.headers
        assert p[0].calls == []
