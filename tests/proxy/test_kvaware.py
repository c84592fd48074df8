"""The KV-aware cost model (proxy.kvaware), as tables of fleets and prompts."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from proxy.kvaware import (
    REASON_AFFINITY,
    REASON_AFFINITY_BOUNDED,
    REASON_DECODE_ONLY_CACHED,
    REASON_DECODE_ONLY_SHORT,
    REASON_LOAD,
    Candidate,
    CostModel,
    choose,
)
from proxy.prefixview import Prompt
from proxy.routing import Target

BLOCK = 16


def prompt(tokens: int) -> Prompt:
    keys = tuple(i.to_bytes(2, "big") * 8 for i in range(tokens // BLOCK))
    return Prompt(keys=keys, tokens=tokens, block_tokens=BLOCK)


def cands(
    role: str, inflight: list[int], weights: list[float] | None = None, backlog: list[int] | None = None
) -> list[Candidate]:
    out = []
    for i, n in enumerate(inflight):
        w = (weights or [1.0] * len(inflight))[i]
        out.append(
            Candidate(
                Target(f"{role}{i}", role, f"http://{role}{i}", w), w, n, (backlog or [0] * len(inflight))[i]
            )
        )
    return out


M = CostModel()


@pytest.mark.parametrize(
    ("p_inflight", "p_backlog", "held_on_p0", "want_p", "reason"),
    [
        # P0 holds 2000 of the 2100-token prompt and is no busier than its peers: affinity wins.
        ([1, 1, 1, 1], [100, 100, 100, 100], 2000, "p0", REASON_AFFINITY),
        # Busier: 2 in flight is over 1.5 x the mean (1.25): its credit goes, the least loaded takes it.
        ([2, 1, 1, 1], [100, 100, 100, 100], 2000, "p1", REASON_AFFINITY_BOUNDED),
        # A hot prefix: its holder far over its peers' mean loses its credit; the idle P takes it.
        ([6, 2, 0, 2], [0, 0, 0, 0], 2000, "p2", REASON_AFFINITY_BOUNDED),
        # On an idle fleet the holder keeps its credit up to the bound (1.5 requests: one in flight).
        ([1, 0, 0, 0], [0, 0, 0, 0], 2000, "p0", REASON_AFFINITY),
        ([2, 0, 0, 0], [0, 0, 0, 0], 2000, "p1", REASON_AFFINITY_BOUNDED),
        # Within the bound but its queue of uncached prefill is longer than the prefix saves: load wins.
        ([3, 2, 2, 2], [40000, 0, 0, 0], 2000, "p1", REASON_LOAD),
        # Nothing shared: the least backlog wins.
        ([1, 1, 1, 1], [300, 200, 100, 400], 0, "p2", REASON_LOAD),
    ],
)
def test_bounded_affinity_table(
    p_inflight: list[int], p_backlog: list[int], held_on_p0: int, want_p: str, reason: str
) -> None:
    got = choose(
        prompt(2100), {"p0": held_on_p0}, cands("p", p_inflight, backlog=p_backlog), cands("d", [0]), M
    )
    assert got is not None and got.p is not None
    assert (got.p.name, got.reason) == (want_p, reason)
    assert got.p_cached == (held_on_p0 if want_p == "p0" else 0)
    assert got.p_uncached == 2100 - got.p_cached


def test_a_higher_bound_keeps_the_hot_prefix_on_its_holder() -> None:
    loose = CostModel(affinity_bound=4.0)
    got = choose(prompt(2100), {"p0": 2000}, cands("p", [6, 2, 0, 2]), cands("d", [0]), loose)
    assert got is not None and got.p is not None and got.p.name == "p0"


@pytest.mark.parametrize(
    ("inflight", "weights"),
    [([3, 1, 2], [1, 1, 1]), ([4, 4, 1, 5], [1, 1, 1, 1]), ([4, 3], [2, 1]), ([0, 2, 5], [1, 3, 1])],
)
def test_no_sharing_chooses_as_load_only(inflight: list[int], weights: list[float]) -> None:
    """No prefix held anywhere: the least in flight per weight (the load-only comparison), with the
    backlog following the requests in flight (each a 1000-token prompt)."""
    p = cands("p", inflight, weights, [1000 * n for n in inflight])
    got = choose(prompt(1000), {}, p, cands("d", [0]), M)
    assert got is not None and got.p is not None
    least = min(p, key=lambda c: c.inflight / c.weight)
    assert got.p.name == least.target.name
    assert got.reason == REASON_LOAD and got.prefix_key is None and got.prefix_tokens == 0


def test_ties_are_drawn_by_weight() -> None:
    rng = random.Random(7)
    p = cands("p", [0, 0], [1.0, 3.0])
    picks = Counter()
    for _ in range(4000):
        got = choose(prompt(500), {}, p, cands("d", [0]), M, rng)
        assert got is not None and got.p is not None
        picks[got.p.name] += 1
    assert 0.70 < picks["p1"] / 4000 < 0.80  # weight 3 of 4
    assert choose(prompt(500), {}, p, cands("d", [0]), M) is not None  # no rng: the first, deterministic


def test_d_holding_the_prefix_wins_when_p_choices_are_equal() -> None:
    got = choose(prompt(3200), {"d1": 3200, "d2": 800}, cands("p", [0, 0]), cands("d", [1, 1, 1]), M)
    assert got is not None and got.p is not None
    assert (got.p.name, got.d.name, got.d_cached) == ("p0", "d1", 3200)
    assert got.prefix_tokens == 3200 and got.prefix_key == (199).to_bytes(2, "big").hex() * 4
    # ... unless it is over the bound: then the load decides
    got = choose(prompt(3200), {"d1": 3200}, cands("p", [0, 0]), cands("d", [1, 9, 1]), M)
    assert got is not None and got.d.name == "d0"


def test_weights_are_capacity() -> None:
    # P0 at weight 2 with 2000 tokens queued beats P1 at weight 1 with 1200: 2000/(4/3) < 1200/(2/3)
    p = cands("p", [2, 1], [2.0, 1.0], [2000, 1200])
    got = choose(prompt(1000), {}, p, cands("d", [0]), M)
    assert got is not None and got.p is not None and got.p.name == "p0"
    same = cands("p", [2, 1], [1.0, 1.0], [2000, 1200])
    got = choose(prompt(1000), {}, same, cands("d", [0]), M)
    assert got is not None and got.p is not None and got.p.name == "p1"


@pytest.mark.parametrize(
    ("cached", "want"),
    [
        ({}, 0),  # unknown to the view
        ({"p0": -5}, 0),
        ({"p0": True}, 0),  # not a count
        ({"p0": "2000"}, 0),
        ({"p0": 10**9}, 2100),  # more than the prompt: the whole prompt
        ({"elsewhere": 2000}, 0),  # an instance that is not a candidate
    ],
)
def test_unknown_and_bogus_counts_are_zero(cached: dict[str, object], want: int) -> None:
    got = choose(prompt(2100), cached, cands("p", [0]), cands("d", [0]), M)  # type: ignore[arg-type]
    assert got is not None and got.p_cached == want


DO = CostModel(decode_only=True, max_uncached_tokens=256, min_d_cached_ratio=0.9)


@pytest.mark.parametrize(
    ("model", "tokens", "d_holds", "reason"),
    [
        (DO, 300, 100, REASON_DECODE_ONLY_SHORT),  # 200 uncached <= 256
        (DO, 200, 0, REASON_DECODE_ONLY_SHORT),  # a short prompt
        (DO, 4000, 3744, REASON_DECODE_ONLY_SHORT),  # exactly 256 uncached
        (DO, 4000, 3700, REASON_DECODE_ONLY_CACHED),  # 300 uncached, but 92.5% held
        (DO, 4000, 3000, None),  # neither: P and D
        (DO, 257, 0, None),
        (CostModel(), 200, 0, None),  # off
    ],
)
def test_decode_only_thresholds(model: CostModel, tokens: int, d_holds: int, reason: str | None) -> None:
    got = choose(prompt(tokens), {"d0": d_holds}, cands("p", [0]), cands("d", [0]), model)
    assert got is not None
    if reason is None:
        assert got.p is not None and got.reason != REASON_DECODE_ONLY_SHORT
    else:
        assert got.p is None and got.reason == reason
        assert (got.d.name, got.d_cached, got.p_cached, got.p_uncached) == ("d0", d_holds, 0, 0)


def test_without_candidates() -> None:
    assert choose(prompt(100), {}, cands("p", [0]), [], DO) is None  # no D: nothing
    assert choose(prompt(1000), {}, [], cands("d", [0]), DO) is None  # no P, and not short
    alone = choose(prompt(100), {}, [], cands("d", [0]), DO)  # no P pool with room: D alone still serves
    assert alone is not None and alone.p is None
