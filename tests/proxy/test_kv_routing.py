"""KV-aware routing through the gate and the flow (in memory, a fake cache view): the first pick
by the cost model, the decode-only path, the route on the root span, the counters, and a view
that fails or cannot key a prompt."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdscope import semconv as sc
from pdscope.config import Settings
from pdscope.kvevents import Batch, BlockStored, encode_message
from proxy.app import ProxyApp, build
from proxy.kvindex import PrefixIndex
from proxy.kvsubscriber import KvEventsSubscriber, Source
from proxy.metrics import LiveSources, ProxyMetrics
from tests.proxy.fakes import BLOCK, FakeView
from tests.proxy.memory import COMPLETION, MemoryProxy, MemVLLM, memory_flow, memory_settings
from tests.support.sockets import closed_port_url


def fleet(n_p: int = 3, n_d: int = 2, **d_kw: Any) -> tuple[list[MemVLLM], list[MemVLLM]]:
    return (
        [MemVLLM(f"p{i}", "prefill", cached_tokens=100 * i) for i in range(n_p)],
        [MemVLLM(f"d{i}", "decode", serves_plain=True, cached_tokens=7, **d_kw) for i in range(n_d)],
    )


def proxy_for(
    p: list[MemVLLM],
    d: list[MemVLLM],
    view: FakeView | None,
    spans: InMemorySpanExporter | None = None,
    **kv: Any,
) -> MemoryProxy:
    settings = memory_settings(
        {"prefill": ("prefill", p), "decode": ("decode", d)}, proxy={"kv_aware": kv} if kv else None
    )
    return memory_flow(settings, [*p, *d], spans, cache_view=view)


def root_of(spans: InMemorySpanExporter) -> Any:
    (root,) = [s for s in spans.get_finished_spans() if s.name == sc.SPAN_REQUEST]
    return root.attributes


async def test_the_p_holding_the_prefix_gets_the_request_and_the_root_says_why() -> None:
    p, d = fleet()
    view = FakeView({"p1": 800, "d1": 512})
    spans = InMemorySpanExporter()
    px = proxy_for(p, d, view, spans)
    reply = await px.send()
    assert reply.status == 200, reply.data
    assert (len(p[0].calls), len(p[1].calls), len(p[2].calls)) == (0, 1, 0)
    assert (len(d[0].calls), len(d[1].calls)) == (0, 1)  # the D holding more pulls less
    assert view.routed_to == [["p1", "d1"]]
    attrs = root_of(spans)
    assert attrs[sc.ROUTE_PATH] == sc.ROUTE_PD and attrs[sc.ROUTE_REASON] == "affinity"
    assert (attrs[sc.P_PREDICTED_CACHED], attrs[sc.D_PREDICTED_CACHED]) == (800, 512)
    assert attrs[sc.PREFIX_TOKENS] == 800
    assert attrs[sc.PREFIX_KEY] == (800 // BLOCK - 1).to_bytes(4, "big").hex() * 2
    assert (attrs[sc.P_CACHED_TOKENS], attrs[sc.D_CACHED_TOKENS]) == (100, 7)  # what P1 and D reported
    assert px.metric("pdscope_proxy_routes_total", path="pd", reason="affinity") == 1
    assert px.metric("pdscope_proxy_predicted_cached_tokens_total", role="prefill") == 800
    assert px.metric("pdscope_proxy_predicted_cached_tokens_total", role="decode") == 512
    assert px.metric("pdscope_proxy_prompt_tokens_routed_total") == 1024
    assert px.flow.gate.predictor.backlog == {}  # P answered: its backlog is empty
    assert px.flow.gate.predictor.d_backlog == {}  # D's first token: nor is D's


async def test_backlog_counts_prefills_in_flight_and_spreads_them() -> None:
    """Nothing shared: each prefill sent and not answered is P's backlog, so concurrent requests go to
    different Ps; the backlog is gone once they are answered."""
    p, d = fleet(2, 1)
    for inst in p:
        inst.mode = "hang"
    px = proxy_for(p, d, FakeView({}))
    backlog, d_backlog = px.flow.gate.predictor.backlog, px.flow.gate.predictor.d_backlog
    tasks = [asyncio.create_task(px.send()) for _ in range(2)]
    for inst in p:
        await asyncio.wait_for(inst.entered.wait(), 5)
    assert backlog == {"p0": 1024, "p1": 1024}
    assert d_backlog == {"d0": 2048}  # both are bound for d0: their KV is what it will pull
    assert px.flow.gate.predictor.pair_backlog == {("p0", "d0"): 1024, ("p1", "d0"): 1024}
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert backlog == {} and d_backlog == {}  # a request that ends leaves both
    assert px.parts.admission.requests["prefill"] == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_decode_only_skips_the_prefill(stream: bool) -> None:
    p, d = fleet()
    view = FakeView({"d0": 1000})  # 24 of 1024 tokens uncached on d0
    spans = InMemorySpanExporter()
    px = proxy_for(p, d, view, spans, decode_only={"enabled": True})
    body = (
        {**COMPLETION, "stream": stream, "stream_options": {"include_usage": True}} if stream else COMPLETION
    )
    reply = await px.send(body)
    assert reply.status == 200, reply.data
    assert all(not inst.calls for inst in p)
    (call,) = d[0].calls
    assert "kv_transfer_params" not in call["body"] and call["body"] == json.loads(json.dumps(body))
    assert view.routed_to == [["d0"]]
    names = {s.name for s in spans.get_finished_spans()}
    assert sc.SPAN_PREFILL not in names and sc.SPAN_HANDOFF not in names and sc.SPAN_DECODE in names
    attrs = root_of(spans)
    assert attrs[sc.ROUTE_PATH] == sc.ROUTE_DECODE_ONLY and attrs[sc.ROUTE_REASON] == "decode_only_short"
    assert sc.P_PREDICTED_CACHED not in attrs and attrs[sc.D_PREDICTED_CACHED] == 1000
    assert attrs[sc.D_CACHED_TOKENS] == 7 and attrs[sc.PROMPT_TOKENS] == 3  # from D's usage
    assert sc.P_INSTANCE not in attrs and attrs[sc.D_INSTANCE] == "d0"
    assert px.metric("pdscope_proxy_routes_total", path="decode_only", reason="decode_only_short") == 1
    assert px.metric("pdscope_proxy_pool_demand_total", pool="prefill") == 0
    assert px.metric("pdscope_proxy_pool_demand_total", pool="decode") == 1
    assert px.parts.admission.requests["decode"] == 0


@pytest.mark.parametrize("mode", ["error500", "down", "error503"])
async def test_a_failed_decode_only_d_is_retried_on_another_d_alone(mode: str) -> None:
    p, d = fleet()
    d[0].mode = mode
    view = FakeView({"d0": 1000, "d1": 0})  # 98% held, 24 tokens uncached: D alone for the ratio
    spans = InMemorySpanExporter()
    px = proxy_for(p, d, view, spans, decode_only={"enabled": True, "max_uncached_tokens": 0})
    reply = await px.send()
    assert reply.status == 200, reply.data
    assert all(not inst.calls for inst in p)  # never a prefill: D alone, another one
    assert len(d[1].calls) == 1 and "kv_transfer_params" not in d[1].calls[0]["body"]
    attrs = root_of(spans)
    assert attrs[sc.RETRIES] == 1 and attrs[sc.ROUTE_REASON] == "decode_only_cached"
    assert px.metric("pdscope_proxy_retries_total", stage="decode") == 1


async def test_decode_only_with_every_d_failing_is_a_502_after_the_attempts() -> None:
    p, d = fleet(1, 2)
    for inst in d:
        inst.mode = "error500"
    px = proxy_for(p, d, FakeView({}, tokens=100), decode_only={"enabled": True})
    reply = await px.send()
    assert reply.status == 502 and reply.json()["error"]["code"] == "upstream_status_500"
    assert not p[0].calls and sum(len(i.calls) for i in d) == 2
    assert px.parts.admission.requests["decode"] == 0


async def test_decode_only_serves_while_the_p_pool_is_full() -> None:
    p, d = fleet(1, 1)
    px = proxy_for(p, d, FakeView({}, tokens=64), decode_only={"enabled": True})
    px.parts.admission.requests["prefill"] = 10**6  # P's pool far over any limit
    reply = await px.send()
    assert reply.status == 200 and not p[0].calls and len(d[0].calls) == 1


@pytest.mark.parametrize(
    ("view", "body", "reason", "errors"),
    [
        (FakeView({"p1": 800}, fail="prompt"), COMPLETION, "view_error", {"prompt": 1}),
        (FakeView({"p1": 800}, fail="cached"), COMPLETION, "view_error", {"cached": 1}),
        (FakeView({"p1": 800}), {**COMPLETION, "prompt": "unkeyable"}, "no_prompt", {}),
    ],
)
async def test_a_view_that_fails_or_cannot_key_routes_load_only(
    view: FakeView, body: dict[str, Any], reason: str, errors: dict[str, int]
) -> None:
    p, d = fleet()
    spans = InMemorySpanExporter()
    px = proxy_for(p, d, view, spans)
    reply = await px.send(body)
    assert reply.status == 200, reply.data
    attrs = root_of(spans)
    assert attrs[sc.ROUTE_REASON] == reason and attrs[sc.ROUTE_PATH] == sc.ROUTE_PD
    assert sc.P_PREDICTED_CACHED not in attrs and sc.PREFIX_KEY not in attrs
    assert px.metric("pdscope_proxy_routes_total", path="pd", reason=reason) == 1
    for call in ("prompt", "cached", "routed"):
        assert px.metric("pdscope_proxy_kv_view_errors_total", call=call) == errors.get(call, 0)
    assert view.routed_to == []  # a load-only route teaches the view nothing


async def test_a_view_failing_in_routed_costs_only_the_count() -> None:
    p, d = fleet()
    px = proxy_for(p, d, FakeView({"p2": 512}, fail="routed"))
    reply = await px.send()
    assert reply.status == 200 and len(p[2].calls) == 1
    assert px.metric("pdscope_proxy_kv_view_errors_total", call="routed") == 1


async def test_mode_off_routes_as_before_and_records_vllm_reuse() -> None:
    p, d = fleet(1, 1)
    spans = InMemorySpanExporter()
    px = proxy_for(p, d, None, spans)
    assert px.parts.kv is None
    reply = await px.send()
    assert reply.status == 200
    attrs = root_of(spans)
    assert attrs[sc.ROUTE_PATH] == sc.ROUTE_PD
    assert (attrs[sc.P_CACHED_TOKENS], attrs[sc.D_CACHED_TOKENS]) == (0, 7)
    assert sc.ROUTE_REASON not in attrs and sc.D_PREDICTED_CACHED not in attrs
    assert px.metric("pdscope_proxy_routes_total", path="pd", reason="load") == 0  # not counted when off


async def test_usage_without_cached_tokens_leaves_them_absent() -> None:
    p, d = [MemVLLM("p0", "prefill")], [MemVLLM("d0", "decode")]
    spans = InMemorySpanExporter()
    px = proxy_for(p, d, FakeView({}), spans)
    assert (await px.send()).status == 200
    attrs = root_of(spans)
    assert sc.P_CACHED_TOKENS not in attrs and sc.D_CACHED_TOKENS not in attrs
    assert attrs[sc.ROUTE_REASON] == "load" and attrs[sc.PREFIX_TOKENS] == 0


def _subscriber() -> KvEventsSubscriber:
    index = PrefixIndex(BLOCK, 1000)
    return KvEventsSubscriber(
        [Source("p0", "tcp://127.0.0.1:9")], index, threading.Lock(), clock=lambda: 100.0
    )


def test_healthz_reports_the_mode_and_a_dead_subscriber_as_degraded() -> None:
    p, d = fleet(1, 1)
    px = proxy_for(p, d, FakeView({}), mode="approximate")
    app = ProxyApp(px.parts, poll=False)
    health = app.health()
    assert health["status"] == "ok" and health["kv_aware"] == {"mode": "approximate", "view": True}
    px.parts.kv_events = _subscriber()  # never started: not alive
    health = app.health()
    assert health["status"] == "degraded"
    sub = health["kv_aware"]["subscriber"]  # type: ignore[index]
    assert sub == {"alive": False, "loop_errors": 0, "instances": 1, "stale": []}


def test_kv_events_metrics_are_read_from_the_subscriber_at_scrape() -> None:
    sub = _subscriber()
    m = ProxyMetrics()
    p, d = fleet(1, 1)
    px = proxy_for(p, d, None)
    pp = px.parts
    m.watch(LiveSources(pp.routing, pp.admission, pp.selector, pp.budget, None, pp.clock, sub))
    ids = tuple(range(BLOCK))
    sub.receive("p0", encode_message("", 0, Batch(1.0, (BlockStored((1,), None, ids, BLOCK),))))
    sub.receive("p0", [b"", b"\x00" * 8, b"\xc1garbage"])
    sub.receive("nobody", encode_message("", 0, Batch(1.0, ())))
    sub.receive("p0", encode_message("", 5, Batch(2.0, ())))  # a gap, no replay: rebuilt
    sub.index.mark_stale("p0")

    def val(name: str, **labels: str) -> float | None:
        return m.registry.get_sample_value(name, labels)

    assert val("pdscope_proxy_kv_events_messages_total", instance="p0") == 2
    assert val("pdscope_proxy_kv_events_dropped_total", instance="p0", reason="msgpack") == 1
    assert val("pdscope_proxy_kv_events_dropped_total", instance="nobody", reason="unknown_instance") == 1
    assert val("pdscope_proxy_kv_events_gaps_total", instance="p0") == 1
    assert val("pdscope_proxy_kv_events_restarts_total", instance="p0") == 0
    assert val("pdscope_proxy_kv_events_last_message_age_seconds", instance="p0") == 0.0
    assert val("pdscope_proxy_kv_index_blocks", instance="p0") == 0  # forgotten at the gap
    assert val("pdscope_proxy_kv_index_stale", instance="p0") == 1
    assert val("pdscope_proxy_kv_events_replays_total", instance="p0", outcome="ok") is None


async def test_precise_mode_runs_the_subscriber_for_the_instances_with_events() -> None:
    pytest.importorskip("proxy.views")  # the cache views (make_view)
    p, d = fleet(1, 1)
    settings = memory_settings({"prefill": ("prefill", p), "decode": ("decode", d)})
    doc = settings.model_dump(mode="json")
    doc["model"]["tokenizer"] = "pdscope-sim"
    doc["proxy"]["kv_aware"]["mode"] = "precise"
    doc["pools"]["prefill"]["instances"][0]["kv_events_endpoint"] = closed_port_url().replace("http", "tcp")
    app = build(Settings.model_validate(doc), poll=False)
    sub = app.parts.kv_events
    assert sub is not None and sorted(sub.sources) == ["p0"] and app.parts.kv is not None
    await app.startup()
    try:
        health = app.health()
        assert health["status"] == "ok" and health["kv_aware"]["subscriber"]["alive"] is True  # type: ignore[index]
        text = app.parts.metrics.render().decode()
        assert 'pdscope_proxy_kv_events_messages_total{instance="p0"} 0.0' in text
        assert 'pdscope_proxy_kv_events_last_message_age_seconds{instance="p0"} -1.0' in text
    finally:
        await app.shutdown()
    assert not sub.alive


def test_the_kv_hit_checks_are_read_at_scrape() -> None:
    """The approximate/precise view's own health: each prediction checked against what the instance
    reported (``proxy.kvtrust``), per instance and verdict, on the proxy's /metrics."""
    from proxy.kvtrust import HitCheck

    m = ProxyMetrics()
    p, d = fleet(1, 1)
    pp = proxy_for(p, d, None).parts
    check = HitCheck(BLOCK)
    m.watch(LiveSources(pp.routing, pp.admission, pp.selector, pp.budget, None, pp.clock, None, check))
    check.observe("p0", 4 * BLOCK, 4 * BLOCK, 1.0)
    for t in range(3):
        check.observe("p1", 8 * BLOCK, 0, 2.0 + t)
    got = {
        (inst, v): m.registry.get_sample_value(
            "pdscope_proxy_kv_hit_checks_total", {"instance": inst, "verdict": v}
        )
        for inst, v in (("p0", "hit"), ("p1", "miss"), ("p1", "distrusted"))
    }
    assert got == {("p0", "hit"): 1.0, ("p1", "miss"): 3.0, ("p1", "distrusted"): 1.0}


