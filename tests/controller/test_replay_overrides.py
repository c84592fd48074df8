"""Replay over windows with operator actions: every override set, replaced, cleared or expired, each
drain and undrain, alone, combined, within one tick and across a restart, reproduces exactly.

Each case drives a real reconciler on a store (the ``world`` fixture: SQLite, and PostgreSQL in the
``pg`` tier) through the same :class:`controller.overrides.OverridesService` the API uses, then
replays the recorded window under the stored config."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from sqlalchemy import func, select

from controller.bundle import replay_note
from controller.loop import Reconciler
from controller.overrides import Change, Kind, OverridesService, Slot
from controller.policy import AlertConfig
from controller.policy.refresh import MAX_REFRESHES, Between, Refresh
from controller.replay import Candidate, replay_window
from controller.ticklog import between_of, rebuild
from controller.wiring import default_effects
from store.db import transaction
from store.models import AuditEvent, TickRecord
from tests.controller.conftest import World

# One step of a sequence: "tick"; "wait <s>" (the clock moves, no tick); "restart" (a new controller
# process on the same store); or an operator action on a subject, applied between ticks:
#   "weight <name> <w> [ttl]", "clear <name>", "drain <name> [ttl]", "undrain <name>",
#   "pool <name> <w> [ttl]", "unpool <name>".
CASES: dict[str, list[str]] = {
    "drain then undrain within one tick": ["drain decode-1", "undrain decode-1", "tick", "tick"],
    "drain, ticks, undrain": ["drain decode-1", "tick", "tick", "undrain decode-1", "tick", "tick"],
    "drain and undrain between the same two ticks, twice": [
        "drain decode-1",
        "wait 0.3",
        "undrain decode-1",
        "tick",
        "drain decode-0",
        "undrain decode-0",
        "drain decode-0",
        "tick",
        "undrain decode-0",
        "tick",
    ],
    "a weight override set, replaced, then cleared early": [
        "weight decode-2 0.3",
        "tick",
        "weight decode-2 0.6",
        "tick",
        "clear decode-2",
        "tick",
        "tick",
    ],
    "a weight override set and cleared within one tick": ["weight decode-2 0.3", "clear decode-2", "tick"],
    "a weight override whose TTL expires between ticks": [
        "weight decode-2 0.3 3",
        "tick",
        "tick",
        "tick",
        "tick",
    ],
    "a drain whose TTL expires before the next tick": ["drain decode-3 1", "wait 1.5", "tick", "tick"],
    "a pool weight override set and cleared": [
        "pool decode 0.5",
        "tick",
        "unpool decode",
        "tick",
        "pool prefill 2 3",
        "tick",
        "tick",
        "tick",
    ],
    "a pool override set and cleared within one tick": ["pool decode 0.5", "unpool decode", "tick"],
    "combined: a drain over a weight override, pool override, one ends early": [
        "weight decode-1 0.4",
        "drain decode-1",
        "pool decode 0.7",
        "tick",
        "undrain decode-1",
        "tick",
        "clear decode-1",
        "unpool decode",
        "drain prefill-0 3",
        "tick",
        "tick",
        "tick",
    ],
    "across a controller restart": [
        "drain decode-1",
        "tick",
        "restart",
        "undrain decode-1",
        "weight decode-0 0.2",
        "tick",
        "drain decode-2",
        "undrain decode-2",
        "tick",
        "clear decode-0",
        "tick",
    ],
}


def _act(world: World, service: OverridesService, words: Sequence[str]) -> None:
    verb, name, *rest = words
    nums = [float(x) for x in rest]
    kind: Kind = "pool" if verb in ("pool", "unpool") else "instance"
    if verb in ("weight", "pool"):
        action = "pool_weight.set" if kind == "pool" else "weight.set"
        ttl = nums[1] if len(nums) > 1 else None
        change = Change(kind, name, "weight", action, "test", "op", True, nums[0], ttl)
    elif verb == "drain":
        change = Change(kind, name, "drain", "drain", "test", "op", True, None, nums[0] if nums else None)
    else:
        slot: Slot = "drain" if verb == "undrain" else "weight"
        action = {"undrain": "undrain", "clear": "weight.clear", "unpool": "pool_weight.clear"}[verb]
        change = Change.clear(kind, name, slot, action, "test", "op")
    if kind == "pool":
        service.change_pool(change)
    else:
        service.change_instance(change)


def run(world: World, steps: Sequence[str]) -> None:
    """Two quiet ticks, then ``steps`` with a tick after each action's clock step, then two more ticks."""
    world.step()
    world.step()
    service = OverridesService(world.reconciler)
    for step in steps:
        words = step.split()
        if words[0] == "tick":
            world.step()
        elif words[0] == "wait":
            world.clock.advance(float(words[1]))
        elif words[0] == "restart":
            world.reconciler = Reconciler(
                world.settings,
                world.factory,
                effects=default_effects(
                    world.settings, world.factory, clock=world.clock, notifier=world.notifier
                ),
                clock=world.clock,
                alert_config=AlertConfig(for_s={"KVLeaseExpired": 0.0, "InstanceDown": 4.0}),
            )
            service = OverridesService(world.reconciler)
        else:
            world.clock.advance(0.1)  # an operator acts between ticks
            _act(world, service, words)
    world.step()
    world.step()


