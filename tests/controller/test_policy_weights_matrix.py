"""Weights judged by the window's P×D handoff matrix: only the side that is slow is cut (issue 29).

Each case builds one tick's observation by hand: the instances' own handoff medians as the
collector would give them (a D's median over the handoffs of every P it served), and the pairs'
medians. A P slow toward every D shows in every D's handoffs through it; a D's median over a mix
of that P's slow handoffs and the other's fast ones flips with the share it got, so per instance a
healthy D reads ten times its peers'. The matrix places the slowness on the P's row.
"""

from __future__ import annotations

from dataclasses import replace

from controller.policy import Observation, PairSignals, PolicyConfig, WeightDecision
from controller.policy.weights import WeightState, decide_weights
from pdscope.reasons import Reason
from tests.controller.replay import T0, fleet

CFG = PolicyConfig.defaults()
FAST, SLOW = 0.05, 0.5


def _tick(
    handoffs: dict[str, float], pairs: dict[tuple[str, str], float], n_p: int = 2, n_d: int = 4
) -> dict[str, WeightDecision]:
    """One tick's weight decisions: each instance's handoff median from ``handoffs`` (else fast),
    the pairs' from ``pairs`` (else fast), 20 handoffs a pair."""
    insts = tuple(replace(i, handoff_p50_s=handoffs.get(i.name, FAST)) for i in fleet(n_p, n_d))
    cells = tuple(
        PairSignals(f"prefill-{p}", f"decode-{d}", 20, pairs.get((f"prefill-{p}", f"decode-{d}"), FAST), 0.1)
        for p in range(n_p)
        for d in range(n_d)
    )
    obs = Observation(now=T0, window_s=30.0, instances=insts, pairs=cells, newest_data=T0)
    return {d.instance: d for d in decide_weights(obs, {}, CFG)}


def _cut(decisions: dict[str, WeightDecision]) -> dict[str, str]:
    return {name: str(d.reason) for name, d in decisions.items() if d.weight < 0.999}


def _slow_p_row() -> dict[tuple[str, str], float]:
    return {("prefill-1", f"decode-{d}"): SLOW for d in range(4)}


# prefill-1's NIC is slow toward every D; decode-0 and -1 happened to get more of its requests than of
# prefill-0's, so their own medians are its slow handoffs, and decode-2 and -3's the fast ones
MIXED_D_MEDIANS = {"prefill-1": SLOW, "decode-0": SLOW, "decode-1": SLOW}


def test_a_p_slow_toward_every_d_is_cut_as_a_p_and_no_d_is_cut() -> None:
    got = _tick(MIXED_D_MEDIANS, _slow_p_row())
    assert _cut(got) == {"prefill-1": "SlowPrefillSide"}
    p = got["prefill-1"]
    assert "P×D handoff matrix: its row is ×10.00 the typical pair's 0.050s" in p.message
    assert p.scores["handoff"] < 0.2  # 1.5 / 10


def test_per_instance_the_same_window_cut_two_healthy_ds() -> None:
    """The failure the matrix mends: without the pairs, the Ds' own medians are compared."""
    insts = tuple(replace(i, handoff_p50_s=MIXED_D_MEDIANS.get(i.name, FAST)) for i in fleet())
    obs = Observation(now=T0, window_s=30.0, instances=insts, newest_data=T0)
    got = {d.instance: d for d in decide_weights(obs, {}, CFG)}
    assert {"decode-0", "decode-1"} <= set(_cut(got))


def test_a_d_slow_toward_every_p_is_cut_as_a_d_and_no_p_is_cut() -> None:
    pairs = {(f"prefill-{p}", "decode-3"): SLOW for p in range(2)}
    # each P's own median is fast: a quarter of its handoffs went to decode-3
    got = _tick({"decode-3": SLOW}, pairs)
    assert _cut(got) == {"decode-3": "SlowHandoff"}
    assert "P×D handoff matrix: its column is ×10.00" in got["decode-3"].message


