"""The peer index gives each instance the same scores as rebuilding its peers' list did.

Every instance is scored against the median of the other up instances of its role; the index
sorts each measure once per tick (O(n log n)) where the list rebuilt per instance was O(n²).
"""

from __future__ import annotations

import random
from dataclasses import replace
from statistics import median

import pytest

from controller.policy import PolicyConfig
from controller.policy.scores import PeerIndex, _median_without, score_instance
from tests.controller.replay import healthy

CFG = PolicyConfig.defaults()


@pytest.mark.parametrize("seed", range(40))
def test_median_without_one_value_matches_removing_it(seed: int) -> None:
    rng = random.Random(seed)
    values = sorted(
        rng.choice([0.1, 0.2, 0.2, 0.5, 1.0, 3.0]) * rng.uniform(0.5, 2) for _ in range(rng.randint(1, 9))
    )
    drop = rng.choice(values)
    rest = list(values)
    rest.remove(drop)
    assert _median_without(values, drop) == (median(rest) if rest else None)
    assert _median_without(values, None) == median(values)


def _fleet(rng: random.Random, n: int) -> list:  # type: ignore[type-arg]
    out = []
    for i in range(n):
        role = "prefill" if i % 3 == 0 else "decode"
        inst = healthy(f"{role}-{i}", role)
        f = rng.choice([0.5, 1.0, 1.0, 1.2, 4.0])
        out.append(
            replace(
                inst,
                handoff_p50_s=None if rng.random() < 0.1 else (inst.handoff_p50_s or 0.05) * f,
                nixl_xfer_mean_s=(inst.nixl_xfer_mean_s or 0.01) * rng.uniform(0.5, 3),
                contribution_s=(inst.contribution_s or 0.1) * rng.uniform(0.5, 3),
                hold_time_now_s=rng.choice([None, 0.5, 2.0, 6.0]),
                requests=rng.randint(0, 60),
            )
        )
    return out


@pytest.mark.parametrize("seed", range(12))
def test_scores_with_the_index_equal_scores_against_the_others_list(seed: int) -> None:
    rng = random.Random(seed)
    fleet = _fleet(rng, rng.randint(2, 14))
    for role in ("prefill", "decode"):
        members = [o for o in fleet if o.role == role]
        index = PeerIndex(members, CFG)
        for inst in members:
            others = [o for o in members if o.name != inst.name]
            assert score_instance(inst, index, CFG, 30.0) == score_instance(inst, others, CFG, 30.0)
