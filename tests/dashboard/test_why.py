"""The "why" views under AppTest against the seeded store: the Why we missed page (the controller's
own attribution, the sidebar's range or an alert's linked window), the SLOs page's links to it,
and the Controller page's decision-regret tally (the controller's own regret)."""

from __future__ import annotations

import urllib.parse
from pathlib import Path

import pytest
import yaml
from sqlalchemy import delete, insert, update
from streamlit.testing.v1 import AppTest

from controller.attribution import window_attribution
from controller.regret import window_regret
from pdscope.config import load_config
from store.db import make_engine, session_factory
from store.models import Decision, RequestRecord

from .conftest import APP, Seeded, make_seeded
from .test_pages import TIMEOUT, open_page, texts


def open_linked(config: Path, monkeypatch: pytest.MonkeyPatch, **params: str) -> AppTest:
    """The Why we missed page opened with URL parameters (as a link from an alert opens it)."""
    monkeypatch.setenv("PDSCOPE_CONFIG", str(config))
    monkeypatch.delenv("PDSCOPE_API_TOKEN", raising=False)
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT).run()
    for k, v in params.items():
        at.query_params[k] = v
    at.switch_page("views/attribution.py").run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def metric(at: AppTest, label: str) -> str:
    return str(next(m.value for m in at.metric if m.label == label))


def top_lines(at: AppTest) -> list[str]:
    return [str(m.value) for m in at.markdown if str(m.value)[:2] == "**" and str(m.value)[2:3].isdigit()]


def test_the_page_shows_the_controllers_attribution_of_a_linked_window(
    seeded: Seeded, monkeypatch: pytest.MonkeyPatch
) -> None:
    lo, hi = seeded.spec.end - 900.0, seeded.spec.end
    at = open_linked(
        seeded.config, monkeypatch, **{"from": f"{lo}", "until": f"{hi}", "alert": "TTFTSLOBurn"}
    )
    settings = load_config(seeded.config)
    engine = make_engine(seeded.url)
    try:
        want = window_attribution(session_factory(engine), settings, lo, hi).attribution
    finally:
        engine.dispose()
    assert want.missed > 0 and len(want.top) == 3
    assert top_lines(at) == [f"**{i}.** {g.message}" for i, g in enumerate(want.top, start=1)]
    assert (
        metric(at, "requests") == f"{want.requests:,}"
        and metric(at, "missed their SLO") == f"{want.missed:,}"
    )
    assert any("decode-2" in line for line in top_lines(at))  # the seeded degraded D is among them
    assert "alert **TTFTSLOBurn**" in texts(at)
    table = at.dataframe[0].value
    assert len(table) == len(want.groups) and table["share"].sum() == pytest.approx(1.0)
    assert len(at.get("arrow_vega_lite_chart")) + len(at.get("vega_lite_chart")) >= 2
    at.segmented_control(key="why_group_by").set_value("place (instance or P×D pair)").run()
    by_place = at.dataframe[0].value
    assert set(by_place.columns) >= {"place", "share", "misses"} and "stage" not in by_place
    assert by_place["place"].is_unique and "decode-2" in set(by_place["place"])
    # back to the sidebar's range
    next(b for b in at.button if b.label == "Follow the sidebar's range").click().run()
    assert "alert **TTFTSLOBurn**" not in texts(at) and "from" not in at.query_params


