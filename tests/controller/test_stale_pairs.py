"""Stale peers after a restart: the pair is left out of routing until served again, and its failures are
not the D's (controller.policy.stale, through the tick)."""

from __future__ import annotations

from dataclasses import replace

from controller.policy import AlertConfig, Observation, PolicyConfig, SLOFigures
from controller.policy.alerts import default_rules
from controller.policy.signals import PairSignals
from controller.policy.stale import StalePair, avoided, relieve_stale, stale_pairs
from controller.policy.tick import PolicyState, TickInput, decide
from tests.controller.replay import T0, fleet, pool_specs, specs

RESTART = T0 - 50.0
CFG = PolicyConfig.defaults()
MIN = CFG.min_error_events


def _obs(
    t: float, pairs: tuple[PairSignals, ...], restarted: float | None = RESTART, **d0: object
) -> Observation:
    insts = tuple(
        replace(i, restarted_at=restarted)
        if i.name == "prefill-0"
        else replace(i, **d0)
        if i.name == "decode-0"
        else i
        for i in fleet()
    )
    return Observation(
        now=T0 + t, window_s=30.0, instances=insts, pairs=pairs, slo=SLOFigures(300.0), newest_data=T0 + t - 1
    )


def _pair(d: str = "decode-0", failed: int = 0, served: int = 0, p: str = "prefill-0") -> PairSignals:
    return PairSignals(
        p, d, served, 0.05, 0.08, failures=failed, failed_since_restart=failed, served_since_restart=served
    )


def test_a_pair_that_failed_since_its_ps_restart_and_served_none_is_stale() -> None:
    found = stale_pairs(_obs(0, (_pair(failed=MIN), _pair("decode-1", served=5))), {}, MIN)
    assert list(found) == ["prefill-0->decode-0"]
    sp = found["prefill-0->decode-0"]
    assert (sp.since, sp.restarted_at, sp.failed) == (T0, RESTART, MIN)
    assert "decode-0 failed" in sp.text and "prefill-0 restarted" in sp.text


def test_too_few_failures_a_served_handoff_or_no_confirmed_restart_is_not_stale() -> None:
    assert stale_pairs(_obs(0, (_pair(failed=MIN - 1),)), {}, MIN) == {}
    assert stale_pairs(_obs(0, (_pair(failed=MIN + 3, served=1),)), {}, MIN) == {}
    assert stale_pairs(_obs(0, (_pair(failed=MIN + 3),), restarted=None), {}, MIN) == {}


def test_a_stale_pair_stays_stale_until_served_and_is_judged_afresh_after_another_restart() -> None:
    prev = {"prefill-0->decode-0": StalePair("prefill-0", "decode-0", T0, RESTART, MIN)}
    # avoided: no traffic through it in the window, it stays
    assert list(stale_pairs(_obs(10, ()), prev, MIN)) == ["prefill-0->decode-0"]
    assert stale_pairs(_obs(10, ()), prev, MIN)["prefill-0->decode-0"].since == T0
    # a probe failed: still stale
    assert list(stale_pairs(_obs(20, (_pair(failed=1),)), prev, MIN)) == ["prefill-0->decode-0"]
    # a probe was served: back in routing, its failures still the pair's for one window
    healed = stale_pairs(_obs(30, (_pair(served=1),)), prev, MIN)
    assert healed["prefill-0->decode-0"].healed_at == T0 + 30 and avoided(healed) == []
    assert stale_pairs(_obs(59, ()), healed, MIN) == healed  # window_s 30
    assert stale_pairs(_obs(60, ()), healed, MIN) == {}
    # P restarted again: judged afresh (one failure since is too few)
    assert stale_pairs(_obs(30, (_pair(failed=1),), restarted=RESTART + 40), prev, MIN) == {}
    # P left the fleet
    gone = replace(_obs(30, ()), instances=tuple(i for i in fleet() if i.name != "prefill-0"))
    assert stale_pairs(gone, prev, MIN) == {}


def test_a_stale_pairs_failures_are_taken_off_its_d_and_its_others_stay() -> None:
    obs = _obs(
        0, (_pair(failed=4), _pair(failed=4, p="prefill-1")), failed_requests=6, failed_transfers_per_min=10.0
    )
    stale = stale_pairs(obs, {}, MIN)
    moved, basis = relieve_stale(obs, stale)
    d0 = moved.instance("decode-0")
    assert (
        d0 is not None and d0.failed_requests == 3 and d0.failed_transfers_per_min == 5.0
    )  # half are the pair's
    assert "4 of its 8 failed handoffs are toward prefill-0" in basis["decode-0"] and set(basis) == {
        "decode-0"
    }
    assert [x.failures for x in moved.pairs] == [0, 4]