def test_one_slow_pair_is_the_pairs_and_cuts_neither_end() -> None:
    """A slow pair is blamed as a pair: its P and D each serve their other links well, and the proxies
    route around the pair by its handoff in the routing table's rates. Before, its D was judged on its
    own median, which the pair's handoffs had set, and cut (`SlowHandoff`; on the bench, on its NIXL
    mean, `SlowKVTransfer`)."""
    got = _tick({"decode-2": SLOW}, {("prefill-0", "decode-2"): SLOW})
    assert _cut(got) == {}
    basis = got["decode-2"].inputs["handoff_basis"]
    assert basis.startswith("P×D handoff matrix: blames its pair prefill-0->decode-2, not it")
    assert got["prefill-0"].inputs["handoff_basis"].startswith("P×D handoff matrix: blames its pair")
    assert got["decode-1"].inputs["handoff_basis"].startswith("P×D handoff matrix: its column")


def test_the_pairs_d_is_not_cut_on_transfer_means_its_pair_sets() -> None:
    insts = tuple(
        replace(
            i,
            handoff_p50_s=SLOW if i.name == "decode-2" else FAST,
            nixl_xfer_mean_s=0.4 if i.name == "decode-2" else 0.02,
            nixl_transfers=50.0,
        )
        for i in fleet()
    )
    cells = tuple(
        PairSignals(f"prefill-{p}", f"decode-{d}", 20, SLOW if (p, d) == (0, 2) else FAST, 0.1)
        for p in range(2)
        for d in range(4)
    )
    obs = Observation(now=T0, window_s=30.0, instances=insts, pairs=cells, newest_data=T0)
    got = {d.instance: d for d in decide_weights(obs, {}, CFG)}
    assert _cut(got) == {}
    assert "mixes the transfers of prefill-0" in got["decode-2"].inputs["nixl_mixed"]


def test_a_p_that_the_matrix_cannot_judge_is_judged_per_instance_and_says_so() -> None:
    """One P: its row is the typical pair, so its side cannot be told from the matrix."""
    got = _tick({}, {}, n_p=1, n_d=4)
    assert _cut(got) == {}
    basis = got["prefill-0"].inputs["handoff_basis"]
    assert "per-instance: the P×D handoff matrix cannot judge it (one P" in basis
    assert got["decode-0"].inputs["handoff_basis"].startswith("P×D handoff matrix: its column")
    slow = _tick({"prefill-0": SLOW}, {("prefill-0", f"decode-{d}"): SLOW for d in range(4)}, n_p=1)
    # one P slow toward every D: nothing to compare it with, in the matrix or among its peers
    assert "prefill-0" not in _cut(slow)
    assert not any(n.startswith("decode") for n in _cut(slow))


def test_healthy_noise_in_the_matrix_cuts_nobody() -> None:
    pairs = {
        (f"prefill-{p}", f"decode-{d}"): FAST * (1.0 + 0.3 * ((p + 2 * d) % 3 - 1))
        for p in range(2)
        for d in range(4)
    }
    assert _cut(_tick({}, pairs)) == {}


def _failing(
    pair_failures: dict[tuple[str, str], int], d_rate: dict[str, float]
) -> dict[str, WeightDecision]:
    """One tick where each D's own NIXL counter shows ``d_rate`` failures a minute (a failed pull is
    counted by the D that pulled it) and the records' failed handoffs per pair are ``pair_failures``."""
    insts = tuple(replace(i, failed_transfers_per_min=d_rate.get(i.name, 0.0)) for i in fleet())
    cells = tuple(
        PairSignals(p, d, 20, FAST, 0.1, pair_failures.get((p, d), 0))
        for p in ("prefill-0", "prefill-1")
        for d in ("decode-0", "decode-1", "decode-2", "decode-3")
    )
    obs = Observation(now=T0, window_s=30.0, instances=insts, pairs=cells, newest_data=T0)
    return {d.instance: d for d in decide_weights(obs, {}, CFG)}


ROW_FAILS = {("prefill-1", f"decode-{d}"): 3 for d in range(4)}  # prefill-1's reads fail toward every D
EVERY_D_COUNTS = {f"decode-{d}": 6.0 for d in range(4)}  # 3 in 30 s, as each D's counter shows them


