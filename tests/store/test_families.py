"""store.families: the table of stored vLLM families agrees with the model, and its checks hold."""

from __future__ import annotations

import pytest

from collector.fastparse import extract_signals
from store.families import (
    COUNTER_COLUMNS,
    GAUGE_COLUMNS,
    HISTOGRAM_BY_PREFIX,
    RESET_WATCH,
    SPECS,
    WINDOW_COUNTERS,
    WINDOW_GAUGES,
    Spec,
    histogram_of,
    shape_of,
)
from store.models import Snapshot
from tests.captures import SCRAPE_PAGES

# Snapshot columns that no vLLM family fills: the row's identity and the scrape's own facts.
_NOT_FROM_A_FAMILY = {
    "stamp",  # the database's change stamp (migration 0017)
    "id",
    "instance",
    "pool",
    "role",
    "ts",
    "up",
    "scrape_duration_s",
    "error",
    "engines",
    "process_start_ts",
    "histograms",
    "extra",
}


def test_every_snapshot_column_has_exactly_one_family() -> None:
    filled = [c for s in SPECS for c in s.stored_columns]
    assert len(filled) == len(set(filled)), "a column filled by two families"
    model = {c.name for c in Snapshot.__table__.columns}
    assert set(filled) == model - _NOT_FROM_A_FAMILY


def test_counters_and_gauges_partition_the_columns() -> None:
    assert set(COUNTER_COLUMNS).isdisjoint(GAUGE_COLUMNS)
    assert set(COUNTER_COLUMNS) | set(GAUGE_COLUMNS) == {c for s in SPECS for c in s.stored_columns}
    assert set(WINDOW_COUNTERS) <= set(COUNTER_COLUMNS) and set(WINDOW_GAUGES) <= set(GAUGE_COLUMNS)
    assert set(RESET_WATCH) <= set(COUNTER_COLUMNS)
    assert (
        "num_waiting" in GAUGE_COLUMNS
        and "requests_stop" in COUNTER_COLUMNS
        and "ttft_count" in COUNTER_COLUMNS
    )


@pytest.mark.parametrize("page", ["decode_metrics.txt", "prefill_metrics.txt"])
def test_a_real_vllm_page_fills_every_window_column_and_prefixed_histogram(page: str) -> None:
    signals = extract_signals((SCRAPE_PAGES / page).read_text())
    assert set(WINDOW_COUNTERS) | set(WINDOW_GAUGES) <= set(signals.values)
    assert set(HISTOGRAM_BY_PREFIX.values()) <= set(signals.histograms)


def test_a_spec_cannot_name_a_column_it_does_not_fill() -> None:
    with pytest.raises(ValueError, match="window names"):
        Spec("vllm:x", "scalar", "x", window=("y",))
    with pytest.raises(ValueError, match="only counters"):
        Spec("vllm:x", "scalar", "x", watch=("x",))
    assert Spec("vllm:x_total", "scalar", "x", watch=("x",)).counter


def test_histogram_shape_round_trips() -> None:
    shape = {"le": [0.1, 1.0], "counts": [1.0, 3.0, 4.0], "sum": 2.5, "count": 4.0}
    h = histogram_of(shape)
    assert h.quantile(0.5) == pytest.approx(0.1 + 0.9 * (2.0 - 1.0) / 2.0)
    assert shape_of(h) == shape
    with pytest.raises(ValueError, match="one more count"):
        histogram_of({"le": [0.1], "counts": [1.0], "sum": 0.0, "count": 1.0})
