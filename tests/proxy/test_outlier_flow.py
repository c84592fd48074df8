"""Outlier detection fed by the request flow (issue 14, "no black holes"): what counts as a
failure of an instance, and a D whose streams fail in-band is ejected while clients are served
(end to end, with the health answer); the rest on the in-memory fleet."""

from __future__ import annotations

import httpx
from prometheus_client import generate_latest

from tests.proxy.conftest import fake_fleet, make_settings, running_proxy
from tests.proxy.memory import MemVLLM, one_pool_each

COMPLETION = {"model": "fake", "prompt": "one two three four", "max_tokens": 4, "stream": True}


async def test_a_d_failing_in_band_before_its_first_token_is_ejected_and_clients_are_still_served() -> None:
    async with fake_fleet(2, 3) as fleet:
        fleet.decode[0].stream_error = "first"  # a 200, then a failed NIXL read reported in the stream
        settings = make_settings(
            [p.url for p in fleet.prefill],
            [d.url for d in fleet.decode],
            proxy={"outlier": {"consecutive_failures": 2, "base_ejection_s": 60, "max_ejection_s": 60}},
        )
        async with running_proxy(settings) as (url, app), httpx.AsyncClient(timeout=10) as client:
            out = app.parts.selector.outliers
            codes = []
            for _ in range(300):  # bounded; d0 is drawn about a third of the time until ejected
                codes.append((await client.post(url + "/v1/completions", json=COMPLETION)).status_code)
                if out.any_ejected:
                    break
            before = len(fleet.decode[0].calls)
            for _ in range(20):
                codes.append((await client.post(url + "/v1/completions", json=COMPLETION)).status_code)
            health = (await client.get(url + "/healthz")).json()
            metrics = (await client.get(url + "/metrics")).text
            ok_d1 = out.recent("d1", app.parts.clock())
    assert set(codes) == {200}  # every failure before the first token was retried elsewhere
    assert len(fleet.decode[0].calls) == before  # ejected: no new work
    assert health["ejected"]["d0"]["reason"] == "consecutive_failures"
    assert health["ejected"]["d0"]["pool"] == "decode" and health["ejected"]["d0"]["ejections"] == 1
    assert 'pdscope_proxy_outlier_ejections_total{instance="d0",reason="consecutive_failures"} 1.0' in metrics
    assert 'pdscope_proxy_instance_ejected{instance="d0"} 1.0' in metrics
    assert 'pdscope_proxy_instance_ejected{instance="d1"} 0.0' in metrics
    assert ok_d1[0] > 0 and ok_d1[1] == 0  # successes count too: the window holds a ratio


async def test_a_failure_after_the_first_token_counts_against_d() -> None:
    ds = [MemVLLM(f"d{i}", "decode", n_chunks=4, stream_error="mid") for i in range(2)]
    proxy = one_pool_each(
        [MemVLLM("p0", "prefill")], ds, policy="round-robin", outlier={"consecutive_failures": 1}
    )
    reply = await proxy.send(COMPLETION)
    ejected = [e.instance for e in proxy.parts.selector.outliers.ejected(proxy.parts.clock())]
    assert reply.status == 200 and b"KV transfer failed" in reply.data
    assert ejected == ["d0"]


async def test_a_429_or_a_4xx_from_p_or_d_is_neither_a_failure_nor_a_success() -> None:
    p0 = MemVLLM("p0", "prefill", mode="error429")
    ds = [MemVLLM("d0", "decode"), MemVLLM("d1", "decode")]
    proxy = one_pool_each([p0], ds, outlier={"consecutive_failures": 1})
    p429 = [(await proxy.send(COMPLETION)).status for _ in range(3)]
    p0.mode = "ok"
    for d in ds:
        d.mode = "error429"
    d429 = [(await proxy.send(COMPLETION)).status for _ in range(3)]
    for d in ds:
        d.mode = "error400"
    d400 = (await proxy.send(COMPLETION)).status
    out, now = proxy.parts.selector.outliers, proxy.parts.clock()
    assert p429 == [429] * 3 and d429 == [429] * 3 and d400 == 400  # passed through, not retried
    assert {name: out.recent(name, now) for name in ("d0", "d1")} == {"d0": (0, 0), "d1": (0, 0)}
    assert out.recent("p0", now) == (
        4,
        0,
    )  # p0's four answered prefills are its successes; its 429s are not counted
    assert not out.any_ejected
    metrics = generate_latest(proxy.parts.metrics.registry).decode()
    assert "pdscope_proxy_outlier_ejections_total{" not in metrics
    assert "pdscope_proxy_upstream_failures_total{" not in metrics