def test_while_a_ps_restart_is_fresh_a_ds_failures_no_record_names_yet_are_not_its_own() -> None:
    # vLLM's counter runs ahead of the records of the failed handoffs
    fresh = _obs(0, (), restarted=T0 - 5.0, failed_transfers_per_min=30.0)
    d0 = relieve_stale(fresh, {})[0].instance("decode-0")
    assert d0 is not None and d0.failed_transfers_per_min == 0.0
    assert "restarted within the window" in relieve_stale(fresh, {})[1]["decode-0"]
    old = _obs(0, (), restarted=T0 - 500.0, failed_transfers_per_min=30.0)  # long ago: the D's own
    assert relieve_stale(old, {})[0].instance("decode-0").failed_transfers_per_min == 30.0  # type: ignore[union-attr]
    named = _obs(0, (_pair(failed=3, p="prefill-1"),), restarted=T0 - 5.0, failed_transfers_per_min=30.0)
    assert relieve_stale(named, {})[1] == {}  # the records name another P: its own


def test_a_restart_is_fresh_for_a_window_on_the_records_clock_when_they_lag() -> None:
    # restarted 40 s ago, a 30 s window: past it on the wall's clock; the newest record arrived 15 s ago
    lagging = replace(
        _obs(0, (), restarted=T0 - 40.0, failed_transfers_per_min=30.0), records_until=T0 - 15.0
    )
    moved, basis = relieve_stale(lagging, {})
    assert moved.instance("decode-0").failed_transfers_per_min == 0.0  # type: ignore[union-attr]
    assert "restarted within the window" in basis["decode-0"]
    current = replace(lagging, records_until=T0 - 1.0)  # the records keep up: the D's own
    assert relieve_stale(current, {}) == (current, {})
    # the records' clock reaches back one window at most (a lone old record does not stretch it further)
    ancient = replace(
        _obs(0, (), restarted=T0 - 61.0, failed_transfers_per_min=30.0), records_until=T0 - 500.0
    )
    assert relieve_stale(ancient, {}) == (ancient, {})
    ahead = replace(_obs(0, (), restarted=T0 - 40.0, failed_transfers_per_min=30.0), records_until=T0 + 99.0)
    assert relieve_stale(ahead, {}) == (ahead, {})  # a record stamped ahead of now moves nothing


def test_the_tick_leaves_a_stale_pair_out_of_the_table_and_does_not_cut_its_d() -> None:
    ac = AlertConfig()
    state = PolicyState()
    tables = []
    d0_weights = []
    for tick in range(1, 9):
        served = 1 if tick == 8 else 0  # a probe served on the last tick
        failed = 12 if tick < 8 else 0
        obs = _obs(
            tick,
            (_pair(failed=failed, served=served),),
            failed_requests=failed,
            failed_transfers_per_min=failed * 2.0,
        )
        out = decide(
            TickInput(obs, state, (), specs(fleet()), pool_specs(), "enforce"), CFG, default_rules(ac), ac
        )
        state = out.state
        tables.append(out.table)
        d0 = next(d for d in out.weights if d.instance == "decode-0")
        d0_weights.append(d0.weight)
        if tick == 3:
            assert "StalePeerAfterRestart" in d0.inputs["stale_peer_basis"]
    avoided = [[(a.prefill, a.decode, a.reason) for a in t.avoid_pairs] for t in tables]
    assert avoided[0] == [("prefill-0", "decode-0", "StalePeerAfterRestart")]
    assert all(a == avoided[0] for a in avoided[:7]) and avoided[7] == []
    assert min(d0_weights) == 1.0  # its failures were the pair's: never cut
    # without the restart on record, the same failures cut the D
    state = PolicyState()
    for tick in range(1, 8):
        obs = _obs(
            tick, (_pair(failed=12),), restarted=None, failed_requests=12, failed_transfers_per_min=24.0
        )
        out = decide(
            TickInput(obs, state, (), specs(fleet()), pool_specs(), "enforce"), CFG, default_rules(ac), ac
        )
        state = out.state
        assert out.table.avoid_pairs == []
    assert next(d for d in out.weights if d.instance == "decode-0").weight < 1.0


def test_a_stale_pair_of_long_names_still_makes_a_table() -> None:
    from controller.policy.routes import build_table
    from controller.policy.stale import StalePair as SP

    p, d = "p" * 128, "d" * 128
    table, _ = build_table(
        instances=(),
        pools=pool_specs(),
        policy_weights={},
        limits={},
        limit_reasons={},
        overrides=(),
        mode="enforce",
        now=T0,
        version=1,
        stale=[SP(p, d, T0, RESTART, 99)],
    )
    assert [(a.prefill, a.decode) for a in table.avoid_pairs] == [(p, d)]
    assert len(table.avoid_pairs[0].text) == 500
