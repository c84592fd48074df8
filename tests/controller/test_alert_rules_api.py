"""The config's ``alerts`` section reaches the running controller: ``serve`` and the loop use it,
``GET /v1/alerts/rules`` shows the effective rules, ``GET /v1/slo`` the handoff budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from controller.api import create_app
from controller.cli import serve
from controller.loop import Reconciler
from controller.wiring import default_effects
from pdscope.config import ALERT_RULE_NAMES
from store.db import make_engine, session_factory, transaction
from store.migrate import upgrade
from store.models import Alert
from tests.controller.replay import VirtualClock
from tests.controller.seed import Seeder, all_pairs, settings_yaml

ALERTS = """
alerts:
  resend_s: 30
  rules:
    TTFTOverTarget: {for_s: 120, severity: critical}
    KVLeaseExpired: {for_s: 0, severity: info}
    HandoffP99OverBudget: {enabled: false}
"""


def test_serve_builds_the_controller_from_the_alerts_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import uvicorn

    captured: dict[str, Any] = {}

    def fake_run(app: Any, **kwargs: Any) -> None:  # serve() returns once the server stops
        captured["app"] = app
        captured.update(kwargs)

    monkeypatch.setattr(uvicorn, "run", fake_run)
    store = f"sqlite:///{tmp_path / 's.db'}"
    settings = settings_yaml(store, extra=ALERTS)  # its `slo:` is fixed; set the budget like the CLI does
    settings = settings.model_copy(
        update={"slo": settings.slo.model_copy(update={"handoff_budget_ms": 750.0})}
    )
    assert serve(settings, None) == 0
    assert captured["host"] == "127.0.0.1"
    client = TestClient(captured["app"])  # no lifespan: the loop is not started, the API still answers
    rules = {r["name"]: r for r in client.get("/v1/alerts/rules").json()}
    assert rules["TTFTOverTarget"] == {
        "name": "TTFTOverTarget",
        "severity": "critical",
        "for_s": 120.0,
        "enabled": True,
        "summary": "TTFT percentile over its SLO target",
    }
    assert (rules["KVLeaseExpired"]["severity"], rules["KVLeaseExpired"]["for_s"]) == ("info", 0.0)
    assert rules["HandoffP99OverBudget"]["enabled"] is False
    assert (
        rules["InstanceDown"]["severity"],
        rules["InstanceDown"]["for_s"],
        rules["InstanceDown"]["enabled"],
    ) == ("critical", 10.0, True)
    assert list(rules) == list(ALERT_RULE_NAMES)
    assert client.get("/v1/slo").json()["handoff_budget_ms"] == 750.0


def test_handoff_budget_defaults_to_half_the_ttft_target(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 's.db'}"
    upgrade(store)
    engine = make_engine(store)
    try:
        settings, factory = settings_yaml(store), session_factory(engine)
        rec = Reconciler(settings, factory, effects=default_effects(settings, factory))
        assert rec.cfg.handoff_budget_s == 1.0  # slo.ttft.target_ms 2000 in settings_yaml
        with TestClient(create_app(rec, token=None)) as c:
            assert c.get("/v1/slo").json()["handoff_budget_ms"] == 1000.0
            assert all(r["enabled"] for r in c.get("/v1/alerts/rules").json())
    finally:
        engine.dispose()


@pytest.mark.parametrize("disabled", [False, True], ids=["enabled", "disabled"])
def test_the_loop_uses_the_config_without_an_explicit_alert_config(store_url: str, disabled: bool) -> None:
    """A Reconciler built from settings alone honours severity, ``for`` and ``enabled`` from the file."""
    upgrade(store_url)
    engine = make_engine(store_url)
    extra = "alerts:\n  rules:\n    KVLeaseExpired: {for_s: 0, severity: critical, enabled: %s}\n" % (
        "false" if disabled else "true"
    )
    settings = settings_yaml(store_url, extra=extra)
    clock = VirtualClock()
    seeder = Seeder(session_factory(engine), settings)
    factory = session_factory(engine)
    rec = Reconciler(settings, factory, effects=default_effects(settings, factory, clock=clock), clock=clock)
    try:
        for i in range(4):
            now = clock.advance(2.0)
            seeder.scrape(now - 0.5, **({"prefill_1": {"expired": 2.0}} if i == 3 else {}))
            seeder.requests(now - 1.9, all_pairs())
            rec.tick()
        with transaction(rec.factory) as s:
            rows = [(a.rule, a.state, a.severity) for a in s.scalars(select(Alert))]
        assert rows == ([] if disabled else [("KVLeaseExpired", "firing", "critical")])
    finally:
        engine.dispose()
