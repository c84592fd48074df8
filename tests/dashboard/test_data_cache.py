"""The pages' reads are cached by their arguments' values, however each call writes them: the Capacity page
asked for the window's sample with ``slo=`` and its buckets asked again with ``slo=`` and ``senders=None``,
and Streamlit, which keys a call by its arguments as passed, read the same 20,000 rows twice."""

from __future__ import annotations

from typing import Any

import pandas as pd
import pytest
import streamlit as st

from dashboard import data
from dashboard.queries import records
from pdscope.config import SLOSettings


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Each read of the store ``data.request_sample`` makes (no store behind it)."""
    made: list[tuple[Any, ...]] = []

    def sample(engine: Any, window: Any, max_rows: int, slo: Any, only: Any) -> tuple[pd.DataFrame, int]:
        made.append((window, max_rows, slo))
        return pd.DataFrame({"id": [len(made)]}), 1

    monkeypatch.setattr(records, "sample", sample)
    monkeypatch.setattr(data, "engine_for", lambda url: None)
    st.cache_data.clear()
    yield made
    st.cache_data.clear()


def test_one_read_however_the_same_arguments_are_passed(reads: list[tuple[Any, ...]]) -> None:
    slo = SLOSettings()
    first, _ = data.request_sample("sqlite://", 0.0, 60.0, slo=slo)
    again = [
        data.request_sample("sqlite://", 0.0, 60.0, slo=slo, senders=None)[0],
        data.request_sample("sqlite://", 0.0, 60.0, 20_000, slo)[0],
        data.request_sample("sqlite://", end=60.0, start=0.0, slo=slo, max_rows=20_000)[0],
    ]
    assert len(reads) == 1
    assert all(frame.equals(first) for frame in again)


def test_other_values_are_other_reads(reads: list[tuple[Any, ...]]) -> None:
    data.request_sample("sqlite://", 0.0, 60.0)
    data.request_sample("sqlite://", 0.0, 60.0, slo=SLOSettings())
    data.request_sample("sqlite://", 0.0, 60.0, max_rows=100)
    data.request_sample("sqlite://", 0.0, 61.0)
    assert len(reads) == 4
