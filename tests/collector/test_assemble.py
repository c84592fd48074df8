"""Request records from traces: the pure assembly and the store sink (pieces over several exports)."""

from __future__ import annotations

import dataclasses
import random

import pytest
from sqlalchemy import func, select

from collector.assemble import assemble
from collector.otlp import SpanData, SpanEvent, decode_export
from collector.record import ASSEMBLED_COLUMNS, AssembledRecord
from collector.sink import EVENTS_KEY, StoreSink, read_events, stored_events
from pdscope import semconv as sc
from pdscope.config import LatencySLO, SLOSettings
from store.db import make_engine, session_factory
from store.migrate import upgrade
from store.models import RequestRecord, SpanRow
from tests.collector.traces import request_spans, to_proto

T0 = 1_800_000_000.0
SLO = SLOSettings(ttft=LatencySLO(target_ms=600), tpot=LatencySLO(target_ms=150))


def _assembled(spans: list[SpanData], slo: SLOSettings = SLO) -> AssembledRecord:
    rec = assemble(spans, slo)
    assert rec is not None
    return rec


def test_all_stages_from_proxy_and_vllm_spans() -> None:
    v = _assembled(request_spans(t0=T0, request_id="r1"))
    assert v.request_id == "r1"
    assert (v.p_instance, v.d_instance, v.p_pool, v.d_pool) == ("p0", "d0", "prefill", "decode")
    assert v.proxy_in == T0
    assert v.p_sent == pytest.approx(T0 + 0.01)
    assert v.p_done == pytest.approx(T0 + 0.21)
    assert v.d_sent == pytest.approx(T0 + 0.22)
    assert v.first_token == pytest.approx(T0 + 0.51)
    assert v.done == pytest.approx(T0 + 1.52)
    assert v.p_queue_s == 0.03 and v.p_prefill_s == 0.12
    assert v.d_queue_s == 0.25 and v.d_prefill_s == 0.01 and v.d_decode_s == 0.99
    assert v.prompt_tokens == 100 and v.completion_tokens == 11
    assert v.ttft_s == pytest.approx(0.51)
    assert v.tpot_s == pytest.approx((1.52 - 0.51) / 10)
    assert v.e2e_s == pytest.approx(1.52)
    assert v.slo_ttft_met and v.slo_tpot_met and v.slo_met
    assert v.status == "ok" and v.kv_blocks == 4 and v.kv_bytes == 123456
    assert v.attributes.d_vllm is not None and v.attributes.d_vllm.request_id == "cmpl-r1-0"


def test_slo_misses_and_outcomes() -> None:
    tight = SLOSettings(ttft=LatencySLO(target_ms=100), tpot=LatencySLO(target_ms=150))
    v = _assembled(request_spans(t0=T0), tight)
    assert v.slo_ttft_met is False and v.slo_met is False
    v = _assembled(request_spans(t0=T0, outcome="error"))
    assert v.status == "error" and v.slo_met is False


def test_no_root_no_record_and_order_does_not_matter() -> None:
    spans = request_spans(t0=T0, request_id="r2")
    assert assemble([s for s in spans if s.name != sc.SPAN_REQUEST], SLO) is None
    shuffled = spans[:]
    random.Random(4).shuffle(shuffled)
    assert assemble(shuffled, SLO) == assemble(spans, SLO)


def test_vllm_spans_found_without_parenting() -> None:
    """A proxy that does not parent vLLM's spans under its prefill/decode spans: service names decide."""
    v = _assembled(request_spans(t0=T0, parent_vllm=False))
    assert v.p_queue_s == 0.03 and v.d_queue_s == 0.25
    # and without service names either: the max_tokens=1 span is P's
    spans = [
        dataclasses.replace(s, service=None) if s.name == sc.VLLM_SPAN else s
        for s in request_spans(t0=T0, parent_vllm=False)
    ]
    v = _assembled(spans)
    assert v.p_queue_s == 0.03 and v.d_queue_s == 0.25


def test_first_token_from_vllm_when_the_proxy_has_no_event() -> None:
    spans = [
        dataclasses.replace(s, events=()) if s.name == sc.SPAN_DECODE else s for s in request_spans(t0=T0)
    ]
    spans = [s for s in spans if s.name != sc.SPAN_HANDOFF]
    v = _assembled(spans)
    assert v.first_token == pytest.approx(T0 + 0.23 + 0.28)


def _sink(url: str) -> StoreSink:
    upgrade(url)
    return StoreSink(session_factory(make_engine(url)), SLO, clock=lambda: T0 + 10)


