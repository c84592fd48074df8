"""Failures are failures (issue 13 item 11, issue 14 finding 1): D's in-band error events and
streams that end without ``[DONE]``, before and after the first token."""

from __future__ import annotations

import json

import httpx
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdscope import semconv as sc
from tests.proxy.conftest import fake_fleet, make_settings, running_proxy
from tests.proxy.fakes import completion_text

COMPLETION = {"model": "fake", "prompt": "one two three four five six seven eight", "max_tokens": 8,
              "stream": True}


def _events(raw: str) -> list[str]:
    return [line[6:] for line in raw.splitlines() if line.startswith("data: ")]


def _text(raw: str) -> str:
    out = []
    for data in _events(raw):
        if data != "[DONE]":
            event = json.loads(data)
            if "choices" in event:
                out.append(event["choices"][0]["text"])
    return "".join(out)


def _root(spans: InMemorySpanExporter):  # type: ignore[no-untyped-def]
    return next(s for s in spans.get_finished_spans() if s.name == sc.SPAN_REQUEST)


async def test_an_error_event_before_the_first_token_is_a_decode_failure_retried_with_a_new_prefill() -> None:
    spans = InMemorySpanExporter()
    async with fake_fleet(2, 2) as fleet:
        fleet.decode[0].stream_error = "first"  # e.g. a failed NIXL read, reported in-band after a 200
        settings = make_settings([p.url for p in fleet.prefill], [d.url for d in fleet.decode],
                                 proxy={"policy": "round-robin"})
        async with running_proxy(settings, exporter=spans) as (url, app), httpx.AsyncClient(timeout=10) as client:
            resp = await client.post(url + "/v1/completions", json=COMPLETION)
            metrics = (await client.get(url + "/metrics")).text
            assert app.parts.spans is not None
            app.parts.spans.force_flush()
            recent = app.parts.selector.outliers.recent("d0", app.parts.clock())
        assert resp.status_code == 200
        assert _text(resp.text) == completion_text(COMPLETION)
        assert "error" not in resp.text  # the client never saw d0's error
        assert len(fleet.decode[0].calls) == 1 and len(fleet.decode[1].calls) == 1
        # a new prefill, on the other P: d0 may have read (or freed) p0's blocks
        assert len(fleet.prefill[0].calls) == 1 and len(fleet.prefill[1].calls) == 1
    assert 'pdscope_proxy_upstream_failures_total{instance="d0",kind="stream_error",stage="decode"} 1.0' in metrics
    assert 'pdscope_proxy_retries_total{stage="full"} 1.0' in metrics
    assert recent == (1, 1)  # one result of d0 in the outlier window, a failure (it weighs d0 down)
    root = _root(spans)
    assert root.attributes[sc.OUTCOME] == "ok" and root.attributes[sc.RETRIES] == 1
    assert root.attributes[sc.D_INSTANCE] == "d1"
    failed = [s for s in spans.get_finished_spans()
              if s.name == sc.SPAN_DECODE and (s.attributes or {}).get(sc.INSTANCE) == "d0"]
    assert failed[0].attributes[sc.ERROR_TYPE] == "stream_error"
    assert [e.name for e in failed[0].events] == []  # no first token was recorded for it


async def test_a_chat_stream_with_only_the_role_preamble_before_the_error_is_retried() -> None:
    chat = {"model": "fake", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6,
            "stream": True}
    async with fake_fleet(1, 2) as fleet:
        fleet.decode[0].stream_error = "first"  # vLLM: role chunk, then the error event
        settings = make_settings([fleet.prefill[0].url], [d.url for d in fleet.decode],
                                 proxy={"policy": "round-robin"})
        async with running_proxy(settings) as (url, _app), httpx.AsyncClient(timeout=10) as client:
            resp = await client.post(url + "/v1/chat/completions", json=chat)
            metrics = (await client.get(url + "/metrics")).text
    assert resp.status_code == 200 and "error" not in resp.text
    deltas = [json.loads(e)["choices"][0]["delta"] for e in _events(resp.text) if e != "[DONE]"]
    assert deltas[0] == {"role": "assistant", "content": ""}  # d1's preamble, once
    assert "".join(d.get("content", "") for d in deltas) == completion_text(chat)
    assert len(fleet.prefill[0].calls) == 2 and len(fleet.decode[1].calls) == 1
    assert 'pdscope_proxy_upstream_failures_total{instance="d0",kind="stream_error",stage="decode"} 1.0' in metrics