def test_a_p_whose_transfers_fail_toward_every_d_is_charged_them_and_no_d_is_cut() -> None:
    got = _failing(ROW_FAILS, EVERY_D_COUNTS)
    assert _cut(got) == {"prefill-1": "TransferFailures"}
    assert got["prefill-1"].inputs["failures_basis"].startswith("charged its row: prefill-1's handoffs fail")
    assert (
        got["decode-0"]
        .inputs["failures_basis"]
        .startswith("3 of its 3 failed or expired handoffs are the row of prefill-1")
    )


def test_per_d_counters_every_d_shares_cut_no_d_before_the_records_place_them() -> None:
    """The first ticks of a failing P: every D's counter rises, and the records that name the P are not
    in yet. Before, each D was cut for them (TransferFailures); what every D shows is the pool's."""
    got = _failing({}, EVERY_D_COUNTS)
    assert _cut(got) == {}
    assert "the peers' median 3 is the pool's, not its own" in got["decode-0"].inputs["errors_basis"]


def test_per_d_counter_one_d_alone_shows_is_still_its_own() -> None:
    got = _failing({}, {"decode-2": 6.0})
    assert _cut(got) == {"decode-2": "TransferFailures"}
    # past what its peers share, by more than their count's noise
    got = _failing({}, {**EVERY_D_COUNTS, "decode-2": 40.0})
    assert _cut(got) == {"decode-2": "TransferFailures"}
    # within it: 5 against the peers' 3 is not a fault of its own
    assert _cut(_failing({}, {**EVERY_D_COUNTS, "decode-2": 10.0})) == {}


def test_a_d_failing_from_every_p_is_still_the_ds() -> None:
    got = _failing({("prefill-0", "decode-3"): 4, ("prefill-1", "decode-3"): 4}, {"decode-3": 16.0})
    assert _cut(got) == {"decode-3": "TransferFailures"}
    assert "failures_basis" not in got["decode-3"].inputs


def test_a_d_the_matrix_cannot_judge_beside_a_blamed_p_row_is_not_cut_on_its_mixed_median() -> None:
    """Seen on the bench: the P cut for its row sends a trickle, some of its cells thin out, and a D
    left with one usable cell could not be judged; per instance its own median (mostly that P's slow
    handoffs) cut it. While the matrix blames a P's row, such a D is not scored on the handoff."""
    insts = tuple(
        replace(i, handoff_p50_s=SLOW if i.name in ("prefill-1", "decode-2") else FAST) for i in fleet()
    )
    cells = [
        PairSignals(f"prefill-{p}", f"decode-{d}", 20, SLOW if p == 1 else FAST, 0.1)
        for p in range(2)
        for d in range(4)
        if (p, d) != (0, 2)
    ]
    cells.append(PairSignals("prefill-0", "decode-2", 2, FAST, 0.1))  # under noise.min_samples
    obs = Observation(now=T0, window_s=30.0, instances=insts, pairs=tuple(cells), newest_data=T0)
    got = {d.instance: d for d in decide_weights(obs, {}, CFG)}
    assert _cut(got) == {"prefill-1": "SlowPrefillSide"}
    assert "cannot judge it, and blames prefill-1" in got["decode-2"].inputs["handoff_basis"]


def _nixl_tick(prev: dict[str, WeightState]) -> dict[str, WeightDecision]:
    """decode-0's NIXL time per transfer 5x its peers' (it pulled more from prefill-1 than they did);
    no pair has samples (the proxies avoid prefill-1), so the matrix judges nobody."""
    slow = {"nixl_xfer_mean_s": 0.05, "nixl_recent_s": 0.05}
    insts = tuple(replace(i, **slow) if i.name == "decode-0" else i for i in fleet())  # type: ignore[arg-type]
    obs = Observation(now=T0, window_s=30.0, instances=insts, newest_data=T0)
    return {d.instance: d for d in decide_weights(obs, prev, CFG)}


def _cut_p1(reason: Reason) -> dict[str, WeightState]:
    return {"prefill-1": WeightState(weight=0.25, smoothed=0.25, reason=Reason.STEADY, cut_for=reason)}


