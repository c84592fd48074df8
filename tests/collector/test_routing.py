"""KV-aware routing on request records: the root's route path, predicted and reported cached tokens
and matched prefix, each checked (a bad one is left out, named and counted), and decode-only
requests (no P at all) assembled like any other."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
from sqlalchemy import select

from collector.assemble import Routing, assemble, routing
from collector.otlp import SpanData
from collector.receiver import SpanBatcher
from collector.record import AssembledRecord
from collector.rootattrs import MAX_TOKENS
from collector.selfmetrics import CollectorMetrics
from collector.sink import StoreSink, WriteResult
from collector.spool import Spool
from pdscope import semconv as sc
from pdscope.config import LatencySLO, SLOSettings
from store.db import make_engine, session_factory
from store.migrate import upgrade
from store.models import RequestRecord
from tests.collector.traces import decode_only_spans, request_spans

T0 = 1_800_000_000.0
SLO = SLOSettings(ttft=LatencySLO(target_ms=600), tpot=LatencySLO(target_ms=150))
KV_ROUTED = {
    sc.ROUTE_PATH: sc.ROUTE_PD,
    sc.P_PREDICTED_CACHED: 64,
    sc.D_PREDICTED_CACHED: 16,
    sc.P_CACHED_TOKENS: 48,
    sc.D_CACHED_TOKENS: 100,
    sc.PREFIX_KEY: "9F86D081884C7D65",
    sc.PREFIX_TOKENS: 64,
    sc.ROUTE_REASON: "prefix_affinity",
    sc.HANDOFF: sc.HANDOFF_PUSH_EARLY,
}


def _assembled(spans: list[SpanData]) -> AssembledRecord:
    rec = assemble(spans, SLO)
    assert rec is not None
    return rec


def _with_root(attrs: dict[str, Any]) -> list[SpanData]:
    return request_spans(t0=T0, request_id="kv", root_attributes=attrs)


def test_a_kv_routed_request_keeps_its_route_and_cache_figures() -> None:
    v = _assembled(_with_root(KV_ROUTED))
    assert v.route_path == "pd"
    assert (v.p_predicted_cached_tokens, v.d_predicted_cached_tokens) == (64, 16)
    assert (v.p_cached_tokens, v.d_cached_tokens) == (48, 100)
    assert (v.prefix_key, v.prefix_tokens) == ("9f86d081884c7d65", 64)  # stored in lower case
    assert v.handoff == sc.HANDOFF_PUSH_EARLY
    assert v.attributes.dropped == () and "dropped_attributes" not in v.attributes.to_json()
    # the root alone (an unsampled request) gives the same figures
    alone = _assembled([s for s in _with_root(KV_ROUTED) if s.name == sc.SPAN_REQUEST])
    assert (alone.route_path, alone.p_cached_tokens, alone.prefix_key) == ("pd", 48, "9f86d081884c7d65")


def test_a_request_without_kv_aware_routing_has_none_of_them() -> None:
    v = _assembled(request_spans(t0=T0))
    assert routing({}) == Routing()
    assert v.route_path is None and v.prefix_key is None and v.p_cached_tokens is None
    assert v.attributes.dropped == ()


@pytest.mark.parametrize(
    ("key", "value", "stored"),
    [
        (sc.P_CACHED_TOKENS, 0, 0),
        (sc.P_CACHED_TOKENS, MAX_TOKENS, MAX_TOKENS),
        (sc.P_CACHED_TOKENS, 32.0, 32),  # an integral float (a JSON exporter's number)
        (sc.P_CACHED_TOKENS, "32", 32),
        (sc.P_CACHED_TOKENS, -1, None),
        (sc.P_CACHED_TOKENS, MAX_TOKENS + 1, None),
        (sc.P_CACHED_TOKENS, 2**63, None),
        (sc.P_CACHED_TOKENS, 3.5, None),
        (sc.P_CACHED_TOKENS, float("nan"), None),
        (sc.P_CACHED_TOKENS, float("inf"), None),
        (sc.P_CACHED_TOKENS, True, None),
        (sc.P_CACHED_TOKENS, "many", None),
        (sc.P_CACHED_TOKENS, [1, 2], None),
        (sc.D_PREDICTED_CACHED, -5, None),
        (sc.PREFIX_TOKENS, {"n": 1}, None),
        (sc.PREFIX_KEY, "abc", "abc"),
        (sc.PREFIX_KEY, "0123456789abcdef", "0123456789abcdef"),
        (sc.PREFIX_KEY, "0123456789abcdef0", None),  # longer than 8 bytes
        (sc.PREFIX_KEY, "", None),
        (sc.PREFIX_KEY, "not-hex!", None),
        (sc.PREFIX_KEY, "12ab\n", None),
        (sc.PREFIX_KEY, 1234, None),  # a number is not a hex key
        (sc.ROUTE_PATH, "decode_only", "decode_only"),
        (sc.ROUTE_PATH, "pd", "pd"),
        (sc.ROUTE_PATH, "PD", None),
        (sc.ROUTE_PATH, "prefill_only", None),
        (sc.ROUTE_PATH, 1, None),
        (sc.HANDOFF, "pull", "pull"),
        (sc.HANDOFF, "push", "push"),
        (sc.HANDOFF, "PUSH", None),
        (sc.HANDOFF, "teleport", None),
        (sc.HANDOFF, 2, None),
    ],
)
def test_each_attribute_is_checked_and_a_bad_one_costs_only_itself(key: str, value: Any, stored: Any) -> None:
    column = {
        sc.P_CACHED_TOKENS: "p_cached_tokens",
        sc.D_PREDICTED_CACHED: "d_predicted_cached_tokens",
        sc.PREFIX_TOKENS: "prefix_tokens",
        sc.PREFIX_KEY: "prefix_key",
        sc.ROUTE_PATH: "route_path",
        sc.HANDOFF: "handoff",
    }[key]
    v = _assembled(_with_root({**KV_ROUTED, key: value}))
    assert getattr(v, column) == stored
    assert v.attributes.dropped == (() if stored is not None else (key,))
    # every other figure is kept
    others = dataclasses.asdict(routing(KV_ROUTED))
    for name, want in others.items():
        if name not in (column, "dropped"):
            assert getattr(v, name) == want, name
    if stored is None:
        assert v.attributes.to_json()["dropped_attributes"] == [key]


def test_several_bad_attributes_are_all_named() -> None:
    r = routing({sc.ROUTE_PATH: "sideways", sc.P_CACHED_TOKENS: -1, sc.PREFIX_KEY: "zz", sc.PREFIX_TOKENS: 7})
    assert r.dropped == (sc.ROUTE_PATH, sc.P_CACHED_TOKENS, sc.PREFIX_KEY)
    assert r.prefix_tokens == 7 and r.route_path is None


@pytest.mark.parametrize("parent_vllm", [True, False])
def test_a_decode_only_request_assembles_without_any_p_span(parent_vllm: bool) -> None:
    spans = decode_only_spans(t0=T0, request_id="do", parent_vllm=parent_vllm)
    assert not [s for s in spans if s.name in (sc.SPAN_PREFILL, sc.SPAN_HANDOFF)]
    v = _assembled(spans)
    assert v.route_path == "decode_only" and v.status == "ok"
    assert v.p_instance is None and v.p_pool is None and v.d_instance == "d0"
    assert (v.p_sent, v.p_done, v.p_queue_s, v.p_prefill_s) == (None, None, None, None)
    assert v.d_sent == pytest.approx(T0 + 0.22) and v.first_token == pytest.approx(T0 + 0.51)
    assert v.ttft_s == pytest.approx(0.51) and v.d_queue_s == 0.25
    assert (v.d_cached_tokens, v.d_predicted_cached_tokens, v.p_cached_tokens) == (96, 96, None)
    assert v.attributes.p_vllm is None and v.attributes.d_vllm is not None
    assert v.slo_met is True


def test_a_decode_only_one_token_request_is_not_taken_for_p() -> None:
    """Unparented, with a service name that is no instance's, max_tokens 1: on the P/D path that is
    P's span; on the decode-only path there is no P, so it is D's."""
    spans = decode_only_spans(t0=T0, request_id="one", parent_vllm=False, tokens=1)
    spans = [dataclasses.replace(s, service="vllm") if s.name == sc.VLLM_SPAN else s for s in spans]
    v = _assembled(spans)
    assert v.d_queue_s == 0.25 and v.p_queue_s is None and v.attributes.p_vllm is None


def _sink(url: str) -> StoreSink:
    upgrade(url)
    return StoreSink(session_factory(make_engine(url)), SLO, clock=lambda: T0 + 10)


def test_the_sink_stores_the_figures_and_counts_bad_attributes_once(store_url: str) -> None:
    sink = _sink(store_url)
    spans = _with_root({**KV_ROUTED, sc.P_CACHED_TOKENS: -3})
    root = [s for s in spans if s.name == sc.SPAN_REQUEST]
    rest = [s for s in spans if s.name != sc.SPAN_REQUEST]
    first = sink.write(root)
    assert first.records == 1 and first.attributes_dropped == ((sc.P_CACHED_TOKENS, 1),)
    later = sink.write(rest)  # the record is re-assembled: the same bad root is not counted again
    assert later.records == 1 and later.attributes_dropped == ()
    sink.write(decode_only_spans(t0=T0 + 1, request_id="do"))
    with sink.factory() as s:
        recs = {r.request_id: r for r in s.scalars(select(RequestRecord))}
    kv, do = recs["kv"], recs["do"]
    assert (kv.route_path, kv.p_predicted_cached_tokens, kv.p_cached_tokens) == ("pd", 64, None)
    assert (kv.prefix_key, kv.prefix_tokens, kv.d_cached_tokens) == ("9f86d081884c7d65", 64, 100)
    assert kv.attributes["dropped_attributes"] == [sc.P_CACHED_TOKENS]
    assert kv.p_queue_s == 0.03  # the children were assembled in
    assert (do.route_path, do.p_instance, do.p_sent, do.d_cached_tokens) == ("decode_only", None, None, 96)


class _DroppingSink:
    def write(self, batch: Sequence[SpanData]) -> WriteResult:
        return WriteResult(len(batch), records=1, attributes_dropped=((sc.PREFIX_KEY, 2), (sc.ROUTE_PATH, 1)))


def test_the_collector_exposes_the_dropped_attributes_by_key() -> None:
    queue, metrics = Spool.memory(10), CollectorMetrics()
    queue.append(request_spans(t0=T0))
    asyncio.run(SpanBatcher(queue, _DroppingSink(), metrics).flush())
    text = metrics.exposition().decode()
    assert f'pdscope_collector_record_attributes_dropped_total{{attribute="{sc.PREFIX_KEY}"}} 2.0' in text
    assert f'pdscope_collector_record_attributes_dropped_total{{attribute="{sc.ROUTE_PATH}"}} 1.0' in text
