"""The reconcile loop over a seeded store: observe -> policy -> persist -> serve."""

from __future__ import annotations

import dataclasses

import pytest
from sqlalchemy import func, select

from controller.loop import Reconciler
from controller.policy import TickInput, decide
from controller.wiring import default_effects
from store.db import StoreError, transaction
from store.models import UNREACHABLE, Alert, Decision, PolicyConfigRow, WeightOverride
from tests.controller.conftest import World


def test_degraded_decode_loses_weight_and_decisions_are_stored(world: World) -> None:
    for _ in range(5):
        world.step()
    assert {i.weight for i in world.reconciler.table.instances} == {1.0}
    v0 = world.reconciler.table.version
    slow = {"decode-2": 0.5}
    weights = []
    for _ in range(6):
        world.step(handoff_s=slow, scrape={"decode_2": {"xfer_s": 0.1}})
        weights.append(world.weight("decode-2"))
    assert weights[2] <= 0.5, weights
    assert weights[-1] < 0.3
    assert world.weight("decode-0") == 1.0
    assert world.reconciler.table.version > v0
    with transaction(world.factory) as s:
        rows = s.scalars(
            select(Decision)
            .where(Decision.subject == "decode-2", Decision.field == "weight")
            .order_by(Decision.id)
        ).all()
        assert rows, "every weight change is a stored decision"
        first = rows[0]
        assert first.reason in ("SlowHandoff", "SlowKVTransfer")
        assert first.old_value == 1.0 and first.new_value is not None and first.new_value < 1.0
        assert "target = max(" in (first.arithmetic or "")
        signal = {"SlowHandoff": "handoff", "SlowKVTransfer": "nixl"}[first.reason]
        assert first.scores[signal] < 0.5
        assert first.inputs[f"{signal}_observed"] > 3 * first.inputs[f"{signal}_reference"]
        assert any(r.reason == "SlowHandoff" and r.inputs["handoff_observed"] >= 0.4 for r in rows)
        assert first.routing_version is not None and first.mode == "enforce"
        assert "decode-2" in first.message
        # only changes are stored, not every tick
        assert s.scalar(select(func.count()).select_from(Decision).where(Decision.subject == "decode-0")) == 0


def test_expired_lease_alert_fires_is_notified_and_resolves(world: World) -> None:
    for _ in range(3):
        world.step()
    world.step(scrape={"prefill_1": {"expired": 2.0}})
    with transaction(world.factory) as s:
        a = s.scalars(select(Alert).where(Alert.rule == "KVLeaseExpired")).one()
        assert a.state == "firing" and a.labels["instance"] == "prefill-1" and a.fired_at is not None
    assert any(x.rule == "KVLeaseExpired" and x.state == "firing" for b in world.notifier.batches for x in b)
    for _ in range(7):  # the 10 s window slides past the expiry
        world.step()
    with transaction(world.factory) as s:
        a = s.scalars(select(Alert).where(Alert.rule == "KVLeaseExpired")).one()
        assert a.state == "resolved" and a.resolved_at is not None
    assert any(
        x.rule == "KVLeaseExpired" and x.state == "resolved" for b in world.notifier.batches for x in b
    )


def test_instance_down_goes_to_zero_and_alerts(world: World) -> None:
    for _ in range(3):
        world.step()
    weights = []
    for _ in range(6):  # down_after_s = min(window, max(10 s, 3 scrape intervals)) = 10 s
        world.step(scrape={"decode_1": {"up": False}})
        weights.append(world.weight("decode-1"))
    assert weights[:4] == [1.0] * 4, "a few failed scrapes are not an outage"
    assert weights[4:] == [0.0, 0.0], "failing for the whole 10 s window is"
    with transaction(world.factory) as s:
        a = s.scalars(select(Alert).where(Alert.rule == "InstanceDown")).one()
        assert a.state == "firing" and a.labels["instance"] == "decode-1"


def test_an_instance_nothing_listens_on_is_down_at_its_second_unreachable_scrape(world: World) -> None:
    for _ in range(3):
        world.step()
    refused = {
        "decode_1": {"up": False, "error": UNREACHABLE + "ConnectError: All connection attempts failed"}
    }
    world.step(scrape=refused)
    assert world.weight("decode-1") == 1.0, "one scrape that cannot connect is a blip"
    world.step(scrape=refused)
    assert world.weight("decode-1") == 0.0, "two in a row: nothing listens (before down_after_s)"


