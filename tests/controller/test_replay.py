"""Policy replay over ticks the reconciler recorded: the stored config reproduces every stored
decision exactly (SQLite and PostgreSQL); a candidate says where it parts from the run."""

from __future__ import annotations

import dataclasses
import math

import pytest
from sqlalchemy import func, select

from controller.loop import Reconciler
from controller.policy import AlertConfig, InstanceSignals, Observation, PolicyConfig, PolicyState
from controller.policy.codec import CodecError, dump, load
from controller.policy.config import EVIDENCE_ONLY
from controller.replay import Candidate, NoTicks, ReplayError, parse_change, replay_window
from controller.wiring import default_effects
from store.db import transaction
from store.models import Decision, TickRecord
from tests.controller.conftest import World


def _run(world: World) -> None:
    """A run with every kind of decision: a slow D cut and recovered, a lease alert, an outage."""
    for _ in range(4):
        world.step()
    for _ in range(6):
        world.step(handoff_s={"decode-2": 0.5}, scrape={"decode_2": {"xfer_s": 0.1}})
    world.step(scrape={"prefill_1": {"expired": 2.0}})
    for _ in range(6):
        world.step(scrape={"decode_1": {"up": False}})
    for _ in range(8):
        world.step()


def _window(world: World) -> tuple[float, float]:
    with transaction(world.factory) as s:
        lo = s.scalar(select(func.min(TickRecord.ts)))
        hi = s.scalar(select(func.max(TickRecord.ts)))
    assert lo is not None and hi is not None
    return lo, hi


def test_the_stored_config_reproduces_every_stored_decision(world: World) -> None:
    _run(world)
    lo, hi = _window(world)
    with transaction(world.factory) as s:
        n_decisions = s.scalar(select(func.count()).select_from(Decision))
        result = replay_window(s, lo, hi)
    assert n_decisions and n_decisions > 10, "the run took decisions of several kinds"
    assert result.ticks == 25
    assert result.mismatches == () and result.reproduced is True
    assert result.identical and result.first_divergence is None
    assert sum(a for a, _ in result.decisions.values()) == n_decisions
    assert {k: a for k, (a, _) in result.decisions.items()} == {
        k: b for k, (_, b) in result.decisions.items()
    }
    assert any(k.startswith("KVLeaseExpired{") for k in result.alerts)


def test_a_restart_inside_the_window_is_replayed_as_it_happened(world: World) -> None:
    for _ in range(4):
        world.step(handoff_s={"decode-2": 0.5}, scrape={"decode_2": {"xfer_s": 0.1}})
    world.step(scrape={"prefill_1": {"expired": 2.0}})
    # a new controller process on the same store: a new epoch, the tick counter from 0, reloaded state
    world.reconciler = Reconciler(
        world.settings,
        world.factory,
        effects=default_effects(world.settings, world.factory, clock=world.clock, notifier=world.notifier),
        clock=world.clock,
        alert_config=AlertConfig(for_s={"KVLeaseExpired": 0.0, "InstanceDown": 4.0}),
    )
    for _ in range(6):
        world.step(handoff_s={"decode-2": 0.5}, scrape={"decode_2": {"xfer_s": 0.1}})
    lo, hi = _window(world)
    with transaction(world.factory) as s:
        result = replay_window(s, lo, hi)
    assert result.restarts == 1
    assert result.mismatches == () and result.reproduced is True


def test_a_candidate_says_where_it_parts_from_the_run(world: World) -> None:
    _run(world)
    lo, hi = _window(world)
    with transaction(world.factory) as s:
        stored = replay_window(s, lo, hi)
        gentle = replay_window(s, lo, hi, Candidate(changes={"max_weight_step": 0.05}))
        same = replay_window(s, lo, hi, Candidate(changes={"band_up": 0.10}))  # the stored value
    assert same.identical and same.reproduced is True
    assert not gentle.identical and gentle.reproduced is True, "the run it is compared with holds"
    first = gentle.first_divergence
    assert first is not None and first.what == "weight" and first.subject == "decode-2"
    assert float(first.replayed) > float(first.actual), "a smaller step cuts less at once"
    slow = gentle.weights["decode-2"]
    assert slow.replayed.mean is not None and slow.actual.mean is not None
    assert slow.replayed.mean > slow.actual.mean
    assert stored.weights["decode-2"].actual == slow.actual, (
        "the run's side is the run, whatever the candidate"
    )
    assert gentle.weights["decode-0"].actual == gentle.weights["decode-0"].replayed
    assert 0 < gentle.divergent_ticks < gentle.ticks


def test_a_window_without_ticks_or_before_the_records_is_refused(world: World) -> None:
    _run(world)
    lo, hi = _window(world)
    with transaction(world.factory) as s:
        with pytest.raises(NoTicks, match="no controller tick was recorded"):
            replay_window(s, hi + 10, hi + 20)
        # ticks that left no record (as before migration 0010): their decisions are in the window
        first = s.scalars(select(TickRecord).order_by(TickRecord.ts).limit(12)).all()
        for row in first:
            s.delete(row)
    with transaction(world.factory) as s, pytest.raises(ReplayError, match="left no record"):
        replay_window(s, lo, hi)


def test_ticks_of_another_policy_version_are_refused_naming_it(world: World) -> None:
    for _ in range(3):
        world.step()
    lo, hi = _window(world)
    with transaction(world.factory) as s:
        row = s.scalars(select(TickRecord).order_by(TickRecord.id)).first()
        assert row is not None
        row.policy_version = 0
    with (
        transaction(world.factory) as s,
        pytest.raises(ReplayError, match="policy version 0; this pdscope runs"),
    ):
        replay_window(s, lo, hi)


