"""A standby configured in another mode than the leader's serves the leader's table and mode as the
store holds them (never re-derived under its own), warns once, and says so in /healthz and /metrics."""

from __future__ import annotations

import logging
from typing import Literal

import pytest
from fastapi.testclient import TestClient

from controller.api import create_app
from controller.loop import Reconciler
from controller.wiring import default_effects
from tests.controller.conftest import World
from tests.controller.leaders import HandLeadership, HandLock, feed, served

Mode = Literal["advisory", "enforce"]


def replicas(world: World, leader_mode: Mode, standby_mode: Mode) -> tuple[HandLock, Reconciler, Reconciler]:
    lock = HandLock()
    a, b = (
        Reconciler(
            world.settings,
            world.factory,
            effects=default_effects(world.settings, world.factory, clock=world.clock),
            clock=world.clock,
            alert_config=world.reconciler.alert_config,
            leadership=HandLeadership(lock, name),
            mode=mode,
        )
        for name, mode in (("ctl-a:8300 (pid 1)", leader_mode), ("ctl-b:8300 (pid 2)", standby_mode))
    )
    return lock, a, b


@pytest.mark.parametrize(("leader_mode", "standby_mode"), [("enforce", "advisory"), ("advisory", "enforce")])
def test_a_standby_in_another_mode_serves_the_leaders_and_warns_once(
    world: World, leader_mode: Mode, standby_mode: Mode, caplog: pytest.LogCaptureFixture
) -> None:
    _, a, b = replicas(world, leader_mode, standby_mode)
    caplog.set_level(logging.WARNING, logger="controller.loop")
    feed(world)
    assert a.step() is not None and a.role == "leader"
    for _ in range(3):
        feed(world, handoff_s={"decode-2": 0.5})
        a.step()
        assert b.step() is None and b.role == "standby"
    assert (b.table.mode, b.table.enforce) == (leader_mode, leader_mode == "enforce")
    assert served(b.table) == served(a.table)
    warned = [r for r in caplog.records if "differs from the leader's" in r.getMessage()]
    assert len(warned) == 1 and standby_mode in warned[0].getMessage()
    with TestClient(create_app(b, token="t")) as stand, TestClient(create_app(a, token="t")) as lead:
        body = stand.get("/v1/routing").json()
        assert (body["mode"], body["enforce"]) == (leader_mode, leader_mode == "enforce")
        h = stand.get("/healthz").json()
        assert h["leader"]["mode"] == leader_mode and leader_mode in h["mode_warning"]
        assert "pdscope_controller_mode_mismatch 1.0" in stand.get("/metrics").text
        assert lead.get("/healthz").json()["mode_warning"] is None
        assert "pdscope_controller_mode_mismatch 0.0" in lead.get("/metrics").text


def test_a_standby_in_the_same_mode_says_nothing(world: World, caplog: pytest.LogCaptureFixture) -> None:
    _, a, b = replicas(world, "enforce", "enforce")
    caplog.set_level(logging.WARNING, logger="controller.loop")
    feed(world)
    a.step()
    b.step()
    assert b.table.mode == "enforce"
    assert not [r for r in caplog.records if "differs from the leader's" in r.getMessage()]
    with TestClient(create_app(b, token="t")) as stand:
        assert stand.get("/healthz").json()["mode_warning"] is None
