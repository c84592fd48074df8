"""KV-aware routing in front of the simulated vLLM fleet (``simulator.testing``): the decode-only
path end to end (D alone computes the prompt; P never sees the request), and the configured modes'
views when the views' module is there. Nothing here depends on the simulator's prefix caching."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from pdscope import semconv as sc
from pdscope.config import parse_config
from simulator.testing import running_fleet
from tests.proxy.conftest import running_proxy
from tests.proxy.fakes import FakeView
from tests.proxy.test_simulator import BODY, _metric
from tests.support.sockets import closed_port_url

pytestmark = pytest.mark.slow  # a simulated fleet per test


def _settings(fleet: Any, kv_aware: dict[str, Any], **top: Any) -> Any:
    text = fleet.config_yaml(
        proxy={"controller_url": closed_port_url(), "routing_poll_s": 0.05, "kv_aware": kv_aware}, **top
    )
    return parse_config(text, "<sim>")


async def test_decode_only_against_the_simulator(spans: Any) -> None:
    with running_fleet(2, 2, latency_scale=0.0) as fleet:
        settings = _settings(fleet, {"decode_only": {"enabled": True}})
        view = FakeView({}, tokens=64)  # a short prompt: D alone
        async with (
            running_proxy(settings, spans, cache_view=view) as (url, _app),
            httpx.AsyncClient(timeout=20) as client,
        ):
            whole = await client.post(url + "/v1/completions", json=BODY)
            streamed = await client.post(
                url + "/v1/completions",
                json={**BODY, "stream": True, "stream_options": {"include_usage": True}},
            )
            d_metrics = [(await client.get(u + "/metrics")).text for u in fleet.decode_urls]
            p_metrics = [(await client.get(u + "/metrics")).text for u in fleet.prefill_urls]
            proxy_metrics = (await client.get(url + "/metrics")).text
    assert whole.status_code == 200, whole.text
    assert whole.json()["usage"]["completion_tokens"] == 8
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    local = sum(_metric(t, "vllm:prompt_tokens_by_source_total", source="local_compute") for t in d_metrics)
    pulled = sum(
        _metric(t, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") for t in d_metrics
    )
    assert local > 0 and pulled == 0  # D computed the prompt itself
    assert sum(_metric(t, "vllm:prompt_tokens_total") for t in p_metrics) == 0  # P never saw it
    assert _metric(proxy_metrics, "pdscope_proxy_routes_total", path="decode_only") == 2
    roots = [s for s in spans.get_finished_spans() if s.name == sc.SPAN_REQUEST]
    assert [r.attributes[sc.ROUTE_PATH] for r in roots] == [sc.ROUTE_DECODE_ONLY] * 2
    assert all(r.attributes[sc.PROMPT_TOKENS] == 48 for r in roots)  # D's usage: 48 words
    assert not [s for s in spans.get_finished_spans() if s.name in (sc.SPAN_PREFILL, sc.SPAN_HANDOFF)]


@pytest.mark.parametrize("mode", ["approximate", "precise"])
async def test_the_configured_modes_route_through_the_simulator(mode: str, spans: Any) -> None:
    pytest.importorskip("proxy.views")  # the cache views (make_view)
    with running_fleet(2, 2, latency_scale=0.0) as fleet:
        settings = _settings(fleet, {"mode": mode}, model={"tokenizer": "pdscope-sim"})
        async with running_proxy(settings, spans) as (url, _app), httpx.AsyncClient(timeout=20) as client:
            codes = [(await client.post(url + "/v1/completions", json=BODY)).status_code for _ in range(4)]
            health = (await client.get(url + "/healthz")).json()
            metrics = (await client.get(url + "/metrics")).text
    assert codes == [200] * 4
    assert health["kv_aware"]["mode"] == mode and health["kv_aware"]["view"] is True
    assert health["status"] == "ok"
    routed = _metric(metrics, "pdscope_proxy_routes_total", path="pd")
    assert routed == 4
    assert _metric(metrics, "pdscope_proxy_prompt_tokens_routed_total") > 0
    roots = [s for s in spans.get_finished_spans() if s.name == sc.SPAN_REQUEST]
    assert all(sc.ROUTE_REASON in r.attributes for r in roots)