def test_a_ds_transfer_means_beside_a_p_cut_for_its_side_are_not_the_ds_evidence() -> None:
    """vLLM's NIXL histograms carry no P label: a D's mean mixes the pulls of a P whose NIC is slow, as
    much as it happened to pull from it. While that P is cut for its handoff side, the D is not cut on
    them; cut for its compute (SlowPrefill), the P says nothing of the links, and the D is."""
    alone = _nixl_tick({})
    assert alone["decode-0"].reason == Reason.SLOW_KV_TRANSFER  # the baseline: cut on its mean
    for side in (Reason.SLOW_HANDOFF, Reason.SLOW_PREFILL_SIDE, Reason.TRANSFER_FAILURES):
        got = _nixl_tick(_cut_p1(side))
        d = got["decode-0"]
        assert d.reason != Reason.SLOW_KV_TRANSFER and d.target == 1.0, side
        assert "mixes the transfers of prefill-1" in d.inputs["nixl_mixed"]
    compute = _nixl_tick(_cut_p1(Reason.SLOW_PREFILL))
    assert compute["decode-0"].reason == Reason.SLOW_KV_TRANSFER


def test_the_reason_a_weight_was_cut_for_is_kept_until_it_is_back_at_one() -> None:
    got = _tick(MIXED_D_MEDIANS, _slow_p_row())
    state = got["prefill-1"].state
    assert state.weight < 1.0 and state.cut_for == Reason.SLOW_PREFILL_SIDE
    assert got["prefill-0"].state.cut_for is None


def _recent_tick(recent: dict[tuple[str, str], tuple[int, float]]) -> dict[str, WeightDecision]:
    """One tick whose window medians are all fast, and whose pairs' handoffs of the last seconds are
    ``recent`` ((count, median) per pair; else as many as the window's last sixth, fast)."""
    insts = tuple(replace(i, handoff_p50_s=FAST) for i in fleet())
    cells = tuple(
        PairSignals(p, d, 20, FAST, 0.1, 0, *recent.get((p, d), (4, FAST)))
        for p in ("prefill-0", "prefill-1")
        for d in ("decode-0", "decode-1", "decode-2", "decode-3")
    )
    obs = Observation(now=T0, window_s=30.0, instances=insts, pairs=cells, newest_data=T0)
    return {d.instance: d for d in decide_weights(obs, {}, CFG)}


def test_a_p_row_that_just_slowed_is_cut_before_its_window_median_turns() -> None:
    """Seen on the bench: a P's NIC slowed tenfold, the proxies left it by prediction, and its cells'
    window medians stayed fast for 9-10 s. Its handoffs of the last seconds are all slow."""
    got = _recent_tick({("prefill-1", f"decode-{d}"): (6, SLOW) for d in range(4)})
    assert _cut(got) == {"prefill-1": "SlowPrefillSide"}
    assert "its row is ×10.00" in got["prefill-1"].message


def test_a_row_whose_few_recent_handoffs_all_slowed_is_read_over_them() -> None:
    """The same tick as the bench saw it: the proxies sent the slow P one or two handoffs per D, each
    ten times the typical pair; six of them over its row say together what no cell can alone."""
    counts = (1, 2, 2, 1)
    got = _recent_tick({("prefill-1", f"decode-{d}"): (n, SLOW) for d, n in enumerate(counts)})
    assert _cut(got) == {"prefill-1": "SlowPrefillSide"}


def test_a_row_far_past_its_window_is_read_over_half_as_many_recent_handoffs() -> None:
    """4P+2D on the bench: the proxies left a P whose NIC slowed tenfold after a handoff or two per D,
    and its row never held five recent ones together. Far past its window (three times and more), one
    per D over four Ds is enough; as many merely past the tolerance are not."""
    got = _recent_tick({("prefill-1", f"decode-{d}"): (1, SLOW) for d in range(4)})
    assert _cut(got) == {"prefill-1": "SlowPrefillSide"}
    near = _recent_tick({("prefill-1", f"decode-{d}"): (1, FAST * 2.5) for d in range(4)})
    assert _cut(near) == {}


