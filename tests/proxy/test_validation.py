"""Invalid requests are refused before any prefill is spent (issue 13 item 3 and the
``"stream": "false"`` item); a 4xx that D still answers is the client's, never D's."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdscope import semconv as sc
from proxy.validate import InvalidRequest, check_body
from tests.proxy.conftest import fake_fleet, make_settings, running_proxy

LONG_PROMPT = " ".join(["token"] * 4000)
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
OK_COMPLETION = {"model": "fake", "prompt": "hello", "max_tokens": 4}
OK_CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4}


@pytest.mark.parametrize(
    "endpoint,body,param",
    [
        (COMPLETIONS, {"prompt": LONG_PROMPT, "max_tokens": -1}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": "8"}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": True}, "max_tokens"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -5},
            "max_completion_tokens",
        ),
        (COMPLETIONS, {"prompt": "x", "n": 0}, "n"),
        (COMPLETIONS, {"prompt": "x", "temperature": -0.1}, "temperature"),
        (COMPLETIONS, {"prompt": "x", "temperature": 2.5}, "temperature"),
        (COMPLETIONS, {"prompt": "x", "temperature": "0.5"}, "temperature"),
        (COMPLETIONS, {"prompt": "x", "top_p": 0}, "top_p"),
        (COMPLETIONS, {"prompt": "x", "top_p": 1.5}, "top_p"),
        (COMPLETIONS, {"prompt": "x", "top_k": -2}, "top_k"),
        (COMPLETIONS, {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        (COMPLETIONS, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        (COMPLETIONS, {"prompt": "x", "stream": "false"}, "stream"),
        (COMPLETIONS, {"prompt": "x", "stream": 1}, "stream"),
        (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        (COMPLETIONS, {"max_tokens": 4}, "prompt"),
        (COMPLETIONS, {"prompt": 42}, "prompt"),
        (COMPLETIONS, {"prompt": []}, "prompt"),
        (COMPLETIONS, {"prompt": [1, "a"]}, "prompt"),
        (CHAT, {"prompt": "x"}, "messages"),
        (CHAT, {"messages": "hi"}, "messages"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": [{"content": "no role"}]}, "messages[0]"),
        (COMPLETIONS, {"prompt": "x", "model": 7}, "model"),
    ],
)
def test_what_vllm_would_refuse_names_the_field(endpoint: str, body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        check_body(endpoint, body)
    assert err.value.param == param and param.split("[")[0] in err.value.message


@pytest.mark.parametrize(
    "endpoint,body",
    [
        (COMPLETIONS, OK_COMPLETION),
        (CHAT, OK_CHAT),
        (COMPLETIONS, {"prompt": ["a", "b"], "max_tokens": None, "stream": None}),
        (COMPLETIONS, {"prompt": [1, 2, 3], "temperature": 0, "top_p": 1, "top_k": -1, "n": 1}),
        (COMPLETIONS, {"prompt": [[1, 2], [3]], "stream": True, "stream_options": {"include_usage": True}}),
        (
            COMPLETIONS,
            {"prompt": "x", "stream": False, "stream_options": None, "min_tokens": 0, "max_tokens": 3},
        ),
        (
            CHAT,
            {
                "messages": [
                    {"role": "system", "content": None},
                    {"role": "user", "content": [{"type": "text"}]},
                ]
            },
        ),
    ],
)
def test_what_vllm_accepts_passes(endpoint: str, body: dict[str, Any]) -> None:
    check_body(endpoint, body)


def test_max_tokens_that_cannot_fit_the_configured_context_is_refused() -> None:
    check_body(COMPLETIONS, {"prompt": "x", "max_tokens": 4095}, max_model_len=4096)
    with pytest.raises(InvalidRequest) as err:
        check_body(COMPLETIONS, {"prompt": "x", "max_tokens": 4096}, max_model_len=4096)
    assert err.value.param == "max_tokens"


@pytest.mark.parametrize(
    "raw,field",
    [
        (json.dumps({"prompt": LONG_PROMPT, "max_tokens": -1}).encode(), "max_tokens"),
        (b'{"prompt": "x", "stream": "false"}', "stream"),
        (b'{"prompt": "x", "temperature": NaN}', None),
        (b'{"prompt": "x", "temperature": 1e400}', "temperature"),
        (b"[" * 100_000 + b"]" * 100_000, None),
        (b'["not", "an", "object"]', None),
    ],
)
async def test_an_invalid_request_is_a_400_and_never_reaches_p(raw: bytes, field: str | None) -> None:
    spans = InMemorySpanExporter()
    async with fake_fleet(1, 1) as fleet:
        settings = make_settings([fleet.prefill[0].url], [fleet.decode[0].url])
        async with (
            running_proxy(settings, exporter=spans) as (url, app),
            httpx.AsyncClient(timeout=10) as client,
        ):
            resp = await client.post(
                url + COMPLETIONS, content=raw, headers={"content-type": "application/json"}
            )
            metrics = (await client.get(url + "/metrics")).text
            assert app.parts.spans is not None
            app.parts.spans.force_flush()
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error"
    if field is not None:
        assert err["param"] == field and field in err["message"]
    assert fleet.prefill[0].calls == [] and fleet.decode[0].calls == []
    assert app.parts.admission.requests.get("prefill", 0) == 0
    root = next(s for s in spans.get_finished_spans() if s.name == sc.SPAN_REQUEST)
    assert root.attributes[sc.OUTCOME] == sc.OUTCOME_CLIENT_ERROR
    assert f'pdscope_proxy_requests_total{{endpoint="{COMPLETIONS}",outcome="client_error"}} 1.0' in metrics


async def test_seventy_invalid_requests_spend_no_prefill() -> None:
    async with fake_fleet(1, 1) as fleet:
        settings = make_settings([fleet.prefill[0].url], [fleet.decode[0].url])
        async with running_proxy(settings) as (url, _app), httpx.AsyncClient(timeout=10) as client:
            for _ in range(70):
                resp = await client.post(url + COMPLETIONS, json={"prompt": LONG_PROMPT, "max_tokens": -1})
                assert resp.status_code == 400
            assert (await client.post(url + COMPLETIONS, json=OK_COMPLETION)).status_code == 200
    assert len(fleet.prefill[0].calls) == 1


async def test_a_4xx_from_decode_after_a_prefill_is_the_clients_error_not_decodes() -> None:
    spans = InMemorySpanExporter()
    async with fake_fleet(1, 2) as fleet:
        for d in fleet.decode:
            d.mode = "error400"  # D refuses what the proxy let through (e.g. prompt + max_tokens too long)
        settings = make_settings(
            [fleet.prefill[0].url], [d.url for d in fleet.decode], proxy={"policy": "round-robin"}
        )
        async with (
            running_proxy(settings, exporter=spans) as (url, app),
            httpx.AsyncClient(timeout=10) as client,
        ):
            resp = await client.post(url + COMPLETIONS, json=OK_COMPLETION)
            metrics = (await client.get(url + "/metrics")).text
            assert app.parts.spans is not None
            app.parts.spans.force_flush()
            now = app.parts.clock()
            failed = [d.name for d in fleet.decode if app.parts.selector.outliers.recent(d.name, now)[1]]
    assert resp.status_code == 400 and resp.json()["error"]["message"] == "bad prompt"  # passed through
    assert len(fleet.decode[0].calls) + len(fleet.decode[1].calls) == 1  # never retried
    assert failed == []  # not an outlier failure of a D that refused a bad request
    assert "pdscope_proxy_upstream_failures_total{" not in metrics
    root = next(s for s in spans.get_finished_spans() if s.name == sc.SPAN_REQUEST)
    assert root.attributes[sc.OUTCOME] == sc.OUTCOME_CLIENT_ERROR
    assert root.status.is_ok  # a client's 4xx is not a server error on the span
    assert root.attributes[sc.HTTP_STATUS] == 400
    assert 'outcome="client_error"} 1.0' in metrics


async def test_a_4xx_from_prefill_is_the_clients_error() -> None:
    spans = InMemorySpanExporter()
    async with fake_fleet(1, 1) as fleet:
        fleet.prefill[0].mode = "error400"
        settings = make_settings([fleet.prefill[0].url], [fleet.decode[0].url])
        async with (
            running_proxy(settings, exporter=spans) as (url, app),
            httpx.AsyncClient(timeout=10) as client,
        ):
            resp = await client.post(url + COMPLETIONS, json=OK_COMPLETION)
            metrics = (await client.get(url + "/metrics")).text
            assert app.parts.spans is not None
            app.parts.spans.force_flush()
            recent = app.parts.selector.outliers.recent("p0", app.parts.clock())
    assert resp.status_code == 400 and recent == (0, 0)  # neither a failure nor a success of p0
    assert "pdscope_proxy_upstream_failures_total{" not in metrics
    root = next(s for s in spans.get_finished_spans() if s.name == sc.SPAN_REQUEST)
    assert root.attributes[sc.OUTCOME] == sc.OUTCOME_CLIENT_ERROR


async def test_an_oversized_body_is_a_413_counted() -> None:
    async with fake_fleet(1, 1) as fleet:
        settings = make_settings(
            [fleet.prefill[0].url], [fleet.decode[0].url], proxy={"max_request_bytes": 1000}
        )
        async with running_proxy(settings) as (url, _app), httpx.AsyncClient(timeout=10) as client:
            resp = await client.post(url + COMPLETIONS, json={"prompt": "x" * 2000})
            metrics = (await client.get(url + "/metrics")).text
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    assert resp.headers.get("connection") == "close"
    assert "pdscope_proxy_request_too_large_total 1.0" in metrics
    assert fleet.prefill[0].calls == []