def test_sink_builds_a_record_when_the_root_arrives_and_updates_it_later(store_url: str) -> None:
    sink = _sink(store_url)
    spans = request_spans(t0=T0, request_id="r3")
    proxy = [s for s in spans if s.name != sc.VLLM_SPAN]
    vllm = [s for s in spans if s.name == sc.VLLM_SPAN]
    assert sink.write(vllm[:1]).records == 0  # P's span first: no root yet, kept
    res = sink.write(proxy)
    assert res.written == len(proxy) and res.records == 1
    with sink.factory() as s:
        rec = s.scalars(select(RequestRecord)).one()
        assert rec.p_queue_s == 0.03 and rec.d_queue_s is None
    assert sink.write(vllm[1:]).records == 1  # D's span later: the record is updated
    with sink.factory() as s:
        rec = s.scalars(select(RequestRecord)).one()
        assert rec.d_queue_s == 0.25 and rec.completion_tokens == 11
        assert s.scalar(select(func.count()).select_from(SpanRow)) == len(spans)
        first_token = next(r for r in s.scalars(select(SpanRow).where(SpanRow.name == sc.SPAN_DECODE)))
        assert first_token.attributes["otel.events"][0]["name"] == "first_token"


def test_sink_many_traces_in_one_batch(store_url: str) -> None:
    sink = _sink(store_url)
    batch = [s for i in range(50) for s in request_spans(t0=T0 + i, request_id=f"m{i}")]
    res = sink.write(batch)
    assert res.written == 350 and res.records == 50
    with sink.factory() as s:
        assert s.scalar(select(func.count()).select_from(RequestRecord)) == 50
        assert (
            s.scalar(select(func.count()).select_from(RequestRecord).where(RequestRecord.slo_met.is_(True)))
            == 50
        )


def test_sink_reports_store_failure(tmp_path: object) -> None:
    sink = StoreSink(session_factory(make_engine("sqlite:////nonexistent-dir/x.db")), SLO)
    res = sink.write(request_spans())
    assert res.written == 0 and res.failed == 7 and res.error


def test_tokens_from_the_proxy_when_vllm_sent_no_spans() -> None:
    spans = request_spans(t0=T0, with_vllm=False)
    root = spans[0]
    spans[0] = dataclasses.replace(
        root, attributes={**root.attributes, sc.PROMPT_TOKENS: 42, sc.COMPLETION_TOKENS: 11}
    )
    v = _assembled(spans)
    assert v.prompt_tokens == 42 and v.completion_tokens == 11
    assert v.p_queue_s is None and v.d_queue_s is None
    assert v.first_token == pytest.approx(T0 + 0.51)  # from the proxy's first_token event
    assert v.tpot_s == pytest.approx((1.52 - 0.51) / 10)


def test_kv_size_from_the_handoff_span() -> None:
    spans = request_spans(t0=T0)
    root = spans[0]
    attrs = {k: v for k, v in root.attributes.items() if k not in (sc.KV_BLOCKS, sc.KV_BYTES)}
    spans[0] = dataclasses.replace(root, attributes=attrs)
    spans = [
        dataclasses.replace(s, attributes={sc.KV_BLOCKS: 7, sc.KV_BYTES: 999})
        if s.name == sc.SPAN_HANDOFF
        else s
        for s in spans
    ]
    v = _assembled(spans)
    assert v.kv_blocks == 7 and v.kv_bytes == 999


def test_events_come_back_from_the_store_in_the_shape_they_arrived() -> None:
    events = (SpanEvent(sc.EVENT_FIRST_TOKEN, T0 + 0.6, {"n": 1}), SpanEvent("other", T0 + 0.7, {}))
    stored = {"k": 1, EVENTS_KEY: [*stored_events(events), {"name": "bad", "ts": None}, {"ts": T0}, "junk"]}
    attrs, back = read_events(stored)
    assert attrs == {"k": 1}
    assert back == (SpanEvent(sc.EVENT_FIRST_TOKEN, T0 + 0.6, {}), SpanEvent("other", T0 + 0.7, {}))
    assert read_events({"k": 1}) == ({"k": 1}, ())


def test_a_record_reassembled_from_stored_spans_reads_their_events(store_url: str) -> None:
    """The decode span's first_token event (here later than vLLM's TTFT implies) survives the store."""
    sink = _sink(store_url)
    spans = [
        dataclasses.replace(s, events=(SpanEvent(sc.EVENT_FIRST_TOKEN, T0 + 0.6, {}),))
        if s.name == sc.SPAN_DECODE
        else s
        for s in request_spans(t0=T0, request_id="ev")
    ]
    assert _assembled(spans).first_token == pytest.approx(T0 + 0.6)
    sink.write([s for s in spans if s.name != sc.VLLM_SPAN])
    sink.write([s for s in spans if s.name == sc.VLLM_SPAN])  # re-assembled from the stored proxy spans
    with sink.factory() as s:
        rec = s.scalars(select(RequestRecord)).one()
    assert rec.d_queue_s == 0.25 and rec.first_token == pytest.approx(T0 + 0.6)


