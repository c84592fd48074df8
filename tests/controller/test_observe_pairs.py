"""The pairs' signals of a tick, made with the last tick's kept (``controller.observe._pairs`` and its memo)
or from nothing: the same signals in the same order, whatever came, went, failed or changed between."""

from __future__ import annotations

import random
from collections import defaultdict

from controller.kept import PairMemo
from controller.observe import _pairs
from controller.policy.evidence import WindowTally
from store.queries import HandoffStats, handoff_group

PS = [f"prefill-{k}" for k in (0, 1, 2, 10, 11)]  # "prefill-10" sorts between "prefill-1" and "prefill-2"
DS = [f"decode-{k}" for k in (0, 3, 9, 12)]


def _tally(rng: random.Random) -> WindowTally:
    t = WindowTally({}, 0.0)
    for _ in range(rng.randrange(3)):
        pair = (rng.choice(PS), rng.choice(DS))
        t.failed_since_restart[pair] += 1
        t.served_since_restart[rng.choice(PS), rng.choice(DS)] += rng.randrange(1, 3)
    return t


def test_pairs_made_with_the_memo_equal_pairs_made_anew() -> None:
    rng, memo = random.Random(3), PairMemo()
    groups: dict[str, HandoffStats] = {}
    for _ in range(60):
        for _ in range(rng.randrange(1, 6)):  # groups that changed, came or went: new objects, or none
            key = f"{rng.choice(PS)}->{rng.choice(DS)}"
            if rng.random() < 0.3:
                groups.pop(key, None)
            else:
                groups[key] = handoff_group(key, [rng.random() for _ in range(rng.randrange(1, 4))], 0)
        failures: defaultdict[tuple[str, str], int] = defaultdict(int)
        for _ in range(rng.randrange(3)):
            failures[rng.choice(PS), rng.choice(DS)] += rng.randrange(0, 2)  # a zero count is not a pair
        recent = {k: hs for k, hs in groups.items() if rng.random() < 0.4}
        tally = _tally(rng)
        kept = _pairs(dict(groups), failures, recent, tally, memo)
        anew = _pairs(dict(groups), failures, recent, tally)
        assert kept == anew
        names = [(s.p_instance, s.d_instance) for s in kept]
        assert names == sorted(names)