def test_the_page_follows_the_sidebar_range(seeded: Seeded, monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_page(seeded.config, "attribution", monkeypatch)
    at.sidebar.selectbox(key="range").select("Last 5 min").run()
    five = int(metric(at, "requests").replace(",", ""))
    at.sidebar.selectbox(key="range").select("Last 1 h").run()
    hour = int(metric(at, "requests").replace(",", ""))
    assert 0 < five < hour  # the seeded history is 30 min: the hour holds all of it, 5 min a sixth
    assert hour == seeded.summary.requests


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"from": "soon"}, "must be Unix seconds"),
        ({"from": "2000", "until": "1000"}, "must start before it ends"),
    ],
)
def test_a_bad_link_falls_back_to_the_sidebar(
    params: dict[str, str], says: str, seeded: Seeded, monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_linked(seeded.config, monkeypatch, **params)
    assert says in " ".join(str(w.value) for w in at.warning)
    assert int(metric(at, "requests").replace(",", "")) > 0


def test_no_miss_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = make_seeded(tmp_path, duration_s=300.0, rate_per_s=1.0)
    engine = make_engine(s.url)
    with engine.begin() as conn:  # every request completed, and targets no request misses
        conn.execute(update(RequestRecord).values(status="ok", http_status=200))
        conn.execute(delete(RequestRecord).where(RequestRecord.ttft_s.is_(None)))  # no TTFT: a miss
    engine.dispose()
    data = yaml.safe_load(s.config.read_text())
    data["slo"] = {"ttft": {"target_ms": 600_000}, "tpot": {"target_ms": 600_000}}
    s.config.write_text(yaml.safe_dump(data))
    at = open_page(s.config, "attribution", monkeypatch)
    assert "No request missed its SLO in this range" in texts(at)
    assert metric(at, "missed their SLO") == "0" and top_lines(at) == []


def test_slo_alerts_link_to_their_window(seeded: Seeded, monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_page(seeded.config, "slos", monkeypatch)
    links = at.get("page_link")
    assert links, "no link to Why we missed"
    window = load_config(seeded.config).slo.window_s
    by_alert = {}
    for link in links:
        assert link.proto.page == "why"
        q = dict(urllib.parse.parse_qsl(link.proto.query_string))
        by_alert.setdefault(q["alert"], []).append(q)
    start = seeded.spec.end - seeded.spec.duration_s
    degrade = start + seeded.spec.degrade_at * seeded.spec.duration_s
    # the two firing alerts: from one SLO window before they became active, still open (no until)
    for rule, active in (("TTFTSLOBurn", degrade + 30.0), ("NixlTransferSlow", degrade + 15.0)):
        q = by_alert[rule][0]
        assert float(q["from"]) == pytest.approx(active - window, abs=1e-3) and "until" not in q
    # a resolved alert from the recent list (early in the history): its window ends when it resolved
    at.sidebar.selectbox(key="range").select("Last 1 h").run()
    pick = at.selectbox(key="why_pick")
    down = next(i for i, label in enumerate(pick.options) if label.startswith("InstanceDown"))
    pick.set_value(down).run()
    q = next(
        dict(urllib.parse.parse_qsl(link.proto.query_string))
        for link in at.get("page_link")
        if "InstanceDown" in link.proto.query_string
    )
    assert float(q["from"]) == pytest.approx(start + 65.0 - window, abs=1e-3)
    assert float(q["until"]) == pytest.approx(start + 430.0, abs=1e-3)


def test_controller_page_tallies_the_regret_of_the_cuts(
    seeded: Seeded, monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_page(seeded.config, "controller", monkeypatch)
    at.sidebar.selectbox(key="range").select("Last 1 h").run()
    tally = next(d.value for d in at.dataframe if "flap_rate" in d.value.columns).set_index("reason")
    row = tally.loc["NixlSlowTransfers"]  # the seeded degraded D: three cuts, never raised back
    assert (row["cuts"], row["undone"], row["flapped"]) == (3, 0, 0)
    assert metric(at, "cuts") == "3"
    settings = load_config(seeded.config)
    engine = make_engine(seeded.url)
    try:
        want = window_regret(
            session_factory(engine),
            settings,
            seeded.spec.end - 3600.0,
            seeded.spec.end + 5.0,
            now=seeded.spec.end + 5.0,
        ).regret
    finally:
        engine.dispose()
    (same,) = [t for t in want.reasons if t.reason == "NixlSlowTransfers"]
    assert row["slo_delta_pts"] == pytest.approx(100.0 * (same.mean_slo_delta or 0.0), abs=1.0)


def test_controller_page_counts_flapping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = make_seeded(tmp_path, duration_s=600.0, rate_per_s=1.0)
    t0 = s.spec.end - 300.0
    engine = make_engine(s.url)
    base = {
        "mode": "enforce",
        "subject_kind": "instance",
        "subject": "decode-1",
        "field": "weight",
        "message": "",
        "inputs": {},
        "scores": {},
        "leader_epoch": 1,
    }
    with engine.begin() as conn:
        conn.execute(
            insert(Decision),
            [
                {**base, "ts": t0, "tick": 1000, "old_value": 1.0, "new_value": 0.5, "reason": "Backlog"},
                {
                    **base,
                    "ts": t0 + 6.0,
                    "tick": 1003,
                    "old_value": 0.5,
                    "new_value": 1.0,
                    "reason": "Recovering",
                },
            ],
        )
    engine.dispose()
    at = open_page(s.config, "controller", monkeypatch)
    tally = next(d.value for d in at.dataframe if "flap_rate" in d.value.columns).set_index("reason")
    assert (tally.loc["Backlog", "flapped"], tally.loc["Backlog", "flap_rate"]) == (1, 1.0)
    assert tally.loc["Backlog", "median_ticks_to_undo"] == 3
    at.number_input(key="regret_flap_ticks").set_value(2).run()
    tally = next(d.value for d in at.dataframe if "flap_rate" in d.value.columns).set_index("reason")
    assert tally.loc["Backlog", "flapped"] == 0 and tally.loc["Backlog", "undone"] == 1
