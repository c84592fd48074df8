"""Pure parts of the proxy: protocol bodies, selection, retry budget, routing state, span queue."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import yaml
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from pdscope.config import OutlierSettings, parse_config
from pdscope.routing import PoolRoute, RoutingTable
from proxy import protocol
from proxy.outlier import OutlierDetector
from proxy.routing import RoutingState, Target
from proxy.selection import RetryBudget, Selector
from proxy.tracing import make_provider, parse_traceparent, traceparent

# -- protocol ----------------------------------------------------------------------------


def test_prefill_body_overrides_and_leaves_the_client_body_alone() -> None:
    client = {
        "prompt": "x",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 50,
        "min_tokens": 3,
        "min_completion_tokens": 2,
        "max_completion_tokens": 50,
        "temperature": 0.5,
    }
    body = protocol.prefill_body(client)
    assert body == {
        "prompt": "x",
        "stream": False,
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "temperature": 0.5,
        "kv_transfer_params": protocol.PREFILL_KV_PARAMS,
    }
    assert client["stream"] is True and "stream_options" in client  # a copy, not a mutation
    assert "max_completion_tokens" not in protocol.prefill_body({"prompt": "x"})


def test_decode_body_carries_p_params_verbatim() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2], [3]], "x-new-field": 7}
    body = protocol.decode_body({"prompt": "x", "stream": True, "kv_transfer_params": {"old": 1}}, params)
    assert body == {"prompt": "x", "stream": True, "kv_transfer_params": params}
    assert protocol.decode_body({"prompt": "x"}, None) == {"prompt": "x"}


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "x", "stream": true, "max_tokens": 1e2, "s": "\\u00e9"}',
        b'  {"prompt":"x"}\r\n',
        b'{"prompt": "x", "kv_transfer_params": {"old": 1}}',  # the client's own: replaced
        '{"prompt": "x"}'.encode("utf-16"),  # another encoding json reads: encoded afresh
    ],
)
def test_decode_bytes_are_the_decode_body_and_keep_the_clients_bytes(raw: bytes) -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2], [3]], "remote_host": "h\u00e9"}
    request = json.loads(raw)
    out = protocol.decode_bytes(raw, request, params)
    assert json.loads(out) == protocol.decode_body(request, params)
    if b'"kv_transfer_params"' not in raw and raw.strip().startswith(b"{"):
        assert out.startswith(raw.strip()[:-1])  # the client's bytes, P's params appended
    assert protocol.decode_bytes(raw, request, None) == raw


def test_sse_watch_counts_the_same_whatever_the_chunking() -> None:
    """The fast path (whole lines of plain tokens) and the line-by-line path agree."""
    event = b'data: {"choices":[{"text":" the","finish_reason":null}]}\n\n'
    stream = (
        b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
        + event * 5
        + b": a comment\ndata:"
        + b'{"x": 1}\r\n\r\n'
        + event * 3
        + b'data: {"choices": [], "usage": {"completion_tokens": 9}}\n\n'
        + b'data: {"error": {"message": "late"}}\n\n'
        + event
        + b"data: [DONE]\n\n"
    )
    by_event = [e + b"\n\n" for e in stream.split(b"\n\n")[:-1]]  # as D writes it: the fast path
    assert b"".join(by_event) == stream
    seen = set()
    for size in (1, 7, len(event), len(event) * 2, 100, len(stream), 0):
        w = protocol.SseWatch()
        for chunk in by_event if size == 0 else [stream[i : i + size] for i in range(0, len(stream), size)]:
            w.feed(chunk)
        seen.add((w.events, w.completion_tokens, w.error, w.done))
    assert seen == {(11, 9, b'{"error": {"message": "late"}}', True)}


def test_parse_prefill_answer() -> None:
    raw = (
        b'{"usage": {"prompt_tokens": 40}, '
        b'"kv_transfer_params": {"remote_block_ids": [[1,2,3],[4]], "remote_engine_id": "e"}}'
    )
    answer = protocol.parse_prefill_answer(raw)
    assert (answer.prompt_tokens, answer.kv_blocks, answer.remote_engine_id) == (40, 4, "e")
    assert protocol.parse_prefill_answer(b'{"kv_transfer_params": null}').kv_transfer_params is None
    for bad in (b"nope", b"[1]", b'{"kv_transfer_params": 3}'):
        with pytest.raises(protocol.ProtocolError):
            protocol.parse_prefill_answer(bad)


# -- selection -----------------------------------------------------------------------------

T = [Target("a", "pool", "http://a", 3.0), Target("b", "pool", "http://b", 1.0)]


def test_weighted_pick_follows_weights_when_idle() -> None:
    sel = Selector("weighted", rng=random.Random(1))
    counts = Counter(sel.pick("prefill", T, 0.0).name for _ in range(4000))  # type: ignore[union-attr]
    assert 0.72 < counts["a"] / 4000 < 0.78


def test_power_of_two_choices_avoids_the_loaded_instance() -> None:
    sel = Selector("weighted", rng=random.Random(1))
    for _ in range(10):
        sel.acquire("a")
    counts = Counter(sel.pick("prefill", T, 0.0).name for _ in range(100))  # type: ignore[union-attr]
    assert counts["b"] == 100  # 10/3 > 0/1: b is always the less loaded of the two


def test_an_ejected_instance_is_skipped_until_its_ejection_ends() -> None:
    # (was: skipped for failure_cooldown_s after one failure; outlier detection is that home now)
    out = OutlierDetector(
        OutlierSettings(consecutive_failures=1, base_ejection_s=5, max_ejected_share=1.0),
        {"pool": ["a", "b"]},
    )
    sel = Selector("weighted", out, random.Random(1))
    assert out.failure("a", "pool", now=100.0) == "consecutive_failures"
    assert {sel.pick("prefill", T, 101.0).name for _ in range(50)} == {"b"}  # type: ignore[union-attr]
    assert "a" in {sel.pick("prefill", T, 106.0).name for _ in range(50)}  # type: ignore[union-attr]
    assert out.failure("b", "pool", now=200.0) == "consecutive_failures"
    assert out.failure("a", "pool", now=200.0) is None  # the last one in its pool is never ejected
    assert sel.pick("prefill", T, 201.0) is not None


def test_pick_honours_exclusions_and_pools() -> None:
    sel = Selector("weighted", rng=random.Random(1))
    assert sel.pick("prefill", T, 0.0, exclude=["a", "b"]) is None
    assert sel.pick("prefill", T, 0.0, pools=["other"]) is None
    assert sel.pick("prefill", T, 0.0, exclude=["a"]).name == "b"  # type: ignore[union-attr]


def test_round_robin_cycles_and_ignores_weights() -> None:
    sel = Selector("round-robin")
    assert [sel.pick("decode", T, 0.0).name for _ in range(4)] == ["a", "b", "a", "b"]  # type: ignore[union-attr]


def test_retry_budget_is_a_bounded_share_of_requests() -> None:
    budget = RetryBudget(0.2, reserve=5.0, window=100)
    allowed = 0
    for _ in range(1000):
        budget.on_request()
        allowed += budget.try_spend()  # a failing pool: every request wants a retry
    assert allowed <= 5 + 0.2 * 1000
    assert allowed >= 0.2 * 1000 - 1
    assert budget.refused == 1000 - allowed


# -- routing state ---------------------------------------------------------------------------

CONFIG = yaml.safe_dump(
    {
        "model": {"name": "m", "kv_bytes_per_token": 10},
        "pools": {
            "pa": {
                "role": "prefill",
                "instances": [{"name": "p0", "url": "http://p0"}, {"name": "p1", "url": "http://p1"}],
            },
            "da": {"role": "decode", "instances": [{"name": "d0", "url": "http://d0"}]},
        },
        "proxy": {"fail_static_s": 10, "admission": {"max_inflight_requests": 9}},
    }
)


def _table(version: int = 1, enforce: bool = True) -> RoutingTable:
    return RoutingTable.model_validate(
        {
            "version": version,
            "generated_at": 0,
            "mode": "enforce" if enforce else "advisory",
            "enforce": enforce,
            "instances": [
                {"name": "p0", "pool": "pa", "role": "prefill", "url": "http://p0", "weight": 2.0},
                {
                    "name": "p1",
                    "pool": "pa",
                    "role": "prefill",
                    "url": "http://p1",
                    "weight": 1.0,
                    "drained": True,
                },
                {"name": "d0", "pool": "da", "role": "decode", "url": "http://d0", "weight": 1.0},
            ],
            "pools": [{"name": "pa", "role": "prefill", "weight": 0.5, "max_inflight_requests": 3}],
        }
    )


def test_a_pool_wait_budget_shortens_the_configured_queue_timeout_never_lengthens_it() -> None:
    state = RoutingState(parse_config(CONFIG), now=0.0)
    table = _table()
    pools = [
        {"name": "pa", "role": "prefill", "max_queue_wait_s": 0.3},
        {"name": "da", "role": "decode", "max_queue_wait_s": 5.0},
    ]
    state.on_table(
        table.model_copy(update={"pools": [PoolRoute.model_validate(p) for p in pools]}), '"1"', now=1.0
    )
    assert state.view.limits["pa"].max_queue_wait_s == 0.3
    assert state.view.queue_wait_s(1.0) == 0.3
    assert state.view.queue_wait_s(0.1) == 0.1


def test_routing_state_machine_fail_static_then_fallback() -> None:
    state = RoutingState(parse_config(CONFIG), now=0.0)
    assert state.state == "default" and [t.name for t in state.view.prefill] == ["p0", "p1"]
    state.on_table(_table(), '"1"', now=1.0)
    assert state.state == "fresh"
    assert [(t.name, t.weight) for t in state.view.prefill] == [("p0", 1.0)]  # drained gone, x pool weight
    assert state.view.limits["pa"].max_inflight_requests == 3
    assert state.view.limits["da"].max_inflight_requests == 9  # config default
    assert state.view.queue_wait_s(1.0) == 1.0  # no pool shortens the configured wait
    state.on_failure(now=2.0)
    assert state.state == "static" and [t.name for t in state.view.prefill] == ["p0"]
    state.tick(now=10.9)
    assert state.state == "static"
    state.tick(now=11.1)
    assert state.state == "fallback" and [t.name for t in state.view.prefill] == ["p0", "p1"]
    assert state.etag is None  # ask for the full table next time
    state.on_table(_table(2), '"2"', now=12.0)
    assert state.state == "fresh" and state.view.version == 2


def test_not_modified_refreshes_a_static_table() -> None:
    state = RoutingState(parse_config(CONFIG), now=0.0)
    state.on_table(_table(), '"1"', now=1.0)
    state.on_failure(now=2.0)
    state.on_not_modified(now=3.0)
    assert state.state == "fresh" and state.age(4.0) == 1.0


def test_advisory_table_is_recorded_not_applied() -> None:
    state = RoutingState(parse_config(CONFIG), now=0.0)
    state.on_table(_table(enforce=False), None, now=1.0)
    assert state.state == "advisory" and state.view.version == 1
    assert [t.name for t in state.view.prefill] == ["p0", "p1"]


# -- tracing -------------------------------------------------------------------------------------


class _SlowExporter(SpanExporter):
    def __init__(self) -> None:
        self.batches: list[int] = []

    def export(self, spans):  # type: ignore[no-untyped-def]
        self.batches.append(len(spans))
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        pass


def test_span_queue_is_bounded_and_counts_drops_and_failures() -> None:
    exporter = _SlowExporter()
    provider, proc = make_provider(exporter, max_queue=10, max_batch=1000, interval_s=60.0)
    tracer = provider.get_tracer("t")
    for _ in range(25):
        tracer.start_span("s").end()
    assert proc.dropped == 15
    assert not proc.force_flush()  # the batch failed: held for a retry, not dropped
    assert exporter.batches == [10] and proc.failed == 10 and proc.exported == 0
    assert proc.queued == 10 and proc.dropped == 15
    provider.shutdown()
    assert proc.dropped == 25  # still undelivered at shutdown: counted as lost


def test_traceparent_round_trip() -> None:
    provider, _ = make_provider(_SlowExporter(), interval_s=60.0)
    span = provider.get_tracer("t").start_span("s")
    tp = traceparent(span)
    assert tp is not None and tp.startswith("00-") and tp[-3:] in ("-01", "-03") and len(tp) == 55
    ctx = parse_traceparent(tp)
    child = provider.get_tracer("t").start_span("c", context=ctx)
    assert child.get_span_context().trace_id == span.get_span_context().trace_id
    assert parse_traceparent("00-" + "0" * 32 + "-" + "1" * 16 + "-01") is None
    assert parse_traceparent("garbage") is None
    provider.shutdown()


# -- streamed answers ----------------------------------------------------------------------


def test_sse_watch_sees_tokens_errors_and_done_across_chunk_boundaries() -> None:
    w = protocol.SseWatch()
    stream = (
        b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
        b'data: {"choices":[{"text":"error"}]}\n\n'  # a token whose text is "error"
        b'data: {"error": {"message": "boom"}}\r\n\r\n'
        b"data: [DONE]\n\n"
    )
    for i in range(0, len(stream), 7):  # split mid-line everywhere
        w.feed(stream[i : i + 7])
    assert w.events == 1 and w.error == b'{"error": {"message": "boom"}}' and w.done


def test_sse_watch_older_vllm_error_shape_and_bounded_lines() -> None:
    w = protocol.SseWatch(max_line=64)
    w.feed(b'data: {"object": "error", "message": "x"}\n\n')
    assert w.error is not None and w.events == 0
    w = protocol.SseWatch(max_line=64)
    w.feed(b"data: " + b"x" * 100)  # over the bound: not kept
    w.feed(b"y" * 100)
    w.feed(b"\n\ndata: [DONE]\n\n")
    assert w.events == 1 and w.done and w.error is None


def test_the_role_preamble_is_not_a_token_but_a_role_chunk_with_content_is() -> None:
    assert protocol.is_preamble_event(b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}')
    assert not protocol.is_preamble_event(
        b'{"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"}}]}'
    )
    assert not protocol.is_preamble_event(b'{"choices":[{"text":"role"}]}')


def test_sse_watch_reads_completion_tokens_from_the_usage_event() -> None:
    w = protocol.SseWatch()
    w.feed(b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [], "usage": {"prompt_tokens": 3, ')
    assert w.completion_tokens is None
    w.feed(b'"completion_tokens": 7}}\n\ndata: [DONE]\n\n')
    assert w.completion_tokens == 7 and w.events == 2 and w.done
    w = protocol.SseWatch()
    w.feed(b'data: {"choices": [{"text": "\\"completion_tokens\\""}]}\n\n')  # in the text, no usage
    w.feed(b'data: {"usage": {"completion_tokens": "many"}}\n\ndata: [DONE]\n\n')
    assert w.completion_tokens is None and w.events == 2
