"""The structural diff a delta tick record holds: patching the old tree with it gives the new one, in
key order and types, and it is small where the tree changed little."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from controller.treediff import SAME, Differ, PatchError, diff, patch


def _text(x: Any) -> str:
    return json.dumps(x, separators=(",", ":"))


def _check(old: Any, new: Any) -> Any:
    node = diff(old, new)
    assert _text(patch(old, node)) == _text(new)
    return node


def test_equal_trees_need_nothing() -> None:
    tree = {"a": [1, 2.5, {"b": None}], "c": "x"}
    assert diff(tree, json.loads(_text(tree))) is SAME
    assert patch(tree, SAME) is tree


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (1, 1.0),  # an int is not a float
        (True, 1),
        ({"a": 1, "b": 2}, {"b": 3, "a": 1}),  # the key order is kept
        ({"a": 1, "b": 2}, {"a": 1, "c": 0, "b": 2}),  # a key that came in the middle
        ({"a": 1, "b": 2}, {"b": 3}),
        ([1, 2, 3], [3, 2, 1]),
        ([{"name": "a", "v": 1}, {"name": "b", "v": 2}], [{"name": "b", "v": 3}, {"name": "c", "v": 1}]),
        ([[1], [2]], [[1], [2], [3]]),
        ([1, 1, 2], [1, 2, 2, 1]),
        ({"x": [float("inf"), 2.0]}, {"x": [float("-inf"), 2.0]}),
        ({"x": [1, 2]}, {"x": {"0": 1}}),
    ],
)
def test_a_patch_rebuilds_the_new_tree_exactly(old: Any, new: Any) -> None:
    _check(old, new)


def _rows(rng: random.Random, names: list[str]) -> list[dict[str, Any]]:
    return [{"name": n, "load": rng.random(), "n": rng.randrange(5)} for n in names]


def test_random_edits_of_keyed_rows_round_trip_and_stay_small() -> None:
    rng = random.Random(7)
    names = [f"i-{k}" for k in range(300)]
    old = {"rows": _rows(rng, names), "tick": 1}
    for _ in range(40):
        new = json.loads(_text(old))
        new["tick"] += 1
        for row in rng.sample(new["rows"], 10):
            row["load"] = rng.random()
        if rng.random() < 0.5:
            new["rows"].pop(rng.randrange(len(new["rows"])))
        if rng.random() < 0.5:
            new["rows"].insert(rng.randrange(len(new["rows"])), {"name": f"n-{rng.random()}", "n": 1})
        node = _check(old, new)
        assert len(_text(node)) < len(_text(new)) / 5, "ten rows changed of three hundred"
        old = new


def test_rows_kept_as_one_object_diff_as_their_copies_do() -> None:
    """The tick record keeps an unchanged pair's dump as one object from tick to tick: a sequence of trees
    sharing their unchanged rows diffs to the same deltas as the same trees made of copies, rows that
    moved, came and went included."""
    rng = random.Random(11)
    names = [f"p-{k}" for k in range(200)]
    shared, kept = Differ(), Differ()
    old = {"rows": _rows(rng, names)}
    copy_old = json.loads(_text(old))
    for _ in range(30):
        rows = list(old["rows"])  # the same row objects, some replaced by new ones
        for k in rng.sample(range(len(rows)), 15):
            rows[k] = {**rows[k], "load": rng.random()}
        if rng.random() < 0.5:
            rows.pop(rng.randrange(len(rows)))
        if rng.random() < 0.5:
            rows.insert(rng.randrange(len(rows)), {"name": f"n-{rng.random()}", "load": 0.0, "n": 1})
        if rng.random() < 0.3:
            i, j = rng.sample(range(len(rows)), 2)
            rows[i], rows[j] = rows[j], rows[i]
        if rng.random() < 0.3:  # a row equal by ``==`` with its keys in another order, kept on after
            k = rng.randrange(len(rows))
            rows[k] = dict(reversed(list(rows[k].items())))
        new = {"rows": rows}
        copy_new = json.loads(_text(new))
        node = shared.diff(old, new)
        assert node == kept.diff(copy_old, copy_new)
        assert _text(patch(old, node)) == _text(new)
        old, copy_old = new, copy_new


def test_a_row_reordered_in_an_unchanged_list_and_kept_diffs_as_its_copy() -> None:
    """A list equal to the last by ``==`` (one row only reordered) keeps the last list's identities; the
    reordered row, kept as one object into the next tick's changed list, is aligned by its own."""
    a, a1 = {"p": "a", "q": "x", "n": 1}, {"q": "x", "p": "a", "n": 1}
    trees = [  # "t" changes each tick, as a record's clock does: the rows' list is diffed every tick
        {"t": 0, "rows": [a, {"p": "b", "n": 0}]},
        {"t": 1, "rows": [a1, {"p": "b", "n": 0}]},
        {"t": 2, "rows": [a1, {"p": "b", "n": 1}]},
        {"t": 3, "rows": [{"p": "a", "q": "x", "n": 1}, {"p": "b", "n": 2}]},
    ]
    shared, copies = Differ(), Differ()
    copied = [json.loads(_text(t)) for t in trees]
    for i in range(1, len(trees)):
        assert shared.diff(trees[i - 1], trees[i]) == copies.diff(copied[i - 1], copied[i])


def test_a_value_kept_as_one_object_is_unchanged_even_a_nan() -> None:
    """One object in both trees is not compared: a NaN kept so (never equal to itself) is left out, and the
    patch gives the very object back."""
    nan = float("nan")
    old, new = {"a": nan, "b": [nan, 1]}, {"a": nan, "b": [nan, 2]}
    node = diff(old, new)
    assert list(node["o"]) == ["b"]
    back = patch(old, node)
    assert back["a"] is nan and back["b"][0] is nan and back["b"][1] == 2


def test_what_equality_does_not_see_is_not_in_the_diff() -> None:
    """``==`` takes 0.0 for -0.0 and ignores key order: the writer checks its patches
    (test_tick_keyframes.py)."""
    assert diff({"a": {"x": 1, "y": 2}}, {"a": {"y": 2, "x": 1}}) is SAME
    assert diff([0.0], [-0.0]) is SAME


def test_a_delta_on_another_tree_is_refused() -> None:
    node = diff({"a": [1, 2, 3]}, {"a": [1, 2, 4]})
    with pytest.raises(PatchError):
        patch({"a": [1]}, node)
    with pytest.raises(PatchError):
        patch([1, 2, 3], node)
    with pytest.raises(PatchError):
        patch({"b": 1}, diff({"a": {"x": 1}}, {"a": {"x": 2}}))
