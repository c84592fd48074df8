"""The TTFT predictor's fleet figures kept with the SLO window between ticks (issue 32): equal to
``analysis.prediction.measure`` over ``store.prediction.prediction_rows`` (the window's newest predicted
records, at most a limit) tick by tick, from scratch and on a store (SQLite; PostgreSQL with ``pg``)."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy.orm import Session, sessionmaker

from analysis.prediction import PredictionFacts, measure
from controller.kept import KeptReads
from controller.slowindow import SLORow, SLOWindow
from store.db import transaction
from store.prediction import prediction_rows
from store.queries import RecordFilter
from tests.controller.test_slowindow import SLO, random_ticks, store_tick, window_settings

PREDICTIONS = (None, None, 0.0, -0.1, 0.2, 0.5, 1e-300, math.inf)


def _row(rng: random.Random, rid: int, now: float) -> SLORow:
    return SLORow(
        rid,
        None if rng.random() < 0.05 else now - rng.uniform(-3.0, 45.0),
        rng.choice(("ok", "ok", "error", "rejected", None)),
        None if rng.random() < 0.2 else rng.choice([0.2, 0.5, rng.uniform(0.05, 2.0)]),
        None,
        rng.choice(["proxy-a", "proxy-b", None]),
        rng.choice(PREDICTIONS) if rng.random() < 0.7 else rng.uniform(0.05, 2.0),
    )


def _measured(rows: list[SLORow]) -> tuple[int, float | None]:
    fleet = measure(PredictionFacts(None, None, r.ttft_s, r.predicted_ttft_s, None) for r in rows).fleet
    return fleet.measured, fleet.error_p50


def oracle(
    rows: dict[int, SLORow], lo: float, hi: float, senders: frozenset[str] | None, limit: int
) -> tuple[int, float | None]:
    """What the read gives: the predicted records of the window, the newest ``limit``, measured."""
    inside = [
        r
        for r in rows.values()
        if r.proxy_in is not None
        and lo <= r.proxy_in <= hi
        and (senders is None or r.sender in senders)
        and r.predicted_ttft_s is not None
    ]
    inside.sort(key=lambda r: (r.proxy_in, r.id), reverse=True)
    return _measured(inside[:limit])


def _figures(window: SLOWindow, limit: int) -> tuple[int, float | None] | str:
    try:
        return window.prediction(limit)
    except ValueError:
        return "raises"


def _oracle_or_raises(*args: Any) -> tuple[int, float | None] | str:
    try:
        return oracle(*args)
    except ValueError:
        return "raises"


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), trusted=st.booleans(), limit=st.sampled_from([1, 4, 15, 10_000]))
def test_the_kept_prediction_equals_the_read_measured_from_scratch(
    seed: int, trusted: bool, limit: int
) -> None:
    rng = random.Random(seed)
    senders = frozenset({"proxy-a"}) if trusted else None
    window, rows, now = SLOWindow(30.0, senders, SLO), {}, 1000.0
    for now in random_ticks(rng, window, rows, _row, 1000.0):
        assert _figures(window, limit) == _oracle_or_raises(rows, now - 30.0, now, senders, limit)


def test_an_error_that_is_not_finite_raises_as_the_read_does() -> None:
    window = SLOWindow(30.0, None, SLO)
    window.update(
        [SLORow(1, 100.0, "ok", 1.0, None, None, 1e-310), SLORow(2, 101.0, "ok", 0.2, None, None, 0.1)]
    )
    window.slide(110.0)
    with pytest.raises(ValueError):
        window.prediction(10)


@pytest.fixture
def store(store_factory: sessionmaker[Session]) -> sessionmaker[Session]:
    return store_factory


def _values(rng: random.Random, now: float) -> dict[str, Any]:
    r = _row(rng, 0, now)
    predicted = r.predicted_ttft_s
    return {
        "proxy_in": now - 50.0 if r.proxy_in is None else r.proxy_in,
        "status": r.status or "ok",
        "ttft_s": r.ttft_s,
        "sender": r.sender,
        "predicted_ttft_s": None if predicted is not None and not math.isfinite(predicted) else predicted,
    }


@pytest.mark.parametrize(("trusted", "limit"), [(None, 10_000), (["proxy-a"], 10_000), (None, 7)])
def test_ticks_that_read_only_changes_give_the_predictors_read(
    store: sessionmaker[Session], trusted: list[str] | None, limit: int
) -> None:
    rng, settings_, kept, now, n = random.Random(9), window_settings(trusted), KeptReads(3600.0), 1000.0, 0
    only = RecordFilter(None if trusted is None else frozenset(trusted))
    seen = 0
    for tick in range(30):
        n = store_tick(store, rng, n, now, _values)
        now += rng.choice([0.5, 2.0, 2.0, 5.0])
        with transaction(store) as s:
            kept.slo(s, settings_, now)
            got = kept.prediction(limit)
            rows = prediction_rows(s, now - 30.0, now, only=only, limit=limit).rows
            fleet = measure(PredictionFacts(*r) for r in rows).fleet
        assert got == (fleet.measured, fleet.error_p50), tick
        seen += fleet.measured
    assert seen and kept.slo_window.counts.whole == 1 and kept.slo_window.counts.changes == 29
