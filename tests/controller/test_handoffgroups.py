"""The handoff groups kept between ticks: after any run of handoffs joining and leaving, each group's figures
equal the percentiles taken anew over the handoffs kept, and only the changed groups are worked out again."""

from __future__ import annotations

import random

from controller.handoffgroups import BYS, HandoffGroups
from controller.policy.charges import HandoffFacts
from store.queries import handoff_keys, handoff_stats_of, handoff_took


def _facts(rng: random.Random) -> HandoffFacts:
    done = rng.random() * 10
    first = None if rng.random() < 0.1 else done + rng.random()
    return HandoffFacts(f"p{rng.randrange(4)}", f"d{rng.randrange(6)}", done, first, rng.random() < 0.2)


def test_kept_figures_equal_the_figures_taken_anew_in_the_groups_order() -> None:
    """Each group's figures equal those taken anew; the groups come in the order they last came in (a group
    emptied and joined again between two answers goes last, as the groups themselves are kept)."""
    rng, groups, live = random.Random(5), HandoffGroups(), dict[int, HandoffFacts]()
    order: dict[str, dict[str, set[int]]] = {by: {} for by in BYS}  # by -> key -> its handoffs, in order
    for rid in range(600):
        if live and rng.random() < 0.45:
            gone = rng.choice(list(live))
            facts = live.pop(gone)
            groups.remove(gone, facts)
            _leave(order, gone, facts)
        else:
            live[rid] = _facts(rng)
            groups.add(rid, live[rid])
            _join(order, rid, live[rid])
        if rng.random() < 0.2:
            got = groups.stats()
            assert got == handoff_stats_of(list(live.values()), BYS)
            assert {by: list(got[by]) for by in BYS} == {by: list(order[by]) for by in BYS}
            got["pair"].clear()  # the caller's copy
    assert groups.stats() == handoff_stats_of(list(live.values()), BYS)


def _join(order: dict[str, dict[str, set[int]]], rid: int, facts: HandoffFacts) -> None:
    if handoff_took(facts.p_done, facts.first_token) is not None:
        for by, key in handoff_keys(facts.p_instance, facts.d_instance).items():
            order[by].setdefault(key, set()).add(rid)


def _leave(order: dict[str, dict[str, set[int]]], rid: int, facts: HandoffFacts) -> None:
    if handoff_took(facts.p_done, facts.first_token) is not None:
        for by, key in handoff_keys(facts.p_instance, facts.d_instance).items():
            order[by][key].discard(rid)
            if not order[by][key]:
                del order[by][key]


def test_an_unchanged_group_keeps_its_figures_object() -> None:
    groups = HandoffGroups()
    groups.add(1, HandoffFacts("p0", "d0", 1.0, 1.5, False))
    groups.add(2, HandoffFacts("p1", "d0", 1.0, 1.2, False))
    first = groups.stats()
    groups.add(3, HandoffFacts("p1", "d0", 2.0, 2.1, False))
    second = groups.stats()
    assert second["pair"]["p0->d0"] is first["pair"]["p0->d0"]
    assert second["pair"]["p1->d0"] is not first["pair"]["p1->d0"]
    assert second["pair"]["p1->d0"].requests == 2
    assert list(second["pair"]) == ["p0->d0", "p1->d0"]
    groups.remove(1, HandoffFacts("p0", "d0", 1.0, 1.5, False))
    assert list(groups.stats()["pair"]) == ["p1->d0"]
