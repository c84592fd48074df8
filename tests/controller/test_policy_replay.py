"""The pure replay (controller.policy.replay) over recorded ticks built by hand: what reproduces, what
a candidate changes, what a tampered record or a restart does. No store."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest

from controller.policy import AlertConfig, Observation, PolicyConfig, PolicyState, TickInput, compose, decide
from controller.policy.alerts import default_rules
from controller.policy.changes import changes
from controller.policy.codec import digest
from controller.policy.replay import RecordedTick, StoredChange, reloaded, replay
from controller.policy.routes import ServedInstance
from tests.controller.replay import VirtualClock, fleet, pool_specs, specs

SLOW: dict[str, Any] = {
    "nixl_xfer_mean_s": 0.5,
    "nixl_recent_s": 0.5,
    "handoff_p50_s": 0.6,
    "handoff_p99_s": 0.8,
}
CFG = PolicyConfig.defaults()
AC = AlertConfig()


def record(n: int, *, slow_from: int = 5, restart_at: int | None = None) -> list[RecordedTick]:
    """``n`` ticks of a 2P+4D fleet whose decode-2 turns slow at ``slow_from``, decided and recorded as
    the reconciler does (a restart at ``restart_at``: a new epoch, the tick counter and table anew)."""
    clock, base = VirtualClock(), fleet()
    state: PolicyState = PolicyState()
    served: Mapping[str, ServedInstance] = {}
    epoch = 1
    out: list[RecordedTick] = []
    for k in range(1, n + 1):
        now = clock.advance(CFG.interval_s)
        if k == restart_at:
            epoch += 1
            table, served, _ = compose(
                reloaded(state, PolicyState()), (), specs(base), pool_specs(), "enforce", now, {}, {}
            )
            state = reloaded(state, PolicyState(0, {}, {}, {}, table))
        insts = tuple(replace(i, **SLOW) if i.name == "decode-2" and k >= slow_from else i for i in base)
        obs = Observation(now=now, window_s=30.0, instances=insts, newest_data=now - 1.0)
        inp = TickInput(obs, state, (), specs(base), pool_specs(), "enforce")
        o = decide(inp, CFG, default_rules(AC), AC)
        stored = tuple(
            StoredChange(c.subject_kind, c.subject, c.field, c.old, c.new, c.reason, o.table.version)
            for c in changes(o, served)
        )
        out.append(
            RecordedTick(now, o.tick, epoch, CFG.fingerprint(), inp, served, AC, digest(o.state), stored)
        )
        state, served = o.state, o.served
    return out


CONFIGS = {CFG.fingerprint(): CFG}


def test_the_stored_config_reproduces_and_nothing_diverges() -> None:
    ticks = record(20)
    r = replay(ticks, CONFIGS)
    assert r.reproduced and r.identical and r.mismatch_count == 0 and r.restarts == 0
    cuts = [c for t in ticks for c in t.stored if c.subject == "decode-2"]
    assert cuts and cuts[0].new is not None and cuts[0].new < 1.0, "the slow D is cut"
    assert r.decisions[cuts[0].reason][0] == r.decisions[cuts[0].reason][1]


@pytest.mark.parametrize(
    ("change", "diverges", "cut_less"),
    [
        ({"max_weight_step": 0.05}, True, True),
        ({"latency_tolerance": 100.0}, True, True),  # nothing is slow enough to cut
        ({"band_up": 0.10}, False, False),  # the stored value: the same run
    ],
)
def test_a_candidate_parts_where_its_decisions_differ(
    change: dict[str, Any], diverges: bool, cut_less: bool
) -> None:
    ticks = record(20)
    r = replay(ticks, CONFIGS, dataclasses.replace(CFG, **change))
    assert r.reproduced, "the run it is compared with holds"
    assert (not r.identical) is diverges
    if diverges:
        assert r.first_divergence is not None and r.first_divergence.subject == "decode-2"
        assert r.first_divergence.ts >= ticks[4].ts, "not before the fault"
    w = r.weights["decode-2"]
    assert w.actual.mean is not None and w.replayed.mean is not None
    assert (w.replayed.mean > w.actual.mean) is cut_less
    assert r.weights["decode-0"].actual == r.weights["decode-0"].replayed


def test_a_tampered_decision_or_state_is_a_mismatch_named() -> None:
    ticks = record(20)
    k = next(i for i, t in enumerate(ticks) if t.stored)
    c = ticks[k].stored[0]
    bad = list(ticks)
    bad[k] = replace(ticks[k], stored=(replace(c, reason="SlowPrefill"), *ticks[k].stored[1:]))
    bad[k + 1] = replace(ticks[k + 1], after="0" * 32)
    r = replay(bad, CONFIGS)
    assert not r.reproduced and r.mismatch_count == 2
    assert [(m.what, m.subject, m.field) for m in r.mismatches] == [
        ("decision", c.subject, c.field),
        ("state", "*", "state after"),
    ]


def test_a_restart_is_replayed_as_the_restart_did_it() -> None:
    """Counted and carried through (the reload itself is checked against the real one in test_replay.py
    and across a kill -9 takeover in the fleet tier)."""
    ticks = record(20, restart_at=9)
    assert ticks[8].epoch == 2 and ticks[8].inp.state.tick == 0
    r = replay(ticks, CONFIGS)
    assert r.restarts == 1 and r.reproduced, r.mismatches[:3]


def test_no_ticks_is_an_empty_answer() -> None:
    r = replay([], CONFIGS)
    assert r.ticks == 0 and r.reproduced and r.identical and r.since is None
