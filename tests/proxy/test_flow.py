"""The proxy end to end against fake vLLM P/D servers: protocol, tracing, timeouts, disconnects.

The failure rules without sockets (which failure is retried where, admission of retries) are in
test_flow_rules.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdscope import semconv as sc
from tests.proxy.conftest import fake_fleet, make_settings, running_proxy
from tests.proxy.fakes import completion_text
from tests.support.sockets import closed_port_url
from tests.support.waiting import async_wait_until

COMPLETION = {"model": "fake", "prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0}
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6}


def _sse_text(raw: str, chat: bool) -> str:
    out = []
    for line in raw.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            choices = json.loads(line[6:])["choices"]
            if not choices:  # the usage event (include_usage)
                continue
            choice = choices[0]
            out.append(choice["delta"]["content"] if chat else choice["text"])
    return "".join(out)


@pytest.mark.parametrize("endpoint,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("stream", [False, True])
async def test_protocol_exactly_like_the_toy_proxy(endpoint: str, body: dict, stream: bool) -> None:
    async with fake_fleet(1, 1) as fleet:
        settings = make_settings([fleet.prefill[0].url], [fleet.decode[0].url])
        async with running_proxy(settings) as (url, _app), httpx.AsyncClient(timeout=10) as client:
            sent = {**body, "stream": stream}
            if stream:
                sent["stream_options"] = {"include_usage": True}
                sent["min_tokens"] = 2
                sent["max_completion_tokens"] = 8
            resp = await client.post(url + endpoint, json=sent)
            assert resp.status_code == 200, resp.text
        p_call, d_call = fleet.prefill[0].calls[0], fleet.decode[0].calls[0]
        # P: the client body with the prefill overrides, nothing else changed
        expected_p = {k: v for k, v in sent.items() if k not in ("stream_options", "min_tokens")}
        expected_p.update(
            stream=False,
            max_tokens=1,
            kv_transfer_params={
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            },
        )
        if "max_completion_tokens" in sent:
            expected_p["max_completion_tokens"] = 1
        assert p_call["body"] == expected_p
        assert p_call["path"] == d_call["path"] == endpoint
        # D: the client body unchanged except P's kv_transfer_params, verbatim
        p_answer_params = d_call["body"]["kv_transfer_params"]
        assert p_answer_params["remote_engine_id"] == "engine-p0"
        assert p_answer_params["remote_request_id"].endswith("-deadbeef")
        assert {k: v for k, v in d_call["body"].items() if k != "kv_transfer_params"} == sent
        # one X-Request-Id for both
        assert p_call["headers"]["x-request-id"] == d_call["headers"]["x-request-id"]
        assert resp.headers["x-request-id"] == p_call["headers"]["x-request-id"]
        chat = endpoint.endswith("chat/completions")
        want = completion_text(sent)
        if stream:
            assert resp.headers["content-type"].startswith("text/event-stream")
            assert _sse_text(resp.text, chat) == want
            assert resp.text.rstrip().endswith("data: [DONE]")
        else:
            choice = resp.json()["choices"][0]
            assert (choice["message"]["content"] if chat else choice["text"]) == want


async def test_spans_and_traceparent_reach_p_and_d(spans: InMemorySpanExporter) -> None:
    async with fake_fleet(1, 1) as fleet:
        settings = make_settings([fleet.prefill[0].url], [fleet.decode[0].url])
        async with (
            running_proxy(settings, exporter=spans) as (url, app),
            httpx.AsyncClient(timeout=10) as client,
        ):
            incoming = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
            resp = await client.post(
                url + "/v1/completions",
                json={**COMPLETION, "stream": True},
                headers={"traceparent": incoming},
            )
            assert resp.status_code == 200
            assert app.parts.spans is not None
            app.parts.spans.force_flush()
        by_name = {s.name: s for s in spans.get_finished_spans()}
        assert set(by_name) == {
            sc.SPAN_REQUEST,
            sc.SPAN_ADMISSION,
            sc.SPAN_PREFILL,
            sc.SPAN_HANDOFF,
            sc.SPAN_DECODE,
        }
        root = by_name[sc.SPAN_REQUEST]
        assert root.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C  # the client's trace continues
        for name in (sc.SPAN_ADMISSION, sc.SPAN_PREFILL, sc.SPAN_HANDOFF, sc.SPAN_DECODE):
            assert by_name[name].parent is not None and by_name[name].parent.span_id == root.context.span_id
        rid = fleet.prefill[0].calls[0]["headers"]["x-request-id"]
        attrs = root.attributes or {}
        assert attrs[sc.REQUEST_ID] == rid
        assert attrs[sc.P_INSTANCE] == "p0" and attrs[sc.D_INSTANCE] == "d0"
        assert attrs[sc.OUTCOME] == "ok" and attrs[sc.KV_BLOCKS] == 3
        assert attrs[sc.PROMPT_TOKENS] == 4 and attrs[sc.KV_BYTES] == 4000
        assert attrs[sc.REMOTE_ENGINE_ID] == "engine-p0"
        decode = by_name[sc.SPAN_DECODE]
        assert [e.name for e in decode.events] == [sc.EVENT_FIRST_TOKEN]
        handoff = by_name[sc.SPAN_HANDOFF]
        assert handoff.end_time is not None and handoff.end_time <= decode.events[0].timestamp + 1
        # traceparent: P's parent is the prefill span, D's is the decode span, same trace
        tp_p = fleet.prefill[0].calls[0]["headers"]["traceparent"]
        tp_d = fleet.decode[0].calls[0]["headers"]["traceparent"]
        assert tp_p == f"00-{root.context.trace_id:032x}-{by_name[sc.SPAN_PREFILL].context.span_id:016x}-01"
        assert tp_d == f"00-{root.context.trace_id:032x}-{decode.context.span_id:016x}-01"


async def test_tracing_off_still_forwards_the_clients_traceparent() -> None:
    async with fake_fleet(1, 1) as fleet:
        settings = make_settings([fleet.prefill[0].url], [fleet.decode[0].url], proxy={"tracing": False})
        async with running_proxy(settings) as (url, app), httpx.AsyncClient(timeout=10) as client:
            incoming = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
            resp = await client.post(
                url + "/v1/completions", json=COMPLETION, headers={"traceparent": incoming}
            )
            assert resp.status_code == 200
            assert app.parts.spans is None
        assert fleet.prefill[0].calls[0]["headers"]["traceparent"] == incoming
        assert fleet.decode[0].calls[0]["headers"]["traceparent"] == incoming


async def test_decode_timeout_before_first_token_is_a_504_not_a_hang() -> None:
    async with fake_fleet(1, 1) as fleet:
        fleet.decode[0].mode = "hang"
        settings = make_settings(
            [fleet.prefill[0].url],
            [fleet.decode[0].url],
            proxy={
                "timeouts": {"connect_s": 1, "prefill_s": 2, "decode_first_token_s": 0.3, "decode_total_s": 5}
            },
        )
        async with running_proxy(settings) as (url, _app), httpx.AsyncClient(timeout=10) as client:
            resp = await client.post(url + "/v1/completions", json={**COMPLETION, "stream": True})
        assert resp.status_code == 504
        assert resp.json()["error"]["type"] == "timeout_error"


async def test_client_disconnect_mid_stream_closes_the_decode_stream() -> None:
    async with fake_fleet(1, 1, n_chunks=8, chunk_delay=0.2) as fleet:
        settings = make_settings([fleet.prefill[0].url], [fleet.decode[0].url])
        async with running_proxy(settings) as (url, app):
            async with (
                httpx.AsyncClient(timeout=10) as client,
                client.stream("POST", url + "/v1/completions", json={**COMPLETION, "stream": True}) as resp,
            ):
                async for _chunk in resp.aiter_bytes():
                    break  # first token seen: go away
            await async_wait_until("D to see its stream closed", lambda: fleet.decode[0].aborted)
            async with httpx.AsyncClient(timeout=10) as client:
                metrics = (await client.get(url + "/metrics")).text
        assert fleet.decode[0].aborted == 1 and fleet.decode[0].finished == 0
        assert 'pdscope_proxy_client_disconnects_total{stage="decode"} 1.0' in metrics
        assert (
            'pdscope_proxy_requests_total{endpoint="/v1/completions",outcome="client_disconnect"} 1.0'
            in metrics
        )
        assert app.parts.admission.requests["decode"] == 0  # slots given back


async def test_decode_breaks_after_first_token_ends_stream_with_an_error_event() -> None:
    async with fake_fleet(1, 1, hang_after_first=True) as fleet:
        settings = make_settings(
            [fleet.prefill[0].url],
            [fleet.decode[0].url],
            proxy={
                "timeouts": {"connect_s": 1, "prefill_s": 2, "decode_first_token_s": 2, "decode_total_s": 0.5}
            },
        )
        async with running_proxy(settings) as (url, _app), httpx.AsyncClient(timeout=10) as client:
            resp = await client.post(url + "/v1/completions", json={**COMPLETION, "stream": True})
        assert resp.status_code == 200
        last = resp.text.strip().splitlines()[-1]
        assert json.loads(last[6:])["error"]["code"] == "upstream_timeout"


async def test_bad_json_is_a_400() -> None:
    async with fake_fleet(1, 1) as fleet:
        settings = make_settings([fleet.prefill[0].url], [fleet.decode[0].url])
        async with running_proxy(settings) as (url, _app), httpx.AsyncClient(timeout=10) as client:
            resp = await client.post(url + "/v1/completions", content=b"{not json")
            health = await client.get(url + "/healthz")
        assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
        assert health.status_code == 200 and health.json()["routing"] in ("default", "never_reached")
        assert fleet.prefill[0].calls == []


async def test_prefill_timeout_is_retried_then_a_504() -> None:
    async with fake_fleet(2, 1) as fleet:
        for p in fleet.prefill:
            p.mode = "hang"
        settings = make_settings(
            [p.url for p in fleet.prefill],
            [fleet.decode[0].url],
            proxy={
                "timeouts": {"connect_s": 1, "prefill_s": 0.3, "decode_first_token_s": 2, "decode_total_s": 5}
            },
        )
        async with running_proxy(settings) as (url, _app), httpx.AsyncClient(timeout=10) as client:
            resp = await client.post(url + "/v1/completions", json=COMPLETION)
            metrics = (await client.get(url + "/metrics")).text
        assert resp.status_code == 504 and resp.json()["error"]["code"] == "upstream_timeout"
        assert sum(len(p.calls) for p in fleet.prefill) == 2  # the other P was tried once
        assert 'pdscope_proxy_requests_total{endpoint="/v1/completions",outcome="timeout"} 1.0' in metrics
        assert fleet.decode[0].calls == []


async def test_spans_leave_over_otlp_http_and_a_down_collector_costs_nothing() -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from proxy.app import build
    from tests.proxy.conftest import serve_proxy
    from tests.support.serving import serve

    bodies: list[bytes] = []

    async def traces(request: Request) -> Response:
        bodies.append(await request.body())
        return Response(b"", media_type="application/x-protobuf")

    sink = Starlette(routes=[Route("/v1/traces", traces, methods=["POST"])])
    async with fake_fleet(1, 1) as fleet, serve(sink) as sink_url:
        for endpoint, expect_spans in ((sink_url, True), (closed_port_url(), False)):
            settings = make_settings(
                [fleet.prefill[0].url], [fleet.decode[0].url], proxy={"otlp_endpoint": endpoint}
            )
            app = build(settings)  # the real OTLP/HTTP exporter
            async with serve_proxy(app) as url, httpx.AsyncClient(timeout=10) as client:
                for _ in range(3):
                    assert (await client.post(url + "/v1/completions", json=COMPLETION)).status_code == 200
                assert app.parts.spans is not None
                await asyncio.to_thread(app.parts.spans.force_flush)
                spans = app.parts.spans
                if expect_spans:
                    assert spans.exported == 15 and spans.failed == 0
                else:
                    # held for a retry, not lost (a try may have been made before the flush too)
                    assert spans.exported == 0 and spans.failed >= 15 and spans.queued == 15
                    assert spans.dropped == 0
    names = []
    for body in bodies:
        req = ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            service = {a.key: a.value.string_value for a in rs.resource.attributes}["service.name"]
            assert service == sc.SERVICE_PROXY
            names += [s.name for ss in rs.scope_spans for s in ss.spans]
    assert sorted(names) == sorted(
        [sc.SPAN_REQUEST, sc.SPAN_ADMISSION, sc.SPAN_PREFILL, sc.SPAN_HANDOFF, sc.SPAN_DECODE] * 3
    )