def test_recent_handoffs_too_few_or_within_the_tolerance_blame_nobody() -> None:
    # two slow handoffs over the row, or four in one cell alone: not enough to read the row by
    assert (
        _cut(_recent_tick({("prefill-1", "decode-0"): (1, SLOW), ("prefill-1", "decode-1"): (1, SLOW)})) == {}
    )
    assert _cut(_recent_tick({("prefill-1", "decode-0"): (4, SLOW)})) == {}
    # half the row slowed, half not: no line says so together
    half = {("prefill-1", "decode-0"): (3, SLOW), ("prefill-1", "decode-1"): (3, SLOW)}
    assert _cut(_recent_tick(half)) == {}
    within = {(f"prefill-{p}", f"decode-{d}"): (8, FAST * 1.4) for p in range(2) for d in range(4)}
    assert _cut(_recent_tick(within)) == {}
    # every cell slower of late alike: the typical pair moved with them, no line stands out
    alike = {(f"prefill-{p}", f"decode-{d}"): (8, SLOW) for p in range(2) for d in range(4)}
    assert _cut(_recent_tick(alike)) == {}


def test_failed_requests_every_d_shares_cut_no_d() -> None:
    """The same first ticks, read through the Ds' own failed requests: each D failed a third of its
    requests, those from the failing P. What every D shows alike is the pool's."""
    insts = tuple(replace(i, requests=30, failed_requests=10 if i.role == "decode" else 0) for i in fleet())
    obs = Observation(now=T0, window_s=30.0, instances=insts, newest_data=T0)
    got = {d.instance: d for d in decide_weights(obs, {}, CFG)}
    assert _cut(got) == {}
    assert "the peers' median share 33% is the pool's" in got["decode-1"].inputs["failures_basis"]
    # one D failing a third of its requests while its peers fail none is still cut for it
    alone = tuple(replace(i, requests=30, failed_requests=10 if i.name == "decode-1" else 0) for i in fleet())
    obs = Observation(now=T0, window_s=30.0, instances=alone, newest_data=T0)
    assert _cut({d.instance: d for d in decide_weights(obs, {}, CFG)}) == {"decode-1": "RequestFailures"}


def _slow_column(
    n_p: int, n_d: int, slow: str, load_done: dict[str, float], prev: dict[str, WeightState]
) -> dict[str, WeightDecision]:
    """One tick where D ``slow``'s handoffs (its own median and its column's cells) are slow, each D
    finished ``load_done`` (else 10) over the last three scrapes, and ``prev`` holds the weights."""
    insts = tuple(
        replace(i, handoff_p50_s=SLOW if i.name == slow else FAST, load_done=load_done.get(i.name, 10.0))
        for i in fleet(n_p, n_d)
    )
    cells = tuple(
        PairSignals(f"prefill-{p}", f"decode-{d}", 20, SLOW if f"decode-{d}" == slow else FAST, 0.1)
        for p in range(n_p)
        for d in range(n_d)
    )
    obs = Observation(now=T0, window_s=30.0, instances=insts, pairs=cells, newest_data=T0)
    return {d.instance: d for d in decide_weights(obs, prev, CFG)}


def test_a_d_that_took_a_cut_ds_load_is_not_cut_on_its_column() -> None:
    """Seen on the bench, 4P+2D: one D stuck and cut, the other took all the load, and its handoffs,
    which hold its queue for a batch slot, rose 3.5-fold; judged on its column it was cut. A D's
    handoff rises with the load it took: while its pool sheds load and it finishes more than 1.5x
    its peers' work, it is left to admission like its other load signals."""
    done = {"decode-0": 40.0, "decode-1": 2.0}
    prev = {"decode-1": WeightState(weight=0.15, smoothed=0.15, reason=Reason.BACKLOG)}
    got = _slow_column(4, 2, "decode-0", done, prev)
    assert got["decode-0"].weight == 1.0, got["decode-0"].message
    assert "left to admission" in got["decode-0"].inputs["handoff_load_shift"]
    # with no load shed, the same column is cut
    alone = _slow_column(4, 2, "decode-0", done, {})
    assert alone["decode-0"].weight < 1.0 and alone["decode-0"].reason == Reason.SLOW_HANDOFF


