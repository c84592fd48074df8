"""The Predictor page under AppTest: a seeded store whose records carry TTFT predictions (one P
predicted well, the other at half its TTFT) shows the error per pool and per instance, the
distribution charts and the mispredicted share of the misses; without predictions it says so."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text

from store.db import make_engine

from .conftest import make_seeded
from .test_pages import charts, open_page, texts

RANGE = {"range": "1h", "anchor": "latest"}


def _predict(url: str) -> None:
    """As a proxy with proxy.predict writes them: prefill-0's predictions right, prefill-1's at half the
    TTFT it saw (the fleet changed under it), each against a 0.3 s target."""
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE request_records SET ttft_target_s = 0.3, predict_source = 'online',"
                " predict_tokens = 512, predict_tokens_ahead = 0,"
                " predicted_ttft_s = CASE WHEN p_instance = 'prefill-1' THEN ttft_s / 2 ELSE ttft_s END"
                " WHERE ttft_s IS NOT NULL AND ttft_s > 0"
            )
        )
    engine.dispose()


def test_the_predictor_page_shows_the_error_per_pool_and_instance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = make_seeded(tmp_path, duration_s=600.0, rate_per_s=1.0)
    _predict(s.url)
    at = open_page(s.config, "predictor", monkeypatch, params=RANGE)
    assert [t.value for t in at.title] == ["Predictor"]
    assert {h.value for h in at.subheader} >= {"Error distribution", "Per pool and per instance"}
    figures = {m.label: m.value for m in at.metric}
    assert set(figures) == {"predicted requests", "median error", "p90 error", "misses mispredicted"}
    assert all(v != "—" for v in figures.values()), figures
    pools, instances = at.dataframe[0].value.set_index("pool"), at.dataframe[1].value.set_index("instance")
    assert list(pools.index) == ["prefill"]
    assert instances.loc["prefill-0", "error_p50"] == pytest.approx(0.0)
    assert instances.loc["prefill-1", "error_p50"] == pytest.approx(1.0)
    assert instances["predicted"].sum() == pools.loc["prefill", "predicted"] > 0
    # prefill-1's misses were predicted within the target: mispredicted
    assert instances.loc["prefill-1", "mispredicted"] > 0 and instances.loc["prefill-0", "mispredicted"] == 0
    assert charts(at) == 2  # the histogram of observed / predicted, the box per P


def test_the_predictor_page_without_predictions_says_what_turns_them_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = make_seeded(tmp_path, duration_s=300.0, rate_per_s=1.0)
    at = open_page(s.config, "predictor", monkeypatch, params=RANGE)
    assert "proxy.predict" in texts(at)
    assert not at.metric and not at.dataframe and charts(at) == 0
