"""Compatible pairs only: the rule per field (pdscope.kvcompat), the pairs left out and the instances
with no partner (controller.policy.compat), the table and the IncompatiblePair alert (through the tick)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from controller.policy import AlertConfig, Observation, PolicyConfig, SLOFigures
from controller.policy.alerts import default_rules, step_alerts
from controller.policy.compat import judge
from controller.policy.tick import PolicyState, TickInput, decide
from pdscope.kvcompat import MALFORMED, compare, identity
from pdscope.reasons import Reason
from tests.controller.replay import T0, fleet, pool_specs, specs

CFG = PolicyConfig.defaults()
BASE = {"model": "m", "block_size": "16", "cache_dtype": "auto"}


@pytest.mark.parametrize(
    ("p", "d", "status", "fields"),
    [
        (BASE, BASE, "compatible", ()),
        (BASE | {"revision": "r1"}, BASE | {"revision": "r1"}, "compatible", ()),
        ({}, {}, "compatible", ()),  # neither reports anything: nothing to compare (an old vLLM)
        ({"model": "m"}, {"model": "m"}, "compatible", ()),  # no cache_config_info on either side
        (BASE, BASE | {"block_size": "32"}, "incompatible", ("block_size",)),
        (BASE, BASE | {"cache_dtype": "fp8"}, "incompatible", ("cache_dtype",)),
        (BASE, BASE | {"model": "other"}, "incompatible", ("model",)),
        (BASE | {"revision": "r1"}, BASE | {"revision": "r2"}, "incompatible", ("revision",)),
        (BASE, {"model": "m"}, "unknown", ("block_size", "cache_dtype")),  # one side reports, one not
        (BASE | {"revision": "r1"}, BASE, "unknown", ("revision",)),
        (BASE, BASE | {"block_size": "sixteen"}, "unknown", ("block_size",)),  # malformed
        (BASE, BASE | {"block_size": "0"}, "unknown", ("block_size",)),
        (BASE, BASE | {"cache_dtype": MALFORMED}, "unknown", ("cache_dtype",)),  # engines disagree
        (BASE | {"model": "x" * 300}, BASE | {"model": "x" * 300}, "unknown", ("model",)),  # too long
        (BASE | {"model": "a\nb"}, BASE | {"model": "a\nb"}, "unknown", ("model",)),
        # a field that differs wins over one unknown: the pair is incompatible whatever the rest says
        (BASE, BASE | {"block_size": "32", "cache_dtype": "?"}, "incompatible", ("block_size",)),
    ],
)
def test_the_rule_per_field(
    p: dict[str, str], d: dict[str, str], status: str, fields: tuple[str, ...]
) -> None:
    v = compare(identity(p), identity(d))
    assert (v.status, v.fields) == (status, fields)
    assert all(f in v.text for f in fields)


def _obs(t: float = 0.0, **ids: dict[str, str] | None) -> Observation:
    """The replay fleet (2 P, 4 D), each instance with BASE unless ``ids`` says otherwise (None: nothing
    on record)."""
    insts = tuple(
        replace(i, identity=None if ids.get(i.name, BASE) is None else identity(ids.get(i.name) or BASE))
        for i in fleet()
    )
    return Observation(
        now=T0 + t, window_s=30.0, instances=insts, slo=SLOFigures(300.0), newest_data=T0 + t - 1
    )


def _pairs(obs: Observation) -> set[tuple[str, str, str]]:
    return {(a.p_instance, a.d_instance, a.status) for a in judge(obs, {}).avoided}


def test_a_healthy_fleet_avoids_nothing_and_has_a_partner_everywhere() -> None:
    c = judge(_obs(), {})
    assert c.avoided == () and c.unpaired == () and c.no_partner == {}
    old = judge(_obs(**{i.name: {} for i in fleet()}), {})  # no instance reports anything
    assert old.avoided == () and old.no_partner == {}


def test_a_d_with_another_block_size_is_paired_with_nobody() -> None:
    c = judge(_obs(**{"decode-3": BASE | {"block_size": "32"}}), {})
    assert {(a.p_instance, a.d_instance, a.status) for a in c.avoided} == {
        ("prefill-0", "decode-3", "incompatible"),
        ("prefill-1", "decode-3", "incompatible"),
    }
    assert c.unpaired == ("decode-3",)
    assert (
        list(c.no_partner or {}) == ["decode-3"]
        and "block_size '16' vs '32'" in (c.no_partner or {})["decode-3"]
    )


def test_a_rollout_pairs_each_revision_with_its_own() -> None:
    new = BASE | {"revision": "r2"}
    old = BASE | {"revision": "r1"}
    c = judge(
        _obs(
            **{
                "prefill-0": old,
                "decode-0": old,
                "decode-1": old,
                "prefill-1": new,
                "decode-2": new,
                "decode-3": new,
            }
        ),
        {},
    )
    assert {(a.p_instance, a.d_instance) for a in c.avoided} == {
        ("prefill-0", "decode-2"),
        ("prefill-0", "decode-3"),
        ("prefill-1", "decode-0"),
        ("prefill-1", "decode-1"),
    }
    assert c.unpaired == () and c.no_partner == {}


def test_an_unknown_pair_is_left_out_where_a_side_has_a_compatible_partner() -> None:
    # decode-3 reports no block size: unknown toward every P, and every P has a compatible D
    c = judge(_obs(**{"decode-3": {"model": "m", "cache_dtype": "auto"}}), {})
    assert _pairs(_obs(**{"decode-3": {"model": "m", "cache_dtype": "auto"}})) == {
        ("prefill-0", "decode-3", "unknown"),
        ("prefill-1", "decode-3", "unknown"),
    }
    assert c.unpaired == ("decode-3",) and "unknown" in (c.no_partner or {})["decode-3"]
    # nobody has a compatible partner (every D malformed): the unknown pairs stay routable, and are alerted
    bad = {f"decode-{i}": BASE | {"block_size": "x"} for i in range(4)}
    everywhere = judge(_obs(**bad), {})
    assert everywhere.avoided == () and everywhere.unpaired == ()
    assert sorted(everywhere.no_partner or {}) == sorted(i.name for i in fleet())


def test_an_instance_with_nothing_on_record_is_left_out_but_not_alerted() -> None:
    c = judge(_obs(**{"decode-3": None}), {})
    assert c.unpaired == ("decode-3",) and c.no_partner == {}
    assert judge(_obs(**{i.name: None for i in fleet()}), {}).avoided == ()  # the controller's first ticks


def _tick(obs: Observation, state: PolicyState) -> object:
    ac = AlertConfig(for_s={"IncompatiblePair": 0.0})
    inp = TickInput(obs, state, (), specs(obs.instances), pool_specs(), "enforce")
    return decide(inp, CFG, default_rules(ac), ac)


def test_the_tick_serves_the_pairs_left_out_with_their_reason_and_keeps_their_since() -> None:
    odd = {"decode-3": BASE | {"cache_dtype": "fp8"}}
    first = _tick(_obs(**odd), PolicyState())
    avoid = first.table.avoid_pairs  # type: ignore[attr-defined]
    assert {(a.prefill, a.decode, a.reason) for a in avoid} == {
        ("prefill-0", "decode-3", Reason.INCOMPATIBLE_PAIR),
        ("prefill-1", "decode-3", Reason.INCOMPATIBLE_PAIR),
    }
    assert all(
        a.since == T0 and a.text.startswith("incompatible: P and D differ: cache_dtype") for a in avoid
    )
    later = _tick(_obs(10.0, **odd), first.state)  # type: ignore[attr-defined]
    assert later.table.avoid_pairs == avoid and not later.table_changed  # type: ignore[attr-defined]
    healthy = _tick(_obs(20.0), later.state)  # type: ignore[attr-defined]
    assert healthy.table.avoid_pairs == []  # type: ignore[attr-defined]


def test_incompatible_pair_fires_for_the_instance_paired_with_nobody_and_stays_quiet_on_a_healthy_fleet() -> (
    None
):
    ac = AlertConfig(for_s={"IncompatiblePair": 0.0})
    rules = default_rules(ac)
    step = step_alerts(rules, _obs(**{"decode-3": BASE | {"model": "other"}}), CFG, ac, {})
    fired = {a.labels["instance"]: a.description for a in step.active if a.rule == "IncompatiblePair"}
    assert list(fired) == ["decode-3"] and "model 'm' vs 'other'" in fired["decode-3"]
    quiet = step_alerts(rules, _obs(), CFG, ac, {})
    assert not [a for a in quiet.active if a.rule == "IncompatiblePair"]
