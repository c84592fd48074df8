"""Push mode through the proxy, on the simulated fleet: D's leg with P's once P's side channel is known,
void when another engine answers, and no blame on D for what P's failure or restart caused."""

from __future__ import annotations

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdscope import semconv as sc
from pdscope.config import parse_config
from proxy.protocol import PrefillAnswer, ProtocolError
from proxy.push import SideChannels, check_mode, decode_answer, peer_of
from simulator.testing import RunningFleet, running_fleet
from tests.proxy.conftest import running_proxy
from tests.proxy.test_simulator import _metric
from tests.support.sockets import closed_port_url
from tests.support.waiting import async_wait_until

BODY = {"model": "sim-llama-70b", "prompt": "tell me about push mode " * 8, "max_tokens": 4}
PUSH_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2]],
    "remote_engine_id": "engine-a",
    "remote_request_id": "cmpl-x-0-00000001",
    "remote_host": "10.0.0.5",
    "remote_port": 5600,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 20,
    "transfer_mode": "push",
}


def _settings(fleet: RunningFleet, **proxy: object):  # type: ignore[no-untyped-def]
    base = {"controller_url": closed_port_url(), "routing_poll_s": 0.05, "policy": "round-robin"}
    text = fleet.config_yaml(proxy={**base, "push_early": True, **proxy})
    return parse_config(text, "<sim>")


def _handoffs(spans: InMemorySpanExporter) -> list[str]:
    roots = sorted(
        (s for s in spans.get_finished_spans() if s.name == sc.SPAN_REQUEST), key=lambda s: s.start_time or 0
    )
    return [str((s.attributes or {}).get(sc.HANDOFF)) for s in roots]


def test_a_push_peer_is_p_s_side_channel_and_a_malformed_one_is_none() -> None:
    peer = peer_of(PUSH_PARAMS)
    assert peer is not None and peer.decode_params("rid-1") == {  # the keys vLLM's push proxy sends
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "engine-a",
        "remote_request_id": "rid-1",
        "remote_host": "10.0.0.5",
        "remote_port": 5600,
        "tp_size": 1,
    }
    sent = decode_answer(PrefillAnswer(PUSH_PARAMS, 20, 1, "engine-a"))
    assert sent.kv_transfer_params == peer.decode_params("cmpl-x-0-00000001")
    broken = PrefillAnswer({**PUSH_PARAMS, "remote_request_id": None}, 20, 1, "engine-a")
    assert decode_answer(broken) is broken  # D refuses it, as it would P's
    for bad in (
        {"remote_port": "5600"},
        {"tp_size": True},
        {"remote_engine_id": "x" * 300},
        {"remote_host": ""},
    ):
        assert peer_of({**PUSH_PARAMS, **bad}) is None, bad
    peers = SideChannels()
    assert peers.learn("p0", PUSH_PARAMS) is False  # first seen
    assert peers.learn("p0", PUSH_PARAMS) is False
    assert peers.learn("p0", {**PUSH_PARAMS, "remote_engine_id": "engine-b"}) is True  # restarted
    assert peers.learn("p0", {**PUSH_PARAMS, "remote_port": -1}) is False and peers.get("p0") is None


def test_an_answer_in_the_other_mode_is_refused() -> None:
    check_mode(PUSH_PARAMS, "push")
    check_mode(None, "push")  # nothing to hand off
    with pytest.raises(ProtocolError, match="'pull' mode"):
        check_mode({**PUSH_PARAMS, "transfer_mode": "pull"}, "push")
    with pytest.raises(ProtocolError, match="'pull' mode"):
        check_mode({k: v for k, v in PUSH_PARAMS.items() if k != "transfer_mode"}, "push")  # pre-0.32 pull
    with pytest.raises(ProtocolError, match="'push' mode"):
        check_mode(PUSH_PARAMS, "pull")


@pytest.mark.slow
async def test_push_sends_d_with_p_once_p_is_known_and_p_records_the_writes() -> None:
    spans = InMemorySpanExporter()
    with running_fleet(1, 1, latency_scale=0.1, transfer_mode="push") as fleet:
        async with (
            running_proxy(_settings(fleet), spans) as (url, _app),
            httpx.AsyncClient(timeout=20) as client,
        ):
            first = await client.post(url + "/v1/completions", json=BODY)
            second = await client.post(url + "/v1/completions", json={**BODY, "stream": True})
            metrics = (await client.get(url + "/metrics")).text
            p_metrics = (await client.get(fleet.prefill_urls[0] + "/metrics")).text
            d_metrics = (await client.get(fleet.decode_urls[0] + "/metrics")).text
    assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] == 4
    assert second.status_code == 200 and second.text.rstrip().endswith("data: [DONE]")
    assert _handoffs(spans) == [sc.HANDOFF_PUSH, sc.HANDOFF_PUSH_EARLY]  # P first, then both at once
    assert _metric(metrics, "pdscope_proxy_push_early_legs_total", outcome="kept") == 1
    # push mode: P wrote the KV and recorded both transfers; D recorded none
    assert _metric(p_metrics, "vllm:nixl_xfer_time_seconds_count") == 2
    assert _metric(d_metrics, "vllm:nixl_xfer_time_seconds_count") == 0
    assert _metric(d_metrics, "vllm:prompt_tokens_by_source_total", source="local_compute") == 0


