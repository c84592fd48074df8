"""The Tenants page under AppTest: a seeded store whose records belong to three declared tenants (one
held to a TTFT target tighter than what it gets, one refused outright) shows the tenants side by side:
shares against weights, SLO attainment against the target, rejections by reason, the starved tenant;
with tenants off it shows the default tenant alone and says they are off."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from sqlalchemy import text

from store.db import make_engine

from .conftest import make_seeded
from .test_pages import charts, open_page, texts

RANGE = {"range": "1h", "anchor": "latest"}
TENANTS = {
    "enabled": True,
    "tenants": {
        "team-a": {"weight": 2, "slo": {"ttft_ms": 1}},  # 1 ms: no request meets it
        "team-b": {"weight": 1},
        "batch": {"weight": 1, "priority": "batch"},
    },
}


def tenanted(url: str, config: Path) -> None:
    """Every third record team-a's, team-b's, or batch's (batch's all refused, queue_full); the config
    declares the three."""
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE request_records SET tenant ="
                " CASE id % 3 WHEN 0 THEN 'team-a' WHEN 1 THEN 'team-b' ELSE 'batch' END"
            )
        )
        conn.execute(
            text(
                "UPDATE request_records SET status = 'rejected', ttft_s = NULL, tpot_s = NULL,"
                " attributes = '{\"reject_reason\": \"queue_full\"}' WHERE tenant = 'batch'"
            )
        )
    engine.dispose()
    data = yaml.safe_load(config.read_text())
    data["tenants"] = TENANTS
    config.write_text(yaml.safe_dump(data, sort_keys=False))


def test_the_tenants_page_shows_the_tenants_side_by_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = make_seeded(tmp_path, duration_s=600.0, rate_per_s=1.0)
    tenanted(s.url, s.config)
    at = open_page(s.config, "tenants", monkeypatch, params=RANGE)
    assert [t.value for t in at.title] == ["Tenants"]
    assert {h.value for h in at.subheader} >= {"Shares and SLOs", "Per tenant"}
    figures = {m.label: m.value for m in at.metric}
    assert figures["tenants asking"] == "3 of 4"
    assert figures["starved"] == "1" and figures["under SLO target"] == "1"
    table = at.dataframe[0].value.set_index("tenant")
    assert list(table.index) == ["default", "team-a", "team-b", "batch"]
    assert table.loc["team-a", "attainment"] == 0.0 and table.loc["team-a", "ttft_target_ms"] == 1
    assert table.loc["team-a", "fair_share"] == pytest.approx(0.5)
    assert table.loc["batch", "served"] == 0 and table.loc["batch", "rejected"] > 0
    assert "Tenant batch asked and was served nothing" in texts(at)
    assert charts(at) == 3  # shares vs weight, attainment vs target, rejections by reason


def test_with_tenants_off_the_page_shows_default_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = make_seeded(tmp_path, duration_s=300.0, rate_per_s=1.0)
    at = open_page(s.config, "tenants", monkeypatch, params=RANGE)
    assert "Tenants are off" in texts(at)
    assert list(at.dataframe[0].value["tenant"]) == ["default"]