@pytest.mark.parametrize("steps", list(CASES.values()), ids=list(CASES))
def test_operator_actions_replay_exactly(world: World, steps: list[str]) -> None:
    run(world, steps)
    lo, hi = _window(world)
    with transaction(world.factory) as s:
        assert s.scalar(select(func.count()).select_from(AuditEvent)), "the operator acted"
        result = replay_window(s, lo, hi)
    assert result.mismatches == () and result.mismatch_count == 0
    assert result.reproduced is True and result.identical


def _window(world: World) -> tuple[float, float]:
    with transaction(world.factory) as s:
        lo = s.scalar(select(func.min(TickRecord.ts)))
        hi = s.scalar(select(func.max(TickRecord.ts)))
    assert lo is not None and hi is not None
    return lo, hi


def test_a_candidate_over_operator_actions_parts_only_where_its_policy_does(world: World) -> None:
    """The candidate's side re-derives the same refreshes from its own state: the stored value of a
    setting is identical to the run, and a bundle over the window says it reproduces."""
    run(world, CASES["combined: a drain over a weight override, pool override, one ends early"])
    lo, hi = _window(world)
    with transaction(world.factory) as s:
        same = replay_window(s, lo, hi, Candidate(changes={"band_up": 0.10}))  # the stored value
    assert same.reproduced is True and same.identical, same.divergences
    assert all(a == b for a, b in same.decisions.values()), same.decisions  # no decision it did not take
    note = replay_note(world.factory, lo, hi)
    assert note.startswith("replay: the stored config reproduces the window's"), note


def test_more_refreshes_than_a_record_keeps_still_reproduce(world: World) -> None:
    """Past MAX_REFRESHES between two ticks the oldest are dropped and counted; the run's table before
    the tick is then the recorded one, and the rest still re-derives."""
    n = MAX_REFRESHES // 2 + 3
    run(world, [*(["drain decode-1", "undrain decode-1"] * n), "drain decode-2", "tick", "tick"])
    lo, hi = _window(world)
    with transaction(world.factory) as s:
        rows = s.scalars(select(TickRecord).order_by(TickRecord.id)).all()
        kept = [between_of(doc) for doc in rebuild(rows)]
        result = replay_window(s, lo, hi)
    assert [b.dropped for b in kept if b.refreshes] == [2 * n + 1 - MAX_REFRESHES]
    assert result.mismatches == () and result.reproduced is True


def test_a_record_keeps_the_refreshes_in_order_and_none_when_there_were_none(world: World) -> None:
    run(world, ["weight decode-0 0.5", "drain decode-0", "tick"])
    with transaction(world.factory) as s:
        kept = [between_of(doc) for doc in rebuild(s.scalars(select(TickRecord).order_by(TickRecord.id)))]
    busy = [b for b in kept if b != Between()]
    assert len(busy) == 1 and busy[0].dropped == 0
    first, second = busy[0].refreshes
    assert first.now < second.now
    assert [o.weight for o in first.overrides] == [0.5]
    assert sorted((o.drained, o.weight) for o in second.overrides) == [(False, 0.5), (True, 0.0)]


def test_between_keeps_the_newest_and_counts_the_rest() -> None:
    b = Between()
    for i in range(5):
        b = b.add(Refresh(float(i)), limit=3)
    assert [r.now for r in b.refreshes] == [2.0, 3.0, 4.0] and b.dropped == 2