@pytest.mark.slow
async def test_a_restarted_p_voids_the_early_leg_without_blaming_d() -> None:
    """D registers with P's old engine id and fails at once; P's answer names its new engine: the early
    leg is void (not D's failure), D goes again with P's answer, and the change is counted."""
    spans = InMemorySpanExporter()
    with running_fleet(1, 1, latency_scale=0.1, transfer_mode="push") as fleet:
        async with (
            running_proxy(_settings(fleet), spans) as (url, _app),
            httpx.AsyncClient(timeout=20) as client,
        ):
            assert (await client.post(url + "/v1/completions", json=BODY)).status_code == 200
            fid = fleet.inject({"kind": "down", "instance": "prefill-0"})
            fleet.remove_fault(fid)

            async def p_back() -> bool:
                try:
                    return (await client.get(fleet.prefill_urls[0] + "/health")).status_code == 200
                except httpx.HTTPError:
                    return False

            await async_wait_until("prefill-0 back after its restart", p_back, timeout_s=10)
            resp = await client.post(url + "/v1/completions", json=BODY)
            metrics = (await client.get(url + "/metrics")).text
    assert resp.status_code == 200, resp.text
    assert _metric(metrics, "pdscope_proxy_push_early_legs_total", outcome="void") == 1
    assert _metric(metrics, "pdscope_proxy_engine_changes_total", instance="prefill-0") == 1
    assert _metric(metrics, "pdscope_proxy_upstream_failures_total", stage="decode") == 0
    assert _handoffs(spans)[-1] == sc.HANDOFF_PUSH


@pytest.mark.slow
async def test_a_failed_p_moves_the_prefill_and_the_void_early_leg_is_not_d_s() -> None:
    with running_fleet(2, 1, latency_scale=0.1, transfer_mode="push") as fleet:
        async with (
            running_proxy(_settings(fleet)) as (url, _app),
            httpx.AsyncClient(timeout=20) as client,
        ):
            for _ in range(2):  # round robin: both Ps answer once, so both are known
                assert (await client.post(url + "/v1/completions", json=BODY)).status_code == 200
            fleet.inject({"kind": "down", "instance": "prefill-0"})
            codes = [(await client.post(url + "/v1/completions", json=BODY)).status_code for _ in range(2)]
            metrics = (await client.get(url + "/metrics")).text
    assert codes == [200, 200]
    assert (
        _metric(metrics, "pdscope_proxy_upstream_failures_total", stage="prefill", instance="prefill-0") >= 1
    )
    assert _metric(metrics, "pdscope_proxy_upstream_failures_total", stage="decode") == 0
    assert _metric(metrics, "pdscope_proxy_push_early_legs_total", outcome="void") >= 1


@pytest.mark.slow
async def test_in_pull_mode_too_a_restarted_p_s_new_engine_id_is_counted() -> None:
    with running_fleet(1, 1, latency_scale=0.0) as fleet:
        async with (
            running_proxy(_settings(fleet)) as (url, _app),
            httpx.AsyncClient(timeout=20) as client,
        ):
            assert (await client.post(url + "/v1/completions", json=BODY)).status_code == 200
            before = _metric((await client.get(url + "/metrics")).text, "pdscope_proxy_engine_changes_total")
            fleet.remove_fault(fleet.inject({"kind": "down", "instance": "prefill-0"}))

            async def served_again() -> bool:
                try:
                    return (await client.post(url + "/v1/completions", json=BODY)).status_code == 200
                except httpx.HTTPError:
                    return False

            await async_wait_until("a request served after prefill-0's restart", served_again, timeout_s=10)
            metrics = (await client.get(url + "/metrics")).text
    assert before == 0
    assert _metric(metrics, "pdscope_proxy_engine_changes_total", instance="prefill-0") == 1
    assert _metric(metrics, "pdscope_proxy_push_early_legs_total") == 0  # pull mode sends no early leg