async def test_an_error_event_before_the_first_token_with_no_other_decode_is_a_502_error() -> None:
    spans = InMemorySpanExporter()
    async with fake_fleet(1, 1) as fleet:
        fleet.decode[0].stream_error = "first"
        settings = make_settings([fleet.prefill[0].url], [fleet.decode[0].url])
        async with running_proxy(settings, exporter=spans) as (url, app), httpx.AsyncClient(timeout=10) as client:
            resp = await client.post(url + "/v1/completions", json=COMPLETION)
            metrics = (await client.get(url + "/metrics")).text
            assert app.parts.spans is not None
            app.parts.spans.force_flush()
    assert resp.status_code == 502
    assert resp.json()["error"]["code"] == "upstream_stream_error"
    assert 'pdscope_proxy_requests_total{endpoint="/v1/completions",outcome="error"} 1.0' in metrics
    assert 'pdscope_proxy_upstream_failures_total{instance="d0",kind="stream_error",stage="decode"} 1.0' in metrics
    assert _root(spans).attributes[sc.OUTCOME] == "error"


async def test_an_error_event_after_the_first_token_ends_the_stream_with_outcome_error() -> None:
    spans = InMemorySpanExporter()
    async with fake_fleet(1, 2, n_chunks=4) as fleet:
        for d in fleet.decode:
            d.stream_error = "mid"
        settings = make_settings([fleet.prefill[0].url], [d.url for d in fleet.decode],
                                 proxy={"policy": "round-robin"})
        async with running_proxy(settings, exporter=spans) as (url, app), httpx.AsyncClient(timeout=10) as client:
            resp = await client.post(url + "/v1/completions", json=COMPLETION)
            metrics = (await client.get(url + "/metrics")).text
            assert app.parts.spans is not None
            app.parts.spans.force_flush()
            recent = app.parts.selector.outliers.recent("d0", app.parts.clock())
    assert resp.status_code == 200
    events = _events(resp.text)
    assert "choices" in json.loads(events[0])  # the first token went out
    errors = [json.loads(e) for e in events if e != "[DONE]" and "error" in json.loads(e)]
    assert len(errors) == 1 and errors[0]["error"]["message"] == "KV transfer failed"  # D's own event
    assert len(fleet.decode[1].calls) == 0  # no retry after the first byte
    assert _root(spans).attributes[sc.OUTCOME] == "error"
    assert 'pdscope_proxy_requests_total{endpoint="/v1/completions",outcome="error"} 1.0' in metrics
    assert 'pdscope_proxy_upstream_failures_total{instance="d0",kind="stream_error",stage="decode"} 1.0' in metrics
    assert recent == (1, 1)


async def test_a_stream_that_ends_without_done_is_not_ok() -> None:
    spans = InMemorySpanExporter()
    async with fake_fleet(1, 1, n_chunks=3) as fleet:
        fleet.decode[0].no_done = True
        settings = make_settings([fleet.prefill[0].url], [fleet.decode[0].url])
        async with running_proxy(settings, exporter=spans) as (url, app), httpx.AsyncClient(timeout=10) as client:
            resp = await client.post(url + "/v1/completions", json=COMPLETION)
            metrics = (await client.get(url + "/metrics")).text
            assert app.parts.spans is not None
            app.parts.spans.force_flush()
    assert resp.status_code == 200
    events = _events(resp.text)
    assert "[DONE]" not in events
    assert json.loads(events[-1])["error"]["code"] == "upstream_no_done"
    assert _text(resp.text) == completion_text(COMPLETION)  # what D sent still went through
    assert _root(spans).attributes[sc.OUTCOME] == "error"
    assert 'pdscope_proxy_requests_total{endpoint="/v1/completions",outcome="error"} 1.0' in metrics
    assert 'pdscope_proxy_upstream_failures_total{instance="d0",kind="no_done",stage="decode"} 1.0' in metrics


async def test_a_stream_that_ends_before_any_event_is_retried_like_a_failure_before_the_first_token() -> None:
    async with fake_fleet(1, 2, n_chunks=1) as fleet:
        fleet.decode[0].no_done = True
        fleet.decode[0].stream_error = "empty"
        settings = make_settings([fleet.prefill[0].url], [d.url for d in fleet.decode],
                                 proxy={"policy": "round-robin"})
        async with running_proxy(settings) as (url, _app), httpx.AsyncClient(timeout=10) as client:
            resp = await client.post(url + "/v1/completions", json=COMPLETION)
            metrics = (await client.get(url + "/metrics")).text
    assert resp.status_code == 200 and _events(resp.text)[-1] == "[DONE]"
    assert len(fleet.decode[1].calls) == 1
    assert 'pdscope_proxy_upstream_failures_total{instance="d0",kind="no_done",stage="decode"} 1.0' in metrics
