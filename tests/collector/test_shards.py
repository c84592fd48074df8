"""Rendezvous assignment of instances to collectors: pure, stable, minimal movement."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from collector import shards

REPO = Path(__file__).resolve().parents[2]
INSTANCES = [f"{role}-{i}" for role in ("prefill", "decode") for i in range(500)]

names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
member_sets = st.lists(names, min_size=1, max_size=8, unique=True)
key_sets = st.lists(names, min_size=0, max_size=40, unique=True)


@given(keys=key_sets, members=member_sets)
def test_every_key_has_exactly_one_owner_among_the_members(keys: list[str], members: list[str]) -> None:
    owners = shards.assign(keys, members)
    assert set(owners) == set(keys)
    assert set(owners.values()) <= set(members)
    # the owned lists of the members partition the keys
    parts = [shards.owned_by(m, keys, members) for m in members]
    assert sorted(k for part in parts for k in part) == sorted(keys)


@given(keys=key_sets, members=member_sets, data=st.data())
def test_the_order_of_the_members_never_matters(
    keys: list[str], members: list[str], data: st.DataObject
) -> None:
    shuffled = data.draw(st.permutations(members))
    assert shards.assign(keys, members) == shards.assign(keys, shuffled)
    assert shards.assign(keys, members) == shards.assign(keys, members + members[:1])  # duplicates too


@given(keys=key_sets, members=st.lists(names, min_size=2, max_size=8, unique=True), data=st.data())
def test_removing_a_collector_moves_only_its_keys(
    keys: list[str], members: list[str], data: st.DataObject
) -> None:
    gone = data.draw(st.sampled_from(members))
    before = shards.assign(keys, members)
    after = shards.assign(keys, [m for m in members if m != gone])
    assert shards.moved(before, after) == sorted(k for k, who in before.items() if who == gone)
    assert gone not in after.values()


@given(keys=key_sets, members=member_sets, new=names)
def test_adding_a_collector_moves_keys_only_to_it(keys: list[str], members: list[str], new: str) -> None:
    before = shards.assign(keys, members)
    after = shards.assign(keys, [*members, new])
    assert all(after[k] == new for k in shards.moved(before, after))


def test_adding_one_of_n_moves_about_a_1_over_n_share() -> None:
    members = [f"collector-{i}" for i in range(4)]
    before = shards.assign(INSTANCES, members)
    after = shards.assign(INSTANCES, [*members, "collector-4"])
    moved = len(shards.moved(before, after))
    # the expected share is 1/5 of 1000 = 200; the binomial sd is ~13, so this fails only on a bad hash
    assert 140 <= moved <= 260, moved


@settings(max_examples=20)
@given(n=st.integers(min_value=1, max_value=6))
def test_the_shares_are_balanced(n: int) -> None:
    members = [f"pdscope-collector-{i}:4318" for i in range(n)]
    counts = {m: 0 for m in members}
    for who in shards.assign(INSTANCES, members).values():
        counts[who] += 1
    fair = len(INSTANCES) / n
    # within 6 standard deviations of the binomial share
    slack = 6 * (len(INSTANCES) * (1 / n) * (1 - 1 / n)) ** 0.5
    assert all(abs(c - fair) <= slack for c in counts.values()), counts


def test_no_members_no_owner() -> None:
    assert shards.assign(["a", "b"], []) == {}
    assert shards.owner("a", []) is None
    # a collector counts itself even before it reads the membership
    assert shards.owned_by("me", ["a", "b"], []) == ["a", "b"]


def test_names_do_not_run_into_each_other() -> None:
    # length-prefixed: ("ab", "c") and ("a", "bc") hash different inputs
    assert shards.weight("ab", "c") != shards.weight("a", "bc")


def test_the_same_assignment_in_every_process() -> None:
    """Python's hash() is salted per process; the assignment must not be."""
    script = (
        "import json; from collector import shards; "
        "print(json.dumps(shards.assign([f'i{n}' for n in range(50)], ['c1:4318', 'c2:4318', 'c3:4318'])))"
    )
    here = shards.assign([f"i{n}" for n in range(50)], ["c1:4318", "c2:4318", "c3:4318"])
    for seed in ("1", "2", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, check=True
        )
        assert json.loads(out.stdout) == here


def test_the_weight_is_pinned() -> None:
    """A change of hash would reshuffle every fleet at upgrade (mixed versions would disagree)."""
    assert shards.weight("collector-a:4318", "decode-0") == PINNED_WEIGHT


def test_change_names_what_was_gained_and_lost() -> None:
    c = shards.change(["a", "b"], ["b", "c"])
    assert c.gained == ("c",) and c.lost == ("a",) and c
    assert not shards.change(["a"], ["a"])


PINNED_WEIGHT = 5437373961071282976
