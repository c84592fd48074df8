"""Trace sampling in the proxy (``proxy.trace_sample_ratio``): which spans leave, what vLLM is told.

Through the proxy's own provider and processor (``proxy.tracing``) into an in-memory exporter. An
unsampled request exports its root only, unless it failed or missed the TTFT SLO; the ``traceparent``
sent to P and D carries the head decision; the root alone makes the same request record.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from collector.assemble import assemble
from collector.otlp import decode_export
from collector.record import ASSEMBLED_COLUMNS
from pdscope import semconv as sc
from pdscope.config import LatencySLO, SLOSettings
from proxy.tracing import head_sampled, make_provider
from tests.proxy.memory import MemoryProxy, MemVLLM, memory_flow, memory_settings

CHILDREN = {sc.SPAN_ADMISSION, sc.SPAN_PREFILL, sc.SPAN_HANDOFF, sc.SPAN_DECODE}
EVERY = {sc.SPAN_REQUEST, *CHILDREN}
CALLER = "0af7651916cd43dd8448eb211c80319c"


class Made:
    """The proxies a test made, shut down at its end (each has an export thread)."""

    def __init__(self) -> None:
        self.proxies: list[MemoryProxy] = []

    def __call__(
        self,
        ratio: float,
        *,
        p_mode: str = "ok",
        d_mode: str = "ok",
        ttft_ms: float = 600_000.0,  # far over any in-memory TTFT: only the failure rule keeps children
        prefill_s: float = 5.0,
        healthy_p: bool = False,  # a second P, p1, that answers
    ) -> tuple[MemoryProxy, InMemorySpanExporter, MemVLLM, MemVLLM]:
        p, d = MemVLLM("p0", "prefill", mode=p_mode), MemVLLM("d0", "decode", mode=d_mode)
        ps = [p, MemVLLM("p1", "prefill")] if healthy_p else [p]
        timeouts = {"connect_s": 1, "prefill_s": prefill_s, "decode_first_token_s": 5, "decode_total_s": 10}
        settings = memory_settings(
            {"prefill": ("prefill", ps), "decode": ("decode", [d])},
            proxy={"trace_sample_ratio": ratio, "timeouts": timeouts},
        )
        settings = settings.model_copy(update={"slo": SLOSettings(ttft=LatencySLO(target_ms=ttft_ms))})
        spans = InMemorySpanExporter()
        proxy = memory_flow(settings, [*ps, d], spans, bounded=True)
        self.proxies.append(proxy)
        return proxy, spans, p, d


@pytest.fixture
def made() -> Iterator[Made]:
    m = Made()
    yield m
    for proxy in m.proxies:
        assert proxy.processor is not None
        proxy.processor.shutdown()


def _exported(proxy: MemoryProxy, spans: InMemorySpanExporter) -> list[ReadableSpan]:
    assert proxy.processor is not None and proxy.processor.force_flush()
    return list(spans.get_finished_spans())


def _names(exported: list[ReadableSpan]) -> set[str]:
    return {s.name for s in exported}


def _root(exported: list[ReadableSpan]) -> ReadableSpan:
    (root,) = [s for s in exported if s.name == sc.SPAN_REQUEST]
    return root


def _flag(inst: MemVLLM, call: int = 0) -> str:
    """The sampled flag of the traceparent ``inst`` got."""
    tp = inst.calls[call]["headers"]["traceparent"]
    return str(tp.rsplit("-", 1)[1])


async def test_ratio_one_exports_every_span_and_tells_vllm_sampled(made: Made) -> None:
    proxy, spans, p, d = made(1.0)
    assert (await proxy.send()).status == 200
    exported = _exported(proxy, spans)
    assert _names(exported) == EVERY and len(exported) == 5
    root = _root(exported)
    assert (root.attributes or {})[sc.SAMPLED] is True and sc.KEEP not in (root.attributes or {})
    assert _flag(p) == _flag(d) == "01"
    assert proxy.processor is not None and proxy.processor.unsampled == 0


async def test_ratio_zero_exports_the_root_only_and_tells_vllm_not_sampled(made: Made) -> None:
    proxy, spans, p, d = made(0.0)
    assert (await proxy.send()).status == 200
    exported = _exported(proxy, spans)
    assert _names(exported) == {sc.SPAN_REQUEST} and len(exported) == 1
    attrs = _root(exported).attributes or {}
    assert attrs[sc.SAMPLED] is False and sc.KEEP not in attrs and attrs[sc.OUTCOME] == "ok"
    # the root still carries every stage, in order
    stages = [attrs[k] for k in (sc.P_SENT_NS, sc.P_DONE_NS, sc.D_SENT_NS, sc.FIRST_TOKEN_NS)]
    assert stages == sorted(stages) and all(isinstance(t, int) for t in stages)
    assert _flag(p) == _flag(d) == "00"
    # the same trace id goes to P and D as the root's, with the flag off
    trace_id = f"{_root(exported).context.trace_id:032x}"
    assert p.calls[0]["headers"]["traceparent"].split("-")[1] == trace_id
    assert proxy.processor is not None
    assert proxy.processor.unsampled == 4 and proxy.processor.buffered == 0 and proxy.processor.dropped == 0


@pytest.mark.parametrize(
    "p_mode,d_mode,status,outcome",
    [("error500", "ok", 502, "error"), ("ok", "error500", 502, "error"), ("hang", "ok", 504, "timeout")],
)
async def test_ratio_zero_keeps_every_span_of_a_failed_request(
    made: Made, p_mode: str, d_mode: str, status: int, outcome: str
) -> None:
    proxy, spans, p, _d = made(0.0, p_mode=p_mode, d_mode=d_mode, prefill_s=0.05)
    reply = await proxy.send()
    assert reply.status == status
    exported = _exported(proxy, spans)
    attrs = _root(exported).attributes or {}
    assert attrs[sc.OUTCOME] == outcome and attrs[sc.KEEP] == sc.KEEP_FAILED
    assert {sc.SPAN_ADMISSION, sc.SPAN_PREFILL} <= _names(exported)
    if d_mode != "ok":
        assert {sc.SPAN_HANDOFF, sc.SPAN_DECODE} <= _names(exported)
    assert _flag(p) == "00"  # decided at the start: vLLM was not asked to trace it
    assert proxy.processor is not None and proxy.processor.unsampled == 0


async def test_ratio_zero_keeps_the_spans_of_a_retried_request_and_only_those(made: Made) -> None:
    """p0 fails, p1 answers: a request that picked p0 first was retried and served; its failed
    attempt's span is what the collector's forensics reads, so its children are kept."""
    proxy, spans, _p, _d = made(0.0, p_mode="error500", healthy_p=True)
    for _ in range(20):
        assert (await proxy.send()).status == 200
    exported = _exported(proxy, spans)
    roots = [s for s in exported if s.name == sc.SPAN_REQUEST]
    assert len(roots) == 20
    children: dict[int, list[str]] = {}
    for s in exported:
        if s.parent is not None and s.name != sc.SPAN_REQUEST:
            children.setdefault(s.context.trace_id, []).append(s.name)
    retried = [r for r in roots if (r.attributes or {})[sc.RETRIES]]
    assert retried, "no request picked the failing P first"
    for root in roots:
        attrs = root.attributes or {}
        kept = children.get(root.context.trace_id, [])
        if attrs[sc.RETRIES]:
            assert attrs[sc.KEEP] == sc.KEEP_RETRIED and kept.count(sc.SPAN_PREFILL) == 2
        else:
            assert sc.KEEP not in attrs and kept == []


async def test_ratio_zero_keeps_every_span_of_a_request_over_the_ttft_slo(made: Made) -> None:
    proxy, spans, _p, _d = made(0.0, ttft_ms=0.001)  # 1 microsecond: every request misses it
    assert (await proxy.send()).status == 200
    exported = _exported(proxy, spans)
    assert _names(exported) == EVERY
    assert (_root(exported).attributes or {})[sc.KEEP] == sc.KEEP_SLOW


async def test_a_client_error_is_not_kept_for_being_slow(made: Made) -> None:
    proxy, spans, _p, _d = made(0.0, ttft_ms=0.001)
    assert (await proxy.send({"model": "fake", "prompt": "x", "max_tokens": -1})).status == 400
    exported = _exported(proxy, spans)
    assert _names(exported) == {sc.SPAN_REQUEST}
    assert sc.KEEP not in (_root(exported).attributes or {})


async def test_a_callers_sampled_traceparent_is_followed(made: Made) -> None:
    proxy, spans, p, d = made(0.0)
    reply = await proxy.send(headers={b"traceparent": f"00-{CALLER}-b7ad6b7169203331-01".encode()})
    assert reply.status == 200
    exported = _exported(proxy, spans)
    assert _names(exported) == EVERY
    assert f"{_root(exported).context.trace_id:032x}" == CALLER
    assert _flag(p) == _flag(d) == "01"


async def test_a_callers_unsampled_traceparent_still_gets_a_root(made: Made) -> None:
    """The caller said not sampled: the proxy still records its root (every request gets a record) and
    the ratio decides the rest."""
    proxy, spans, p, _d = made(1.0)
    reply = await proxy.send(headers={b"traceparent": f"00-{CALLER}-b7ad6b7169203331-00".encode()})
    assert reply.status == 200
    exported = _exported(proxy, spans)
    assert _names(exported) == EVERY and f"{_root(exported).context.trace_id:032x}" == CALLER
    assert _flag(p) == "01"


async def test_concurrent_unsampled_requests_leave_nothing_held(made: Made) -> None:
    proxy, spans, _p, _d = made(0.0)
    replies = await asyncio.gather(*(proxy.send() for _ in range(20)))
    assert [r.status for r in replies] == [200] * 20
    exported = _exported(proxy, spans)
    assert _names(exported) == {sc.SPAN_REQUEST} and len(exported) == 20
    assert proxy.processor is not None
    assert proxy.processor.unsampled == 80 and proxy.processor.buffered == 0


async def test_the_roots_stage_timestamps_are_its_childrens(made: Made) -> None:
    proxy, spans, _p, _d = made(1.0)
    await proxy.send()
    by_name = {s.name: s for s in _exported(proxy, spans)}
    attrs = by_name[sc.SPAN_REQUEST].attributes or {}
    prefill, decode = by_name[sc.SPAN_PREFILL], by_name[sc.SPAN_DECODE]
    assert attrs[sc.P_SENT_NS] == prefill.start_time and attrs[sc.P_DONE_NS] == prefill.end_time
    assert attrs[sc.D_SENT_NS] == decode.start_time
    assert attrs[sc.FIRST_TOKEN_NS] == decode.events[0].timestamp == by_name[sc.SPAN_HANDOFF].end_time


@pytest.mark.parametrize("stream,usage", [(False, False), (True, False), (True, True)])
async def test_the_proxys_root_alone_makes_the_same_record(made: Made, stream: bool, usage: bool) -> None:
    """What the proxy exports, through OTLP and the collector's decoder: every column of the record from
    the root alone equals the one from all the proxy's spans (no vLLM spans here)."""
    proxy, spans, _p, _d = made(1.0)
    body: dict[str, object] = {"model": "fake", "prompt": "the quick brown fox", "max_tokens": 8}
    body["stream"] = stream
    if usage:
        body["stream_options"] = {"include_usage": True}
    assert (await proxy.send(body)).status == 200
    decoded = decode_export(
        encode_spans(_exported(proxy, spans)).SerializeToString(), "application/x-protobuf"
    ).spans
    slo = SLOSettings()
    full = assemble(decoded, slo)
    alone = assemble([s for s in decoded if s.name == sc.SPAN_REQUEST], slo)
    assert full is not None and alone is not None
    for column in ASSEMBLED_COLUMNS:
        if column != "attributes":
            assert getattr(alone, column) == getattr(full, column), column
    assert alone.p_sent is not None and alone.first_token is not None and alone.d_sent is not None
    # tokens (and so TPOT): D's usage, read from the answer, or from a stream's usage event
    assert (alone.completion_tokens is None) == (stream and not usage)
    assert (alone.tpot_s is None) == (stream and not usage)
    assert alone.attributes == type(full.attributes)(**{**_fields(full.attributes), "spans": 1})


