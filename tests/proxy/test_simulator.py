"""The proxy in front of the simulated vLLM fleet (``simulator.testing``), with its faults."""

from __future__ import annotations

import json

import httpx
import pytest

from pdscope.config import parse_config
from simulator.testing import running_fleet
from tests.proxy.conftest import running_proxy
from tests.support.sockets import closed_port_url
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.slow  # a simulated fleet per test

BODY = {"model": "sim-llama-70b", "prompt": "tell me about prefill and decode " * 8, "max_tokens": 8}


def _settings(fleet, **proxy):  # type: ignore[no-untyped-def]
    text = fleet.config_yaml(
        proxy={"controller_url": closed_port_url(), "routing_poll_s": 0.05, "policy": "round-robin", **proxy}
    )
    return parse_config(text, "<sim>")


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_streams_and_whole_answers_through_the_simulated_fleet() -> None:
    with running_fleet(2, 2, latency_scale=0.0) as fleet:
        async with running_proxy(_settings(fleet)) as (url, _app), httpx.AsyncClient(timeout=20) as client:
            whole = await client.post(url + "/v1/completions", json=BODY)
            streamed = await client.post(
                url + "/v1/chat/completions",
                json={
                    "model": BODY["model"],
                    "messages": [{"role": "user", "content": BODY["prompt"]}],
                    "max_tokens": 8,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
            d_metrics = [(await client.get(u + "/metrics")).text for u in fleet.decode_urls]
    assert whole.status_code == 200, whole.text
    assert whole.json()["usage"]["completion_tokens"] == 8
    assert whole.headers["x-request-id"] in whole.json()["id"]  # D saw our X-Request-Id
    assert streamed.status_code == 200
    events = [
        json.loads(line[6:])
        for line in streamed.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    assert events and events[-1]["usage"]["completion_tokens"] == 8  # stream_options reached D
    assert streamed.text.rstrip().endswith("data: [DONE]")
    # D pulled the prompt over the (simulated) NIXL link instead of computing it
    pulled = sum(
        _metric(t, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") for t in d_metrics
    )
    local = sum(_metric(t, "vllm:prompt_tokens_by_source_total", source="local_compute") for t in d_metrics)
    assert pulled > 0 and local == 0


async def test_prefill_down_in_the_simulator_is_retried_on_the_other_prefill() -> None:
    with running_fleet(2, 1, latency_scale=0.0) as fleet:
        fleet.inject({"kind": "down", "instance": "prefill-0"})
        settings = _settings(fleet, outlier={"consecutive_failures": 2})
        async with running_proxy(settings) as (url, _app), httpx.AsyncClient(timeout=20) as client:
            codes = [(await client.post(url + "/v1/completions", json=BODY)).status_code for _ in range(6)]
            metrics = (await client.get(url + "/metrics")).text
    assert codes == [200] * 6
    # round robin sent prefill-0 two requests (each retried), then outlier detection ejected it
    assert (
        _metric(metrics, "pdscope_proxy_upstream_failures_total", instance="prefill-0", stage="prefill") == 2
    )
    assert _metric(metrics, "pdscope_proxy_retries_total", stage="prefill") == 2
    assert (
        _metric(
            metrics,
            "pdscope_proxy_outlier_ejections_total",
            instance="prefill-0",
            reason="consecutive_failures",
        )
        == 1
    )
    assert _metric(metrics, "pdscope_proxy_instance_ejected", instance="prefill-0") == 1


async def test_decode_down_in_the_simulator_is_retried_with_the_same_kv() -> None:
    with running_fleet(1, 2, latency_scale=0.0) as fleet:
        fleet.inject({"kind": "down", "instance": "decode-0"})
        async with running_proxy(_settings(fleet)) as (url, _app), httpx.AsyncClient(timeout=20) as client:
            resp = await client.post(url + "/v1/completions", json={**BODY, "stream": True})
            metrics = (await client.get(url + "/metrics")).text
            p_metrics = (await client.get(fleet.prefill_urls[0] + "/metrics")).text
    assert resp.status_code == 200 and resp.text.rstrip().endswith("data: [DONE]")
    assert _metric(metrics, "pdscope_proxy_retries_total", stage="decode") == 1
    assert _metric(p_metrics, "vllm:request_success_total") == 1  # one prefill only


async def test_client_disconnect_aborts_the_simulated_decode() -> None:
    with running_fleet(1, 1, latency_scale=1.0) as fleet:
        async with running_proxy(_settings(fleet)) as (url, _app):
            async with (
                httpx.AsyncClient(timeout=20) as client,
                client.stream(
                    "POST", url + "/v1/completions", json={**BODY, "max_tokens": 400, "stream": True}
                ) as resp,
            ):
                async for _chunk in resp.aiter_bytes():
                    break
            async with httpx.AsyncClient(timeout=20) as client:

                async def d_aborted() -> float:
                    d = (await client.get(fleet.decode_urls[0] + "/metrics")).text
                    return _metric(d, "vllm:request_success_total", finished_reason="abort")

                aborted = await async_wait_until("D to count an aborted request", d_aborted)
                metrics = (await client.get(url + "/metrics")).text
    assert aborted == 1  # D stopped generating for the departed client
    assert _metric(metrics, "pdscope_proxy_client_disconnects_total", stage="decode") == 1