def test_a_d_that_just_slowed_blames_no_p_row() -> None:
    """Seen on the bench, 4P+2D: one D's link slowed and the other D took its load, so every P's two
    cells slowed of late; read row by row, two healthy Ps were cut on `SlowPrefillSide`. A row is read
    over its recent handoffs only when the other Ps' cells toward the same Ds did not slow alike."""
    insts = tuple(replace(i, handoff_p50_s=FAST) for i in fleet(4, 2))
    cells = tuple(
        PairSignals(f"prefill-{p}", f"decode-{d}", 20, FAST, 0.1, 0, 2 + p % 2, recent)
        for p in range(4)
        for d in range(2)
        # a few handoffs each, noisy: prefill-2's happened to be the slowest
        for recent in [(SLOW if d == 1 else 2.2 * FAST) * (4.0 if p == 2 else 1.0)]
    )
    obs = Observation(now=T0, window_s=30.0, instances=insts, pairs=cells, newest_data=T0)
    got = {d.instance: d for d in decide_weights(obs, {}, CFG)}
    assert not any(n.startswith("prefill") for n in _cut(got)), _cut(got)


def test_a_d_that_hands_off_slowly_while_another_is_cut_is_still_cut() -> None:
    """The other side of the rule above: a D that finishes what its peers do while its handoffs are
    slow is slow, not loaded, whoever else is cut (a second D fault)."""
    prev = {"decode-2": WeightState(weight=0.15, smoothed=0.15, reason=Reason.SLOW_HANDOFF)}
    got = _slow_column(2, 4, "decode-1", {}, prev)
    assert got["decode-1"].weight < 1.0 and got["decode-1"].reason == Reason.SLOW_HANDOFF


def _probed_p1(cut_for: Reason, p1_handoffs: int) -> WeightDecision:
    """prefill-1 at the probe weight, healthy for ticks and lowered long ago, its prefill requests
    plenty and fast; ``p1_handoffs`` of its handoffs (fast) reached a first token in the window."""
    insts = tuple(replace(i, requests=10) if i.name == "prefill-1" else i for i in fleet())
    counts = {"prefill-0": 20, "prefill-1": p1_handoffs // 4}
    cells = tuple(
        PairSignals(p, f"decode-{d}", counts[p], FAST, 0.1)
        for p in ("prefill-0", "prefill-1")
        for d in range(4)
        if counts[p]
    )
    obs = Observation(now=T0, window_s=30.0, instances=insts, pairs=cells, newest_data=T0)
    prev = {
        "prefill-1": WeightState(
            weight=0.1,
            smoothed=0.1,
            reason=Reason.PROBING,
            healthy_streak=CFG.recover_ticks,
            lowered_at=T0 - 10 * CFG.probe_after_s,
            probe_at=T0 - 3.0,
            ceiling=1.0,
            cut_for=cut_for,
        )
    }
    return next(d for d in decide_weights(obs, prev, CFG) if d.instance == "prefill-1")


def test_a_p_cut_on_its_handoff_side_is_raised_on_its_handoffs_not_its_prefill_requests() -> None:
    """Seen on the bench: a P whose NIC slowed tenfold was probed, then raised 0.10 -> 0.25 one tick
    later on three prefill requests whose handoffs were still on the slow link; the proxies' next
    requests through it were all late. Its prefill side never was the trouble."""
    waits = _probed_p1(Reason.SLOW_HANDOFF, 0)
    assert (waits.reason, waits.weight) == (Reason.AWAITING_EVIDENCE, 0.1)
    assert "0 handoffs (cut on its handoff side)" in waits.arithmetic
    shown = _probed_p1(Reason.SLOW_HANDOFF, 8)  # its probe's handoffs came back in time
    assert shown.reason == Reason.RECOVERING and shown.weight > 0.1
    compute = _probed_p1(Reason.SLOW_PREFILL, 0)  # cut for its compute: its prefills are the evidence
    assert compute.reason == Reason.RECOVERING and compute.weight > 0.1