def test_approximate_mode_exports_its_checked_predictions() -> None:
    """Issue 33: the approximate view reports its own health per instance, on the proxy's /metrics."""
    from proxy.approx import ApproxView

    p, d = fleet(1, 1)
    settings = memory_settings({"prefill": ("prefill", p), "decode": ("decode", d)})
    doc = settings.model_dump(mode="json")
    doc["proxy"]["kv_aware"]["mode"] = "approximate"
    app = build(Settings.model_validate(doc), poll=False)
    assert app.parts.kv is not None
    view = app.parts.kv.view
    assert isinstance(view, ApproxView)
    prompt = view.prompt("/v1/completions", {"model": "m", "prompt": "x" * 640})
    assert prompt is not None
    view.routed(prompt, ["p0"], 0.0)
    view.verify("p0", prompt.tokens, 0)  # predicted all of it, none came true
    m = app.parts.metrics.registry

    def val(name: str, **labels: str) -> float | None:
        return m.get_sample_value(name, labels)

    assert val("pdscope_proxy_kv_checked_cached_tokens_total", instance="p0", figure="predicted") == 160
    assert val("pdscope_proxy_kv_checked_cached_tokens_total", instance="p0", figure="reported") == 0
    assert val("pdscope_proxy_kv_hit_checks_total", instance="p0", verdict="miss") == 1
