"""A probe is a probe (issue 14): an instance at the floor is raised only by a small, bounded probe share,
cut again on its first failures, and ramped only on evidence -- also when it is back from InstanceDown."""

from __future__ import annotations

import pytest

from controller.policy import PolicyConfig
from tests.controller.replay import Changes, Timeline, replay
from tests.controller.test_policy_weights import combine, slow_d

CFG = PolicyConfig.defaults()
FEW = {"requests": 1, "nixl_transfers": 1.0}  # what reaches an instance at the floor


def down_then(after: Changes, down: range = range(2, 5)) -> Timeline:
    def tl(tick: int) -> Changes:
        if tick in down:
            return {"decode-1": {"up": False, "down_for_s": 60.0}}
        return after if tick >= down.stop else {}

    return tl


def test_back_from_down_with_no_evidence_never_passes_the_probe_weight() -> None:
    """Before: InstanceDown left no lowered_at, so the evidence gate was skipped: 0.02 -> 1.00 in four raises
    with 0-1 requests reaching it. Now: the floor, one probe to at most probe_weight, then it waits."""
    r = replay(down_then({"decode-1": FEW}), 40, cfg=CFG)
    w = r.weights("decode-1")
    assert w[1] == 0.0 and r.reasons("decode-1")[4] == "InstanceUp"
    assert max(w[4:]) <= CFG.probe_weight + 1e-9, w
    assert "Probing" in r.reasons("decode-1") and "AwaitingEvidence" in r.reasons("decode-1")


def test_back_from_down_with_evidence_ramps_after_the_probe() -> None:
    r = replay(down_then({}), 40, cfg=CFG)  # healthy, 40 requests a window once up
    w = r.weights("decode-1")
    assert w[-1] == 1.0, w
    assert w[w.index(CFG.min_weight, 4) + 1] <= CFG.probe_weight + 1e-9 or "Recovering" in r.reasons(
        "decode-1"
    )


def test_a_probe_that_fails_goes_back_to_the_floor_at_once_and_waits_again() -> None:
    # slow and floored for ticks 1-5; from tick 6 it gets a trickle of requests, which fail from the probe on
    probe_after = int(CFG.probe_after_s / CFG.interval_s)
    first_probe: list[int] = []

    def failing(tick: int) -> Changes:
        return {"decode-2": {**FEW, "failed_requests": 1}} if first_probe and tick > first_probe[0] else {}

    tl = combine(slow_d(60.0, 1, 6), lambda tick: {"decode-2": FEW} if tick >= 6 else {}, failing)
    r = replay(tl, 6 + probe_after + 2, cfg=CFG)
    w = r.weights("decode-2")
    first_probe.append(next(i for i, x in enumerate(w) if x > CFG.min_weight + 1e-9 and i > 5) + 1)
    r = replay(tl, first_probe[0] + probe_after + 4, cfg=CFG)
    w, why = r.weights("decode-2"), r.reasons("decode-2")
    k = first_probe[0] - 1  # the probe's tick (0-based)
    assert w[k] == pytest.approx(CFG.probe_weight) and why[k] == "Probing"
    assert w[k + 1] == pytest.approx(CFG.min_weight) and why[k + 1] == "ProbeFailed", (
        w[k : k + 3],
        why[k : k + 3],
    )
    # and it waits probe_after_s again before the next probe
    assert set(w[k + 1 : k + 1 + probe_after]) == {CFG.min_weight}, w[k:]


def test_a_floored_instance_is_never_ramped_without_evidence() -> None:
    tl = combine(slow_d(60.0, 1, 6), lambda tick: {"decode-2": FEW} if tick >= 6 else {})
    r = replay(tl, 120, cfg=CFG)
    assert max(r.weights("decode-2")[5:]) <= CFG.probe_weight + 1e-9


def test_a_probe_with_healthy_evidence_ramps_back() -> None:
    # a handful of healthy requests at the probe weight are its evidence (probe_min_requests)
    tl = combine(
        slow_d(60.0, 1, 6),
        lambda tick: {"decode-2": {"requests": 4, "nixl_transfers": 4.0}} if tick >= 6 else {},
    )
    r = replay(tl, 60, cfg=CFG)
    w = r.weights("decode-2")
    k = r.reasons("decode-2").index("Probing")
    assert w[k] == pytest.approx(CFG.probe_weight)
    assert "Recovering" in r.reasons("decode-2")[k:]