def test_a_failing_tick_is_counted_and_the_next_starts_fresh(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    world.step()
    table = world.reconciler.table
    import controller.observe as observe_mod

    real = observe_mod.observe

    def broken(*a: object, **k: object) -> object:
        raise StoreError("database is down")

    monkeypatch.setattr(observe_mod, "observe", broken)
    with pytest.raises(StoreError):
        world.step()
    assert world.reconciler.tick_safe() is None
    v = world.reconciler.view()
    assert v.failed_ticks == 2 and "database is down" in (v.last_error or "")
    assert world.reconciler.table == table, "the served table is unchanged by a failed tick"
    monkeypatch.setattr(observe_mod, "observe", real)
    out = world.step()
    assert out is not None and world.reconciler.view().last_error is None


def test_restart_reloads_weights_alerts_and_version(world: World) -> None:
    for _ in range(2):
        world.step()
    for _ in range(8):  # until its weight has reached its target: the tick after the restart moves nothing
        world.step(handoff_s={"decode-2": 0.5}, scrape={"prefill_0": {"expired": 1.0}})
    w = world.weight("decode-2")
    version = world.reconciler.table.version
    fresh = Reconciler(
        world.settings,
        world.factory,
        effects=default_effects(world.settings, world.factory, clock=world.clock),
        clock=world.clock,
        alert_config=world.reconciler.alert_config,
    )
    cut = world.reconciler._state.weights["decode-2"]
    out = fresh.tick()
    assert next(d for d in out.weights if d.instance == "decode-2").old_weight == w
    # where it was last cut survives the restart (past it, a raise waits a window)
    assert w < 1.0 and cut.ceiling < 1.0
    with transaction(world.factory) as s:
        from controller.persist import load_state

        assert load_state(s)[0].weights["decode-2"].ceiling == cut.ceiling
    assert fresh.table.version >= version
    assert any(a.rule == "KVLeaseExpired" for a in out.alerts.active)
    with transaction(world.factory) as s:
        assert s.scalar(select(func.count()).select_from(Alert).where(Alert.rule == "KVLeaseExpired")) == 1


def test_restart_carries_the_whole_policy_state_and_decisions_name_their_policy(world: World) -> None:
    """Streaks, smoothing, when a weight was lowered and raised, its ceiling, a pool's cooldown: all of it
    survives a restart exactly, from ``policy_state`` (not from the decisions' scores), and every decision
    names the stored policy config it was taken under."""
    for _ in range(2):
        world.step()
    for _ in range(5):
        world.step(handoff_s={"decode-2": 0.5})
    for _ in range(10):  # healthy again, until a streak is running and the weight is not raised yet
        world.step()
        if world.reconciler._state.weights["decode-2"].healthy_streak > 0:
            break
    before = world.reconciler._state
    assert before.weights["decode-2"].healthy_streak > 0 and before.weights["decode-2"].ceiling < 1.0
    fresh = Reconciler(
        world.settings,
        world.factory,
        effects=default_effects(world.settings, world.factory, clock=world.clock),
        clock=world.clock,
        alert_config=world.reconciler.alert_config,
    )
    with transaction(world.factory) as s:
        from controller.persist import load_state

        state = load_state(s)[0]
        assert dict(state.weights) == dict(before.weights)
        assert dict(state.limits) == dict(before.limits)
        rows = s.scalars(select(Decision)).all()
        assert rows and {r.policy for r in rows} == {world.reconciler.cfg.fingerprint()}
        cfg = s.get(PolicyConfigRow, world.reconciler.cfg.fingerprint())
        assert cfg is not None and cfg.config["min_weight"] == world.reconciler.cfg.min_weight
        assert all(not k.startswith("_") for r in rows for k in r.scores), "no carried state in the scores"
    out = fresh.tick()
    # the old process' next tick, from its memory, on the same data: the pure step alone, since the
    # store fences the old process off now that the fresh one has taken over (test_leader.py)
    obs = fresh.view().obs
    assert obs is not None
    rec = world.reconciler
    same = decide(
        TickInput(obs, before, (), rec.instances, rec.pools, rec.mode), rec.cfg, rec.rules, rec.alert_config
    )
    mine = {d.instance: (d.weight, d.reason, d.state) for d in out.weights}
    theirs = {d.instance: (d.weight, d.reason, d.state) for d in same.weights}
    assert mine == theirs


@pytest.mark.parametrize(
    "bad",
    [
        {"weight": "abc"},
        None,
        [1, 2],
        {"ceiling": None},
        {"healthy_streak": True},
        {"extra": 1},
    ],
)
def test_a_stored_state_that_does_not_fit_is_not_loaded_and_costs_only_itself(
    world: World, bad: object
) -> None:
    """A policy_state row another version (or a hand edit) wrote in another shape: that subject falls back
    to its newest decisions; every other subject keeps its state and the next tick runs."""
    import json

    from sqlalchemy import update

    from controller.persist import load_state
    from store.models import PolicyStateRow

    for _ in range(2):
        world.step()
    for _ in range(4):
        world.step(handoff_s={"decode-2": 0.5})
    good = world.reconciler._state.weights["decode-1"]
    with transaction(world.factory) as s:
        row = s.get(PolicyStateRow, ("instance", "decode-2"))
        assert row is not None
        state = dict(row.state)
        if isinstance(bad, dict):
            state.update(bad)
            value: object = json.loads(json.dumps(state))
        else:
            value = bad
        s.execute(update(PolicyStateRow).where(PolicyStateRow.subject == "decode-2").values(state=value))
    with transaction(world.factory) as s:
        state_after = load_state(s)[0]
    assert state_after.weights["decode-2"].weight == world.weight("decode-2")  # from its newest decision
    assert state_after.weights["decode-2"].healthy_streak == 0
    assert state_after.weights["decode-1"] == good
    fresh = Reconciler(
        world.settings,
        world.factory,
        effects=default_effects(world.settings, world.factory, clock=world.clock),
        clock=world.clock,
        alert_config=world.reconciler.alert_config,
    )
    world.clock.advance(2.0)
    assert fresh.tick() is not None


def test_override_expiry_is_a_stored_decision(world: World) -> None:
    world.step()
    now = world.clock()
    with transaction(world.factory) as s:
        s.add(
            WeightOverride(
                subject_kind="instance",
                subject="decode-0",
                weight=0.2,
                drained=False,
                reason="test",
                actor="sre",
                created=now,
                expires=now + 3.0,
            )
        )
    world.step()
    assert world.weight("decode-0") == 0.2
    world.step()
    assert world.weight("decode-0") == 1.0
    with transaction(world.factory) as s:
        rows = s.scalars(select(Decision).where(Decision.field == "served_weight")).all()
        assert [r.reason for r in rows] == ["ManualOverride", "OverrideEnded"]


def test_advisory_mode_decides_but_says_so(world: World) -> None:
    rec = Reconciler(
        world.settings,
        world.factory,
        effects=default_effects(world.settings, world.factory, clock=world.clock),
        clock=world.clock,
        mode="advisory",
    )
    world.step(tick=False)
    out = rec.tick()
    assert out.table.mode == "advisory" and out.table.enforce is False


def test_stale_store_holds_weights_and_raises_collector_behind(world: World) -> None:
    for _ in range(3):
        world.step(handoff_s={"decode-2": 0.5})
    assert world.weight("decode-2") < 1.0
    for _ in range(8):  # nothing new is written: the collector stopped; 16 s later the data is stale
        world.clock.advance(2.0)
        world.reconciler.tick()
    w = world.weight("decode-2")
    for _ in range(6):
        world.clock.advance(2.0)
        out = world.reconciler.tick()
        assert {d.reason for d in out.weights} == {"StaleData"}
    assert world.weight("decode-2") == w
    with transaction(world.factory) as s:
        a = s.scalars(select(Alert).where(Alert.rule == "CollectorBehind")).one()
        assert a.state == "firing"


def test_a_state_stored_before_a_field_was_added_loads_with_its_default() -> None:
    """A policy_state row written before ``cut_for`` existed keeps its ceiling and streaks across the
    upgrade (the field takes its default); one with a field this version does not know is not loaded."""
    import json
    from dataclasses import replace

    from controller.persist import _weight_state
    from controller.policy.codec import dump
    from controller.policy.weights import WeightState
    from pdscope.reasons import Reason

    ws = WeightState(
        weight=0.5, smoothed=0.5, reason=Reason.STEADY, ceiling=0.75, cut_for=Reason.SLOW_HANDOFF
    )
    stored = json.loads(json.dumps(dump(ws)))
    assert _weight_state(stored) == ws
    older = {k: v for k, v in stored.items() if k != "cut_for"}
    assert _weight_state(older) == replace(ws, cut_for=None)
    assert _weight_state({**stored, "from_the_future": 1}) is None
    assert _weight_state({k: v for k, v in stored.items() if k != "weight"}) is None


class _FailsOnce:
    """A tick recorder that fails the first tick it is asked to record after ``arm``."""

    def __init__(self) -> None:
        self.armed = False

    def record(self, session: object, tick: object) -> dict[str, int]:
        if self.armed:
            self.armed = False
            raise RuntimeError("a recorder failed")
        return {}


def test_the_window_reads_are_counted_over_the_process_life_across_a_failed_tick(world: World) -> None:
    """A failed tick forgets the kept window (the next tick reads it whole), never the reads' counts."""
    fails = _FailsOnce()
    world.reconciler.effects = dataclasses.replace(
        world.reconciler.effects, recorders=(*world.reconciler.effects.recorders, fails)
    )
    world.step()
    world.step()
    assert world.reconciler.view().window_reads[:2] == (("slo", 1, 1), ("evidence", 1, 1))
    fails.armed = True
    with pytest.raises(RuntimeError):
        world.step()
    world.step()
    assert world.reconciler.view().window_reads[:2] == (("slo", 2, 2), ("evidence", 2, 2))
