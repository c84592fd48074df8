"""The shadow policy (controller.shadow): decides beside the live one, is never served, says where it
parts; bad settings are config errors naming the field; a failing shadow step costs only itself."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from controller import shadow as shadow_mod
from controller.api import create_app
from controller.loop import Reconciler
from controller.policy import AlertConfig
from controller.wiring import default_effects
from pdscope.config import ConfigError
from tests.controller.conftest import World


def _with_shadow(world: World, changes: dict[str, float] | None) -> Reconciler:
    c = world.settings.controller.model_copy(update={"shadow": changes})
    world.settings = world.settings.model_copy(update={"controller": c})
    world.reconciler = Reconciler(
        world.settings,
        world.factory,
        effects=default_effects(world.settings, world.factory, clock=world.clock, notifier=world.notifier),
        clock=world.clock,
        alert_config=AlertConfig(for_s={"KVLeaseExpired": 0.0, "InstanceDown": 4.0}),
    )
    return world.reconciler


def _slow_d(world: World) -> None:
    for _ in range(3):
        world.step()
    for _ in range(5):
        world.step(handoff_s={"decode-2": 0.5}, scrape={"decode_2": {"xfer_s": 0.1}})


def test_the_shadow_parts_where_it_would_cut_less_and_is_never_served(world: World) -> None:
    rec = _with_shadow(world, {"max_weight_step": 0.05})
    _slow_d(world)
    status = rec.shadow_status()
    assert status is not None and status["ticks"] == 8 and status["failures"] == 0
    assert status["changes"] == {"max_weight_step": 0.05} and status["candidate"] != rec.policy
    assert status["first_divergence"]["subject"] == "decode-2"
    live, shadow = status["weights"]["decode-2"]["live"], status["weights"]["decode-2"]["shadow"]
    assert live == world.weight("decode-2") and shadow > live, "served is the live policy's"
    with TestClient(create_app(rec, token="t0ken", notifier=world.notifier)) as client:
        body = client.get("/v1/shadow").json()
        metrics = client.get("/metrics").text
    assert body["divergent_ticks"] == status["divergent_ticks"] > 0
    assert "pdscope_controller_shadow_divergent_ticks_total" in metrics
    assert f'pdscope_controller_shadow_weight{{instance="decode-2"}} {shadow}' in metrics


def test_without_a_shadow_it_says_so(world: World) -> None:
    _slow_d(world)
    assert world.reconciler.shadow_status() is None
    with TestClient(create_app(world.reconciler, token="t0ken", notifier=world.notifier)) as client:
        assert client.get("/v1/shadow").json() == {"enabled": False}
        assert "pdscope_controller_shadow" not in client.get("/metrics").text


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"min_wieght": 0.1}, "controller.shadow.min_wieght: not a policy setting"),
        ({"recover_ticks": 1.5}, "controller.shadow.recover_ticks: 1.5 is not an integer"),
        ({"min_weight": -1.0}, "controller.shadow.min_weight: must be a finite number at least 0"),
        ({"pair_min_samples": 3}, "controller.shadow.pair_min_samples: acts only in the evidence step"),
        ({"recent_s": 5.0}, "controller.shadow.recent_s: acts only in the evidence step"),
    ],
)
def test_a_bad_shadow_setting_is_a_config_error_naming_it(
    world: World, changes: dict[str, float], problem: str
) -> None:
    with pytest.raises(ConfigError) as info:
        _with_shadow(world, changes)
    assert any(p.startswith(problem) for p in info.value.problems), info.value.problems


def test_a_failing_shadow_step_is_counted_and_the_live_tick_goes_on(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = _with_shadow(world, {"min_weight": 0.05})

    def broken(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("shadow exploded")

    monkeypatch.setattr(shadow_mod, "decide", broken)
    _slow_d(world)
    status = rec.shadow_status()
    assert status is not None and status["failures"] == 8 and status["ticks"] == 0
    assert status["last_error"] == "RuntimeError: shadow exploded"
    assert world.weight("decode-2") < 1.0, "the live policy still cut the slow D"
