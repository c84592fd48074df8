"""Failures are failures (issue 13 item 11, issue 14 finding 1): D's in-band error events and
streams that end without ``[DONE]``, before and after the first token. On the in-memory fleet
(tests/proxy/memory.py): the rules, without sockets."""

from __future__ import annotations

import json

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdscope import semconv as sc
from tests.proxy.fakes import completion_text
from tests.proxy.memory import MemVLLM, one_pool_each

COMPLETION = {
    "model": "fake",
    "prompt": "one two three four five six seven eight",
    "max_tokens": 8,
    "stream": True,
}


def _events(raw: bytes) -> list[str]:
    return [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]


def _text(raw: bytes) -> str:
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
    ps = [MemVLLM("p0", "prefill"), MemVLLM("p1", "prefill")]
    ds = [
        MemVLLM(
            "d0", "decode", stream_error="first"
        ),  # e.g. a failed NIXL read, reported in-band after a 200
        MemVLLM("d1", "decode"),
    ]
    proxy = one_pool_each(ps, ds, spans, policy="round-robin")
    reply = await proxy.send(COMPLETION)
    assert reply.status == 200
    assert _text(reply.data) == completion_text(COMPLETION)
    assert b"error" not in reply.data  # the client never saw d0's error
    assert len(ds[0].calls) == 1 and len(ds[1].calls) == 1
    # a new prefill, on the other P: d0 may have read (or freed) p0's blocks
    assert len(ps[0].calls) == 1 and len(ps[1].calls) == 1
    assert (
        proxy.metric(
            "pdscope_proxy_upstream_failures_total", instance="d0", kind="stream_error", stage="decode"
        )
        == 1
    )
    assert proxy.metric("pdscope_proxy_retries_total", stage="full") == 1
    # one result of d0 in the outlier window, a failure (it weighs d0 down)
    assert proxy.parts.selector.outliers.recent("d0", proxy.parts.clock()) == (1, 1)
    root = _root(spans)
    assert root.attributes[sc.OUTCOME] == "ok" and root.attributes[sc.RETRIES] == 1
    assert root.attributes[sc.D_INSTANCE] == "d1"
    failed = [
        s
        for s in spans.get_finished_spans()
        if s.name == sc.SPAN_DECODE and (s.attributes or {}).get(sc.INSTANCE) == "d0"
    ]
    assert failed[0].attributes[sc.ERROR_TYPE] == "stream_error"
    assert [e.name for e in failed[0].events] == []  # no first token was recorded for it


async def test_a_chat_stream_with_only_the_role_preamble_before_the_error_is_retried() -> None:
    chat = {
        "model": "fake",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 6,
        "stream": True,
    }
    p0 = MemVLLM("p0", "prefill")
    ds = [
        MemVLLM("d0", "decode", stream_error="first"),  # vLLM: role chunk, then the error event
        MemVLLM("d1", "decode"),
    ]
    proxy = one_pool_each([p0], ds, policy="round-robin")
    reply = await proxy.send(chat, endpoint="/v1/chat/completions")
    assert reply.status == 200 and b"error" not in reply.data
    deltas = [json.loads(e)["choices"][0]["delta"] for e in _events(reply.data) if e != "[DONE]"]
    assert deltas[0] == {"role": "assistant", "content": ""}  # d1's preamble, once
    assert "".join(d.get("content", "") for d in deltas) == completion_text(chat)
    assert len(p0.calls) == 2 and len(ds[1].calls) == 1
    assert (
        proxy.metric(
            "pdscope_proxy_upstream_failures_total", instance="d0", kind="stream_error", stage="decode"
        )
        == 1
    )


async def test_an_error_event_before_the_first_token_with_no_other_decode_is_a_502_error() -> None:
    spans = InMemorySpanExporter()
    proxy = one_pool_each([MemVLLM("p0", "prefill")], [MemVLLM("d0", "decode", stream_error="first")], spans)
    reply = await proxy.send(COMPLETION)
    assert reply.status == 502
    assert reply.json()["error"]["code"] == "upstream_stream_error"
    assert proxy.metric("pdscope_proxy_requests_total", endpoint="/v1/completions", outcome="error") == 1
    assert (
        proxy.metric(
            "pdscope_proxy_upstream_failures_total", instance="d0", kind="stream_error", stage="decode"
        )
        == 1
    )
    assert _root(spans).attributes[sc.OUTCOME] == "error"


async def test_an_error_event_after_the_first_token_ends_the_stream_with_outcome_error() -> None:
    spans = InMemorySpanExporter()
    ds = [MemVLLM(f"d{i}", "decode", n_chunks=4, stream_error="mid") for i in range(2)]
    proxy = one_pool_each([MemVLLM("p0", "prefill")], ds, spans, policy="round-robin")
    reply = await proxy.send(COMPLETION)
    assert reply.status == 200 and reply.ended
    events = _events(reply.data)
    assert "choices" in json.loads(events[0])  # the first token went out
    errors = [json.loads(e) for e in events if e != "[DONE]" and "error" in json.loads(e)]
    assert len(errors) == 1 and errors[0]["error"]["message"] == "KV transfer failed"  # D's own event
    assert len(ds[1].calls) == 0  # no retry after the first byte
    assert _root(spans).attributes[sc.OUTCOME] == "error"
    assert proxy.metric("pdscope_proxy_requests_total", endpoint="/v1/completions", outcome="error") == 1
    assert (
        proxy.metric(
            "pdscope_proxy_upstream_failures_total", instance="d0", kind="stream_error", stage="decode"
        )
        == 1
    )
    assert proxy.parts.selector.outliers.recent("d0", proxy.parts.clock()) == (1, 1)


async def test_a_stream_that_ends_without_done_is_not_ok() -> None:
    spans = InMemorySpanExporter()
    proxy = one_pool_each(
        [MemVLLM("p0", "prefill")], [MemVLLM("d0", "decode", n_chunks=3, no_done=True)], spans
    )
    reply = await proxy.send(COMPLETION)
    assert reply.status == 200 and reply.ended
    events = _events(reply.data)
    assert "[DONE]" not in events
    assert json.loads(events[-1])["error"]["code"] == "upstream_no_done"
    assert _text(reply.data) == completion_text(COMPLETION)  # what D sent still went through
    assert _root(spans).attributes[sc.OUTCOME] == "error"
    assert proxy.metric("pdscope_proxy_requests_total", endpoint="/v1/completions", outcome="error") == 1
    assert (
        proxy.metric("pdscope_proxy_upstream_failures_total", instance="d0", kind="no_done", stage="decode")
        == 1
    )


async def test_a_stream_that_ends_before_any_event_is_retried_like_a_failure_before_the_first_token() -> None:
    ds = [
        MemVLLM("d0", "decode", n_chunks=1, no_done=True, stream_error="empty"),
        MemVLLM("d1", "decode", n_chunks=1),
    ]
    proxy = one_pool_each([MemVLLM("p0", "prefill")], ds, policy="round-robin")
    reply = await proxy.send(COMPLETION)
    assert reply.status == 200 and _events(reply.data)[-1] == "[DONE]"
    assert len(ds[1].calls) == 1
    assert (
        proxy.metric("pdscope_proxy_upstream_failures_total", instance="d0", kind="no_done", stage="decode")
        == 1
    )
