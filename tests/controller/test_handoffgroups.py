"""The handoff groups kept between ticks: after any run of handoffs joining and leaving, each group's figures
equal the percentiles taken anew over the handoffs kept, and only the changed groups are worked out again."""

from __future__ import annotations

import random

from controller.handoffgroups import BYS, HandoffGroups
from controller.policy.charges import HandoffFacts
from store.queries import handoff_stats_of


def _facts(rng: random.Random) -> HandoffFacts:
    done = rng.random() * 10
    first = None if rng.random() < 0.1 else done + rng.random()
    return HandoffFacts(f"p{rng.randrange(4)}", f"d{rng.randrange(6)}", done, first, rng.random() < 0.2)


def test_kept_figures_equal_the_figures_taken_anew() -> None:
    rng, groups, live = random.Random(5), HandoffGroups(), dict[int, HandoffFacts]()
    for rid in range(600):
        if live and rng.random() < 0.45:
            gone = rng.choice(list(live))
            groups.remove(gone, live.pop(gone))
        else:
            live[rid] = _facts(rng)
            groups.add(rid, live[rid])
        if rng.random() < 0.2:
            got = groups.stats()
            assert got == handoff_stats_of(list(live.values()), BYS)
            got["pair"].clear()  # the caller's copy
    assert groups.stats() == handoff_stats_of(list(live.values()), BYS)


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