def _fields(notes: object) -> dict[str, object]:
    return {k: getattr(notes, k) for k in ("spans", "p_vllm", "d_vllm", "reject_reason", "remote_engine_id")}


def test_held_children_are_bounded_oldest_trace_first_and_counted() -> None:
    spans = InMemorySpanExporter()
    provider, processor = make_provider(spans, interval_s=3600.0, max_buffered=2)
    tracer = provider.get_tracer("test")
    try:
        roots = []
        for n_children in (2, 1):  # trace A holds 2, then B's one child goes over the bound
            root = tracer.start_span(sc.SPAN_REQUEST)
            root.set_attribute(sc.SAMPLED, False)
            for _ in range(n_children):
                tracer.start_span(sc.SPAN_PREFILL, context=trace.set_span_in_context(root)).end()
            roots.append(root)
        assert processor.buffered == 1 and processor.buffer_dropped == 2 and processor.dropped == 2
        for root in roots:
            root.set_attribute(sc.KEEP, sc.KEEP_FAILED)
            root.end()
        assert processor.force_flush()
        got = spans.get_finished_spans()
        assert [s.name for s in got] == [sc.SPAN_REQUEST, sc.SPAN_PREFILL, sc.SPAN_REQUEST]
        assert processor.buffered == 0 and processor.unsampled == 0
    finally:
        processor.shutdown()


def test_head_sampling_keeps_the_ratio_and_decides_the_same_way_for_a_trace_id() -> None:
    rng = random.Random(16)
    ids = [rng.getrandbits(128) for _ in range(4000)]
    kept = sum(head_sampled(t, 0.25) for t in ids)
    assert 0.2 * len(ids) < kept < 0.3 * len(ids)
    assert [head_sampled(t, 0.25) for t in ids] == [head_sampled(t, 0.25) for t in ids]
    assert not any(head_sampled(t, 0.0) for t in ids) and all(head_sampled(t, 1.0) for t in ids)
    assert all(head_sampled(t, 0.0, parent_sampled=True) for t in ids[:10])
    # a lower ratio keeps a subset of what a higher one keeps
    assert {t for t in ids if head_sampled(t, 0.1)} <= {t for t in ids if head_sampled(t, 0.25)}