def test_a_candidate_across_a_config_change_is_refused(world: World) -> None:
    for _ in range(3):
        world.step()
    world.reconciler = Reconciler(
        world.settings,
        world.factory,
        effects=default_effects(world.settings, world.factory, clock=world.clock, notifier=world.notifier),
        clock=world.clock,
        alert_config=AlertConfig(),
    )
    world.reconciler.cfg = dataclasses.replace(world.reconciler.cfg, band_up=0.2)
    world.reconciler.policy = world.reconciler.cfg.fingerprint()
    for _ in range(3):
        world.step()
    lo, hi = _window(world)
    with transaction(world.factory) as s:
        assert replay_window(s, lo, hi).reproduced is True, "each tick under its own stored config"
        with pytest.raises(ReplayError, match="straddles a config change"):
            replay_window(s, lo, hi, Candidate(changes={"min_weight": 0.1}))


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("min_weight", "expected name=value"),
        ("min_wieght=0.1", "not a policy setting"),
        ("recover_ticks=1.5", "not an integer"),
        ("min_weight=abc", "not a number"),
        ("min_weight=nan", "finite"),
        ("min_weight=-1", "at least 0"),
        *((f"{name}=3", "acts only in the evidence step") for name in sorted(EVIDENCE_ONLY)),
    ],
)
def test_a_bad_setting_is_refused_naming_it(text: str, problem: str) -> None:
    with pytest.raises(ReplayError, match=problem) as info:
        parse_change(text)
    assert text.split("=")[0] in str(info.value)


def test_parse_change_reads_the_field_type() -> None:
    assert parse_change("recover_ticks=5") == ("recover_ticks", 5)
    assert parse_change(" min_weight = 0.05") == ("min_weight", 0.05)


def test_the_codec_round_trips_exactly_and_names_what_does_not_fit() -> None:
    inst = InstanceSignals(
        "d-0", "decode", "decode", up=True, kv_usage=0.1 + 0.2, ttft_mean_s=math.inf, handoff_p99_s=None
    )
    obs = Observation(now=1.8e9 + 1 / 3, window_s=60.0, instances=(inst,))
    back = load(Observation, dump(obs))
    assert back == obs and back.instances[0].kv_usage == 0.1 + 0.2
    cfg = PolicyConfig.defaults()
    assert load(PolicyState, dump(PolicyState())) == PolicyState()
    assert PolicyConfig(**cfg.as_dict()).fingerprint() == cfg.fingerprint()
    doc = dump(obs)
    doc["instances"][0]["kv_usage"] = "full"
    with pytest.raises(CodecError, match=r"instances\[0\]\.kv_usage"):
        load(Observation, doc)
    doc = dump(obs)
    doc["instances"][0]["surprise"] = 1
    with pytest.raises(CodecError, match="unknown field"):
        load(Observation, doc)
    doc = dump(obs)
    del doc["window_s"]
    with pytest.raises(CodecError, match="missing field"):
        load(Observation, doc)
    doc = dump(obs)
    doc["instances"][0]["role"] = "router"
    with pytest.raises(CodecError, match="role"):
        load(Observation, doc)


def test_a_stored_decision_unlike_the_policy_is_found(world: World) -> None:
    """The check can fail: a decision row changed after the fact is a mismatch, named."""
    _run(world)
    lo, hi = _window(world)
    with transaction(world.factory) as s:
        row = s.scalars(
            select(Decision)
            .where(Decision.subject == "decode-2", Decision.field == "weight")
            .order_by(Decision.id)
        ).first()
        assert row is not None and row.new_value is not None
        row.new_value += 0.01
    with transaction(world.factory) as s:
        result = replay_window(s, lo, hi)
    assert result.reproduced is False and result.mismatch_count == 1
    (m,) = result.mismatches
    assert (m.what, m.subject, m.field) == ("decision", "decode-2", "weight")


def test_the_record_leaves_out_defaults_and_what_the_policy_does_not_read(world: World) -> None:
    """The tick record keeps the observation as the policy reads it (the P×D pairs for the handoff
    matrix; their p99 and the instances' left out) and drops every field at its default; the decode must
    give back the same input, and replay reproduces (the tests above)."""
    from controller.ticklog import fields_of, policy_observation, policy_pairs, rebuild

    world.step()
    world.step(handoff_s={"decode-2": 0.5})
    assert world.reconciler.view().obs is not None and world.reconciler.view().obs.pairs, "the run saw pairs"  # type: ignore[union-attr]
    with transaction(world.factory) as s:
        *_, doc = rebuild(s.scalars(select(TickRecord).order_by(TickRecord.id)))
        inp, _, _, after = fields_of(doc)
    obs = world.reconciler.view().obs
    assert obs is not None and len(after) == 32
    assert inp.obs.pairs == policy_pairs(obs.pairs) and all(x.handoff_p99_s == 0.0 for x in inp.obs.pairs)
    assert any(x.handoff_p99_s is not None for x in obs.instances), "the run saw an instance's p99"
    assert inp.obs == policy_observation(obs) and all(x.handoff_p99_s is None for x in inp.obs.instances)
    compact, full = dump(obs, compact=True), dump(obs)
    assert len(str(compact)) < len(str(full)) and load(Observation, compact) == obs