# -- a record from the root span alone (sampling: an unsampled request exports only its root) ---------

# Only vLLM's llm_request spans give these; every other column the root carries too.
FROM_VLLM_ONLY = frozenset({"p_queue_s", "p_prefill_s", "d_queue_s", "d_prefill_s", "d_decode_s"})
# A stream without a usage event (no stream_options.include_usage, as request_spans' stream=True
# models): its completion tokens (and so TPOT) are only D's vLLM span's.
STREAM_FROM_VLLM_ONLY = frozenset({"completion_tokens", "tpot_s"})


def _over_the_wire(spans: list[SpanData]) -> list[SpanData]:
    """As the collector gets them: OTLP protobuf, timestamps in Unix ns."""
    return decode_export(to_proto(spans), "application/x-protobuf").spans


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("with_vllm", [True, False])
def test_the_root_alone_gives_the_same_record_for_every_column_it_carries(
    stream: bool, with_vllm: bool
) -> None:
    spans = _over_the_wire(request_spans(t0=T0, request_id="ro", stream=stream, with_vllm=with_vllm))
    full = _assembled(spans)
    alone = _assembled([s for s in spans if s.name == sc.SPAN_REQUEST])
    child_only = FROM_VLLM_ONLY | (STREAM_FROM_VLLM_ONLY if stream else frozenset())
    for column in ASSEMBLED_COLUMNS:
        if column == "attributes":
            continue
        if column in child_only and with_vllm:
            assert getattr(alone, column) is None, column
            continue
        assert getattr(alone, column) == getattr(full, column), column
    # every stage column is filled, from the root's own timestamps
    assert (alone.p_sent, alone.p_done, alone.d_sent, alone.first_token) == (
        full.p_sent,
        full.p_done,
        full.d_sent,
        full.first_token,
    )
    assert alone.first_token == pytest.approx(T0 + 0.51) and alone.ttft_s == pytest.approx(0.51)
    a, f = alone.attributes, full.attributes
    assert (a.reject_reason, a.remote_engine_id) == (f.reject_reason, f.remote_engine_id)
    assert a.spans == 1 and a.p_vllm is None and a.d_vllm is None  # vLLM's request ids: only its spans


def test_children_are_preferred_over_the_roots_timestamps() -> None:
    """A root whose stage timestamps disagree with its children: the children's win."""
    spans = request_spans(t0=T0)
    root = spans[0]
    off = {k: root.attributes[k] + 5_000_000 for k in (sc.P_SENT_NS, sc.P_DONE_NS, sc.D_SENT_NS)}
    spans[0] = dataclasses.replace(root, attributes={**root.attributes, **off, sc.FIRST_TOKEN_NS: 1})
    v = _assembled(spans)
    assert v.p_sent == pytest.approx(T0 + 0.01) and v.p_done == pytest.approx(T0 + 0.21)
    assert v.d_sent == pytest.approx(T0 + 0.22) and v.first_token == pytest.approx(T0 + 0.51)
    alone = _assembled(spans[:1])
    assert alone.p_sent == pytest.approx(T0 + 0.015) and alone.first_token == pytest.approx(1e-9)


@pytest.mark.parametrize("bad", ["soon", -1, 0, 2**63, float("nan"), True, {"ns": 1}])
def test_a_bad_stage_timestamp_on_the_root_costs_only_itself(bad: object) -> None:
    root = request_spans(t0=T0)[0]
    v = _assembled([dataclasses.replace(root, attributes={**root.attributes, sc.P_SENT_NS: bad})])
    assert v.p_sent is None and v.p_done == pytest.approx(T0 + 0.21)


def test_a_rejected_request_from_its_root_alone() -> None:
    root = request_spans(t0=T0)[0]
    keep = (sc.REQUEST_ID, sc.ENDPOINT, sc.STREAM, sc.RETRIES)
    attrs = {k: root.attributes[k] for k in keep}
    attrs.update({sc.OUTCOME: "rejected", sc.HTTP_STATUS: 429, sc.REJECT_REASON: "max_inflight_requests"})
    v = _assembled([dataclasses.replace(root, attributes=attrs, end_ts=T0 + 0.01, status_code=2)])
    assert v.status == "rejected" and v.http_status == 429 and v.slo_met is False
    assert v.attributes.reject_reason == "max_inflight_requests"
    assert v.p_sent is None and v.first_token is None and v.ttft_s is None
