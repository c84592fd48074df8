"""The TTFT predictor's attributes on request records: a root span that carries them gives a record
with them; each is checked, and a bad one is left out, named in the record's notes and counted."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from collector.assemble import assemble
from collector.predicted import MAX_SECONDS, Predicted, predicted
from collector.record import AssembledRecord
from collector.rootattrs import MAX_TOKENS
from collector.sink import StoreSink
from pdscope import semconv as sc
from pdscope.config import LatencySLO, SLOSettings
from store.db import make_engine, session_factory
from store.migrate import upgrade
from store.models import RequestRecord
from tests.collector.traces import request_spans

T0 = 1_800_000_000.0
SLO = SLOSettings(ttft=LatencySLO(target_ms=600), tpot=LatencySLO(target_ms=150))
PREDICTED = {
    sc.PREDICTED_TTFT_S: 0.42,
    sc.TTFT_TARGET_S: 0.6,
    sc.PREDICT_TOKENS_AHEAD: 8192,
    sc.PREDICT_TOKENS: 700,
    sc.PREDICT_SOURCE: sc.PREDICT_TABLE,
}
COLUMNS = {
    sc.PREDICTED_TTFT_S: "predicted_ttft_s",
    sc.TTFT_TARGET_S: "ttft_target_s",
    sc.PREDICT_TOKENS_AHEAD: "predict_tokens_ahead",
    sc.PREDICT_TOKENS: "predict_tokens",
    sc.PREDICT_SOURCE: "predict_source",
}
WANT = {COLUMNS[k]: v for k, v in PREDICTED.items()}


def _assembled(attrs: dict[str, Any], *, root_only: bool = False) -> AssembledRecord:
    spans = request_spans(t0=T0, request_id="pr", root_attributes=attrs)
    if root_only:
        spans = [s for s in spans if s.name == sc.SPAN_REQUEST]
    rec = assemble(spans, SLO)
    assert rec is not None
    return rec


def _figures(v: Any) -> dict[str, Any]:
    return {c: getattr(v, c) for c in COLUMNS.values()}


@pytest.mark.parametrize("root_only", [False, True])
def test_a_root_with_a_prediction_gives_a_record_with_it(root_only: bool) -> None:
    v = _assembled(PREDICTED, root_only=root_only)
    assert _figures(v) == WANT
    assert v.attributes.dropped == ()


def test_a_record_without_a_prediction_has_none() -> None:
    v = _assembled({})
    assert _figures(v) == dict.fromkeys(COLUMNS.values())
    assert predicted({}) == Predicted()


@pytest.mark.parametrize(
    ("key", "value", "stored"),
    [
        (sc.PREDICTED_TTFT_S, 0, 0.0),
        (sc.PREDICTED_TTFT_S, "1.5", 1.5),
        (sc.PREDICTED_TTFT_S, MAX_SECONDS, MAX_SECONDS),
        (sc.PREDICTED_TTFT_S, -0.1, None),
        (sc.PREDICTED_TTFT_S, MAX_SECONDS + 1, None),
        (sc.PREDICTED_TTFT_S, float("nan"), None),
        (sc.PREDICTED_TTFT_S, float("inf"), None),
        (sc.PREDICTED_TTFT_S, "inf", None),
        (sc.PREDICTED_TTFT_S, True, None),
        (sc.PREDICTED_TTFT_S, [0.4], None),
        (sc.TTFT_TARGET_S, -1, None),
        (sc.TTFT_TARGET_S, "soon", None),
        (sc.PREDICT_TOKENS_AHEAD, 0, 0),
        (sc.PREDICT_TOKENS_AHEAD, 64.0, 64),
        (sc.PREDICT_TOKENS_AHEAD, MAX_TOKENS + 1, None),
        (sc.PREDICT_TOKENS_AHEAD, 2.5, None),
        (sc.PREDICT_TOKENS, -1, None),
        (sc.PREDICT_TOKENS, {"n": 1}, None),
        (sc.PREDICT_SOURCE, sc.PREDICT_ONLINE, sc.PREDICT_ONLINE),
        (sc.PREDICT_SOURCE, sc.PREDICT_PRIOR, sc.PREDICT_PRIOR),
        (sc.PREDICT_SOURCE, "Table", None),
        (sc.PREDICT_SOURCE, "oracle", None),
        (sc.PREDICT_SOURCE, 1, None),
    ],
)
def test_each_attribute_is_checked_and_a_bad_one_costs_only_itself(key: str, value: Any, stored: Any) -> None:
    v = _assembled({**PREDICTED, key: value})
    assert getattr(v, COLUMNS[key]) == stored
    assert v.attributes.dropped == (() if stored is not None else (key,))
    assert {c: x for c, x in _figures(v).items() if c != COLUMNS[key]} == {
        c: x for c, x in WANT.items() if c != COLUMNS[key]
    }


def test_bad_prediction_and_routing_attributes_are_all_named() -> None:
    v = _assembled({**PREDICTED, sc.PREDICTED_TTFT_S: -1, sc.PREDICT_SOURCE: "x", sc.ROUTE_PATH: "up"})
    assert v.attributes.dropped == (sc.ROUTE_PATH, sc.PREDICTED_TTFT_S, sc.PREDICT_SOURCE)
    assert v.attributes.to_json()["dropped_attributes"] == list(v.attributes.dropped)


def test_the_sink_stores_the_prediction_and_counts_a_bad_one(store_url: str) -> None:
    upgrade(store_url)
    sink = StoreSink(session_factory(make_engine(store_url)), SLO, clock=lambda: T0 + 10)
    spans = request_spans(t0=T0, request_id="pr", root_attributes={**PREDICTED, sc.PREDICT_TOKENS_AHEAD: -5})
    result = sink.write(spans)
    assert result.records == 1 and result.attributes_dropped == ((sc.PREDICT_TOKENS_AHEAD, 1),)
    with sink.factory() as s:
        rec = s.scalars(select(RequestRecord)).one()
    assert _figures(rec) == {**WANT, "predict_tokens_ahead": None}
