"""Every page under streamlit.testing.v1.AppTest against a seeded store, the empty
states on an empty one, and the Controller forms against a stand-in controller."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from sqlalchemy import text
from streamlit.testing.v1 import AppTest

from dashboard.derive import D_ALONE
from devdata.seed import SeedSpec, fleet_config_yaml
from store.db import make_engine
from store.migrate import upgrade
from tests.support.controllers import FakeController

from .conftest import APP, TOKEN, USER_TOKEN, Seeded, make_seeded

TIMEOUT = 60

PAGES = {
    "fleet": ("Fleet", ["Instances", "Admission limits", "Manual overrides in force"]),
    "slos": ("SLOs & alerts", ["Firing now", "Recent alerts"]),
    "attribution": ("Why we missed", ["Top reasons we missed", "By instance, P×D pair and cause"]),
    "requests": ("Requests", ["Decode side at that time", "Flagged lease-expiry requests"]),
    "kv_transfer": (
        "KV transfer",
        ["Stranded KV", "Pairs left out of routing", "Handoff time per (P, D) pair"],
    ),
    "prefix_cache": (
        "Prefix cache",
        [
            "Hit rate per instance (vLLM)",
            "Predicted vs reported cached tokens",
            "Hottest prefixes",
            "Served without P (decode only)",
        ],
    ),
    "controller": (
        "Controller",
        ["Decisions", "Decision regret", "Overrides in force", "Audit trail", "Change routing"],
    ),
    "capacity": ("Capacity", ["Implied P:D ratio and what-if"]),
    "predictor": ("Predictor", []),  # the seed has no predictions: tests/dashboard/test_predictor_page.py
    "tenants": ("Tenants", ["Shares and SLOs", "Per tenant"]),
}


def with_dashboard(config: Path, **dashboard: object) -> Path:
    """Rewrite ``config`` with a ``dashboard`` section (auth mode, identity header)."""
    data = yaml.safe_load(config.read_text())
    data["dashboard"] = dashboard
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    return config


def sign_in(at: AppTest, token: str) -> AppTest:
    at.sidebar.text_input(key="login_token").input(token)
    next(b for b in at.sidebar.button if b.label == "Sign in").click().run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def open_page(
    config: Path,
    page: str,
    monkeypatch: pytest.MonkeyPatch,
    token: str | None = None,
    params: dict[str, str] | None = None,
) -> AppTest:
    """The page as a user opens it (``params``: the URL's query, e.g. a time range)."""
    monkeypatch.setenv("PDSCOPE_CONFIG", str(config))
    if token is None:
        monkeypatch.delenv("PDSCOPE_API_TOKEN", raising=False)
    else:
        monkeypatch.setenv("PDSCOPE_API_TOKEN", token)
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    for k, v in (params or {}).items():
        at.query_params[k] = v
    at.run()
    assert not at.exception, at.exception
    if page != "fleet":  # the default page lives at the root URL
        at.switch_page(f"views/{page}.py").run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def texts(at: AppTest) -> str:
    parts = [m.value for m in (*at.markdown, *at.caption, *at.info, *at.warning, *at.error, *at.success)]
    return "\n".join(str(p) for p in parts)


def charts(at: AppTest) -> int:
    return len(at.get("vega_lite_chart"))


@pytest.mark.parametrize("page", list(PAGES))
def test_each_page_renders_the_seeded_fleet(
    page: str, seeded: Seeded, monkeypatch: pytest.MonkeyPatch
) -> None:
    title, subheaders = PAGES[page]
    at = open_page(seeded.config, page, monkeypatch)
    assert [t.value for t in at.title] == [title]
    got = {s.value for s in at.subheader} | {s.value for s in at.header}
    for sub in subheaders:
        assert any(g.startswith(sub) for g in got), (sub, got)
    assert not [e for e in at.error if "failed" in str(e.value)]


def test_fleet_shows_pools_instances_and_small_multiples(
    seeded: Seeded, monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_page(seeded.config, "fleet", monkeypatch)
    labels = [m.label for m in at.metric]
    assert labels.count("up") == 2  # one card per pool
    assert {m.value for m in at.metric if m.label == "up"} == {"2/2", "3/3"}
    table = at.dataframe[0].value
    assert sorted(table["instance"]) == ["decode-0", "decode-1", "decode-2", "prefill-0", "prefill-1"]
    assert table.set_index("instance").loc["decode-2", "weight"] == pytest.approx(0.25)
    assert charts(at) >= 1


def test_requests_page_searches_by_id_and_draws_the_waterfall(
    seeded: Seeded, monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_page(seeded.config, "requests", monkeypatch)
    at.text_input(key="q_id").input(seeded.summary.slow_request_id).run()
    assert not at.exception
    assert list(at.dataframe[0].value["request_id"]) == [seeded.summary.slow_request_id]
    assert at.selectbox(key="inspect").value == seeded.summary.slow_request_id
    stages = at.dataframe[1].value
    assert list(stages["stage"])[:1] == ["proxy"] and "decode" in set(stages["stage"])
    assert {m.label for m in at.metric} >= {"NIXL xfer mean", "MB/s while transferring", "failed transfers"}
    at.text_input(key="q_id").input("no-such-id").run()
    assert "No request with id" in texts(at)


def test_requests_page_filters_slo_misses_and_flags_lease_expiry(
    seeded: Seeded, monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_page(seeded.config, "requests", monkeypatch)
    at.checkbox(key="q_slo_miss").check().run()
    found = at.dataframe[0].value
    assert len(found) > 0 and not found["slo_met"].any()
    at.checkbox(key="q_slo_miss").uncheck()
    at.checkbox(key="q_lease").check().run()
    found = at.dataframe[0].value
    assert len(found) > 0 and found["lease_expiry_suspect"].all()
    assert "likely KV-lease expiry" in texts(at)


def test_slo_page_compares_with_targets_and_lists_firing_alerts(
    seeded: Seeded, monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_page(seeded.config, "slos", monkeypatch)
    labels = {m.label for m in at.metric}
    assert {"TTFT p99", "TPOT p99", "SLO attainment", "goodput"} <= labels
    firing = " ".join(str(e.value) for e in (*at.error, *at.warning))
    assert "TTFTSLOBurn" in firing and "NixlTransferSlow" in firing
    assert charts(at) >= 3


def test_kv_page_has_the_pair_heatmap_and_per_instance_table(
    seeded: Seeded, monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_page(seeded.config, "kv_transfer", monkeypatch)
    table = at.dataframe[0].value.set_index("instance")
    assert table.loc["decode-2", "xfer_p99_ms"] > table.loc["decode-0", "xfer_p99_ms"]
    assert "slowest D (xfer p99)" in {m.label for m in at.metric}
    assert str(next(m.value for m in at.metric if m.label.startswith("slowest"))).startswith("decode-2")
    assert charts(at) >= 3


def test_prefix_cache_page_shows_hit_rates_predictions_hot_prefixes_and_decode_only(
    seeded: Seeded, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the whole seeded half hour, however long ago the session's seed was written (the default range,
    # the last 15 min up to now, slides off decode-2's decode-only requests as the suite runs)
    at = open_page(seeded.config, "prefix_cache", monkeypatch, params={"range": "1h", "anchor": "latest"})
    figures = {m.label: m.value for m in at.metric}
    assert set(figures) == {
        "P hit rate (vLLM)",
        "D external hit rate",
        "P reported / predicted",
        "served without P",
    }
    assert all(v != "—" for v in figures.values()), figures
    assert float(str(figures["P reported / predicted"])) < 1.0  # prefill-1's cache was cleared a while
    compared = at.dataframe[0].value.set_index("instance")
    assert set(compared.index) == {"prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2"}
    # the router kept predicting prefill-1's prefixes while its cache was empty
    ratio = compared["reported_per_predicted"]
    assert ratio["prefill-1"] < ratio["prefill-0"] <= 1.0
    assert compared.loc["decode-0", "external_hit_rate"] > 0.9  # D pulls what P computed
    hot = at.dataframe[1].value
    assert len(hot) == 10 and hot["requests"].is_monotonic_decreasing
    assert hot.iloc[0]["share"] > hot.iloc[-1]["share"] > 0
    assert all(str(s).startswith("prefill-") for s in hot["p_instances"])
    assert charts(at) >= 4  # P and D hit rates, predicted vs reported, the decode-only share


def test_prefix_cache_page_without_kv_aware_routing_shows_vllms_rates_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = make_seeded(tmp_path, duration_s=600.0, rate_per_s=1.0)
    engine = make_engine(s.url)
    with engine.begin() as conn:
        # as a proxy without proxy.kv_aware writes them: a route path, reported cached tokens, no view
        conn.execute(
            text(
                "UPDATE request_records"
                " SET route_path = CASE WHEN route_path IS NULL THEN NULL ELSE 'pd' END,"
                " p_predicted_cached_tokens = NULL, d_predicted_cached_tokens = NULL, prefix_key = NULL,"
                " prefix_tokens = NULL"
            )
        )
    engine.dispose()
    at = open_page(s.config, "prefix_cache", monkeypatch)
    assert "proxy.kv_aware" in texts(at)
    figures = {m.label: m.value for m in at.metric}
    assert figures["P reported / predicted"] == "—" and figures["P hit rate (vLLM)"] != "—"
    assert figures["served without P"] == "0%"  # every routed request went P then D
    assert not at.dataframe and charts(at) == 2


def test_requests_page_draws_a_decode_only_request_without_p(
    seeded: Seeded, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(seeded.url)
    with engine.connect() as conn:
        rid = conn.execute(
            text(
                "SELECT request_id FROM request_records WHERE route_path = 'decode_only' AND status = 'ok'"
                " ORDER BY proxy_in DESC LIMIT 1"
            )
        ).scalar()
    engine.dispose()
    assert rid
    at = open_page(seeded.config, "requests", monkeypatch)
    at.text_input(key="q_id").input(str(rid)).run()
    assert not at.exception
    stages = at.dataframe[1].value
    assert list(stages["stage"]) == ["proxy", D_ALONE, "first token", "decode"]
    assert "prompt tokens cached (predicted" in " ".join(stages["note"])
    body = texts(at)
    assert "alone" in body and "route **decode only** (no P)" in body and "D cached **" in body


def test_capacity_what_if_scales_the_needed_fleet(seeded: Seeded, monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_page(seeded.config, "capacity", monkeypatch)
    needed = {m.label: m.value for m in at.metric}
    assert needed["fleet now"] == "2 P : 3 D"
    base = needed["needed at what-if"]
    at.slider(key="load_factor").set_value(4.0).run()
    assert not at.exception
    after = {m.label: m.value for m in at.metric}["needed at what-if"]
    n_p = lambda s: int(s.split(" P")[0])  # noqa: E731
    assert n_p(after) >= n_p(base) and after != base
    assert len(at.get("latex")) == 1


def test_controller_form_calls_the_api_with_the_users_own_token(
    tmp_path: Path, fake_controller: FakeController, monkeypatch: pytest.MonkeyPatch
) -> None:
    seeded = make_seeded(tmp_path, controller_port=fake_controller.port, duration_s=600.0)
    # the server's token is in the environment, but login mode never uses it for changes
    at = open_page(seeded.config, "controller", monkeypatch, token=TOKEN)
    assert "Advisory" in texts(at)  # the fake controller says mode=advisory
    assert not [w for w in at.text_input if w.key == "actor"]  # no free-text actor any more
    sign_in(at, USER_TOKEN)
    assert "Signed in as **carol**" in texts(at)
    at.selectbox(key="w_instance").select("decode-1")
    at.number_input(key="w_weight").set_value(0.3)
    at.number_input(key="w_ttl").set_value(10)
    at.text_input(key="w_reason").input("NIC flapping")
    at.button[0].click().run()  # "Set override"
    assert not at.exception
    calls = fake_controller.mutations()
    assert len(calls) == 1
    call = calls[0]
    assert (call.method, call.path) == ("PUT", "/v1/instances/decode-1/weight")
    assert call.body == {"weight": 0.3, "ttl_s": 600.0, "reason": "NIC flapping"}
    assert call.headers["authorization"] == f"Bearer {USER_TOKEN}"
    assert "x-actor" not in call.headers  # the controller takes the actor from the token's identity
    assert "audit #7" in texts(at)
    whoami = [r for r in fake_controller.requests if r.path == "/v1/whoami"]
    assert [r.headers["authorization"] for r in whoami] == [f"Bearer {USER_TOKEN}"]


def test_controller_drain_form_and_reason_required(
    tmp_path: Path, fake_controller: FakeController, monkeypatch: pytest.MonkeyPatch
) -> None:
    seeded = make_seeded(tmp_path, controller_port=fake_controller.port, duration_s=600.0)
    at = sign_in(open_page(seeded.config, "controller", monkeypatch), USER_TOKEN)
    drain = next(b for b in at.button if b.label == "Drain")
    drain.click().run()
    assert "A reason is required" in texts(at)
    assert fake_controller.mutations() == []
    at.selectbox(key="d_instance").select("prefill-1")
    at.text_input(key="d_reason").input("kernel upgrade")
    next(b for b in at.button if b.label == "Drain").click().run()
    calls = fake_controller.mutations()
    assert [(c.method, c.path, c.body) for c in calls] == [
        ("POST", "/v1/instances/prefill-1/drain", {"reason": "kernel upgrade"})
    ]


def test_controller_errors_are_shown_not_raised(
    tmp_path: Path, fake_controller: FakeController, monkeypatch: pytest.MonkeyPatch
) -> None:
    seeded = make_seeded(tmp_path, controller_port=fake_controller.port, duration_s=600.0)
    at = sign_in(open_page(seeded.config, "controller", monkeypatch), USER_TOKEN)
    fake_controller.status = 401  # the token is revoked after sign-in
    at.selectbox(key="p_pool").select("decode")
    at.text_input(key="p_reason").input("shift load")
    next(b for b in at.button if b.label == "Set pool weight").click().run()
    assert not at.exception
    assert "HTTP 401" in texts(at) and "invalid token" in texts(at) and "sign in again" in texts(at)
    at.run()  # the session was signed out: the forms are disabled again
    assert all(b.disabled for b in at.button if b.label in ("Drain", "Set pool weight"))


def test_controller_page_without_sign_in_or_controller(
    seeded: Seeded, monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_page(seeded.config, "controller", monkeypatch, token=TOKEN)
    body = texts(at)
    assert "Sign in (sidebar)" in body  # says how to enable the forms
    assert "Enforcing" in body and "unreachable" in body  # mode from the stored decisions
    form_buttons = [b for b in at.button if b.label in FORM_BUTTONS]
    assert len(form_buttons) == len(FORM_BUTTONS) and all(b.disabled for b in form_buttons)


FORM_BUTTONS = ("Set override", "Clear override", "Drain", "Undrain", "Set pool weight")


@pytest.mark.parametrize("page", list(PAGES))
def test_empty_store_pages_say_how_to_start(
    page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    upgrade(url)
    config = tmp_path / "pdscope.yaml"
    config.write_text(fleet_config_yaml(SeedSpec(end=0.0), url))
    at = open_page(config, page, monkeypatch)
    body = texts(at)
    assert "collect" in body or "control" in body, body


def test_missing_schema_and_bad_config_are_explained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "pdscope.yaml"
    config.write_text(fleet_config_yaml(SeedSpec(end=0.0), f"sqlite:///{tmp_path / 'none.db'}"))
    at = open_page(config, "fleet", monkeypatch)
    assert "db upgrade" in texts(at)
    config.write_text("model: {name: x}\n")
    monkeypatch.setenv("PDSCOPE_CONFIG", str(config))
    bad = AppTest.from_file(str(APP), default_timeout=TIMEOUT).run()
    assert not bad.exception
    assert "cannot load its configuration" in str(bad.error[0].value)


def test_custom_time_range(seeded: Seeded, monkeypatch: pytest.MonkeyPatch) -> None:
    import datetime as dt

    at = open_page(seeded.config, "kv_transfer", monkeypatch)
    at.sidebar.selectbox(key="range").select("Custom…").run()
    start = dt.datetime.fromtimestamp(seeded.spec.end - 600, tz=dt.UTC).replace(
        tzinfo=None, second=0, microsecond=0
    )
    at.sidebar.datetime_input(key="custom_start").set_value(start)
    at.sidebar.datetime_input(key="custom_end").set_value(start + dt.timedelta(minutes=10)).run()
    assert not at.exception
    assert "paused" in at.caption[0].value and start.strftime("%H:%M") in at.caption[0].value
    assert len(at.dataframe) >= 1  # the last 10 minutes of the seeded history
    # a range before the history: the page explains instead of drawing empty charts
    at.sidebar.datetime_input(key="custom_start").set_value(start - dt.timedelta(days=2))
    at.sidebar.datetime_input(key="custom_end").set_value(start - dt.timedelta(days=1)).run()
    assert not at.exception
    assert "in this time range" in texts(at)


def test_controller_page_shows_the_proxies_and_their_parts(
    tmp_path: Path, fake_controller: FakeController, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time as _time

    from store.db import make_engine, session_factory, transaction
    from store.models import ProxyMember

    seeded = make_seeded(tmp_path, controller_port=fake_controller.port, duration_s=600.0)
    engine = make_engine(seeded.url)
    now = _time.time()

    def member(pid: str, seen: float, share: float, slots: int, duplicates: int = 0) -> ProxyMember:
        part = {"share": share, "max_inflight_requests": slots, "max_inflight_kv_bytes": slots * 1000}
        return ProxyMember(
            id=pid,
            boot="ab",
            started=now - 100,
            first_seen=now - 100,
            last_seen=seen,
            served_by="ctl-0",
            applied_version=1,
            demand={"prefill": 10},
            rates={"prefill": 2.0},
            inflight={"prefill": 3},
            served={"prefill": part},
            duplicates=duplicates,
        )

    with transaction(session_factory(engine)) as s:
        s.add_all(
            [
                member("edge-a:8000", now, 0.6, 150),
                member("edge-b:8000", now, 0.4, 106, duplicates=2),
                member("edge-c:8000", now - 3600 * 0.5, 0.3, 80),  # dead: not counted
            ]
        )
    engine.dispose()
    at = open_page(seeded.config, "controller", monkeypatch)
    assert "Proxies and their parts of the limits" in {s.value for s in at.subheader}
    shown = texts(at)
    assert "2 live proxies" in shown and "prefill: 256" in shown, shown
    assert any("Two processes poll under one proxy id" in str(w.value) for w in at.warning)
    table = next(df.value for df in at.dataframe if "proxy" in df.value.columns)
    assert set(table["proxy"]) == {"edge-a:8000", "edge-b:8000", "edge-c:8000"}
    assert table.set_index("proxy").loc["edge-c:8000", "live"] == False  # noqa: E712


def test_controller_page_says_when_no_proxy_has_reported(
    seeded: Seeded, monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_page(seeded.config, "controller", monkeypatch)
    assert any("No proxy has reported" in str(c.value) for c in at.caption)
