"""A structural diff of two JSON trees, and the patch that applies it: what a delta tick record holds.

:func:`diff` says how ``new`` differs from ``old`` (both plain JSON values: dicts with str keys, lists,
str, int, float, bool, None); :func:`patch` rebuilds ``new`` from ``old`` and that. Nothing here knows
the policy's types: a delta is small wherever the tree changes little, whatever the fields are.

A delta node is one of:

* ``[value]``: the whole new value (a scalar that changed, a value of another kind, a new element);
* ``{"o": {key: node, ...}, "x": [removed keys], "k": [every key in order]}``: a dict's changed keys
  (``x`` and ``k`` only when keys went, or the order is not the old one's with the new keys last);
* ``{"l": [[gap, cut, [node, ...]], ...]}``: a list's hunks, each after ``gap`` kept elements: the
  ``cut`` old elements there are replaced by the nodes' values, node ``i`` patching the ``i``-th of
  them (a node past ``cut`` is a new element, a ``[value]``).

Lists are aligned by each element's identity (a dict's leading string fields, a scalar itself): an element
that moved or changed is patched in place, one that came is inserted, one that left is cut. The
alignment only decides how small a delta is, never what it rebuilds. A subtree that compares equal is
left out. Python's ``==`` takes ``0.0`` for ``-0.0`` and ignores a dict's key order, so a subtree
that changed only in those is not seen: the writer (:class:`controller.tickchain.ChainWriter`) checks
that the patch rebuilds the new tree exactly and writes the whole record where it does not.
"""

from __future__ import annotations

from typing import Any, Final

SAME: Final = None  # diff's answer when nothing changed


class PatchError(ValueError):
    """A delta does not apply to the tree it is applied to."""


def diff(old: Any, new: Any) -> Any:
    """The node that turns ``old`` into ``new``; :data:`SAME` (None) when they are equal."""
    return Differ().diff(old, new)


class Differ:
    """:func:`diff` for a sequence of trees, each diffed against the one before: the identities of the
    last tree's list elements are kept for the next diff (keyed by the lists' ids: the caller keeps that
    tree alive, and unchanged, until it is diffed against)."""

    def __init__(self) -> None:
        self._ids: dict[int, list[Any]] = {}  # the last new tree's lists: their elements' identities
        self._next: dict[int, list[Any]] = {}
        # the dicts of the last diff's changed new lists, by id: each one and the identity worked out from it
        self._dicts: dict[int, tuple[Any, Any]] = {}
        self._next_dicts: dict[int, tuple[Any, Any]] = {}

    def diff(self, old: Any, new: Any) -> Any:
        self._next, self._next_dicts = {}, {}
        try:
            return self._node(old, new)
        finally:
            self._ids, self._dicts = self._next, self._next_dicts

    def _node(self, old: Any, new: Any) -> Any:
        if old is new or (type(old) is type(new) and old == new):  # one object: a dump kept between ticks
            self._remember(old, new)
            return SAME
        if isinstance(old, dict) and isinstance(new, dict):
            return self._dict(old, new)
        if isinstance(old, list) and isinstance(new, list):
            return {"l": self._hunks(old, new)}
        return [new]

    def _remember(self, old: Any, new: Any) -> None:
        """An unchanged list keeps its identities for the next diff (an unchanged subtree is not walked:
        the lists inside it are not remembered, only worked out again when they change)."""
        if type(new) is list:
            self._next[id(new)] = self._identities(old)

    def _identities(self, items: list[Any]) -> list[Any]:
        """The identities of an old list's elements (worked out by the diff before, when it could)."""
        known = self._ids.get(id(items))
        return known if known is not None and len(known) == len(items) else [_identity(x) for x in items]

    def _dict(self, old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        changed = {}
        for k, v in new.items():
            if k not in old:
                changed[k] = [v]
                continue
            o = old[k]
            if o is v or (type(o) is type(v) and o == v):  # _node's first test, inline: most are unchanged
                self._remember(o, v)
            else:
                changed[k] = self._node(o, v)
        out: dict[str, Any] = {"o": changed}
        if len(old) == len(new) and old.keys() == new.keys():  # the same keys (most dicts): the same order?
            if list(new) != list(old):
                out["k"] = list(new)
            return out
        gone = [k for k in old if k not in new]
        if gone:
            out["x"] = gone
        if list(new) != _order(old, gone, new):
            out["k"] = list(new)
        return out

    def _hunks(self, old: list[Any], new: list[Any]) -> list[list[Any]]:
        out = _Hunks()
        old_ids, new_ids = self._identities(old), self._new_identities(new)
        self._next[id(new)] = new_ids
        if old_ids == new_ids:  # the same elements in the same places: patched in place
            for i, (a, b) in enumerate(zip(old, new, strict=True)):
                self._patched(out, i, a, b)
            return out.hunks
        where = _positions(old_ids)
        pos = 0  # the next old element not yet kept, patched or cut
        for b, key in zip(new, new_ids, strict=True):
            j = _take(where, key, pos)
            if j is None:
                out.add(pos, 0, [[b]])
                continue
            if j > pos:
                out.add(pos, j - pos, [])
            self._patched(out, j, old[j], b)
            pos = j + 1
        if pos < len(old):
            out.add(pos, len(old) - pos, [])
        return out.hunks

    def _new_identities(self, items: list[Any]) -> list[Any]:
        """The identities of a changed new list's elements: a dict that is the very object the last diff
        worked one out from (a dump kept between ticks, never changed in place) takes it again, the others
        are worked out."""
        out = []
        for x in items:
            if type(x) is dict:
                seen = self._dicts.get(id(x))
                key = seen[1] if seen is not None and seen[0] is x else _identity(x)
                self._next_dicts[id(x)] = (x, key)
            else:
                key = _identity(x)
            out.append(key)
        return out

    def _patched(self, out: _Hunks, at: int, old: Any, new: Any) -> None:
        node = self._node(old, new)
        if node is not SAME:
            out.add(at, 1, [node])


def _order(old: dict[str, Any], gone: list[str], new: dict[str, Any]) -> list[str]:
    """The key order :func:`patch` gives without ``k``: the old keys kept, then the new ones."""
    left = set(gone)
    return [k for k in old if k not in left] + [k for k in new if k not in old]


def _identity(value: Any) -> Any:
    """What aligns an element with its old self: a dict's leading string fields (a name, a pair of
    names), a list is a list, a scalar itself (hashable, all of them)."""
    if isinstance(value, dict):
        key = []
        for v in value.values():
            if not isinstance(v, str):
                break
            key.append(v)
        return tuple(key)
    if isinstance(value, list):
        return "[]"
    return (type(value).__name__, value)


class _Hunks:
    """Builds a list's hunks in order of the old list's index."""

    def __init__(self) -> None:
        self.hunks: list[list[Any]] = []
        self.end = 0  # the old index after the last hunk

    def add(self, at: int, cut: int, nodes: list[Any]) -> None:
        last = self.hunks[-1] if self.hunks else None
        if last is not None and at == self.end and len(last[2]) == last[1]:
            last[1] += cut
            last[2].extend(nodes)
        else:
            self.hunks.append([at - self.end, cut, nodes])
        self.end = at + cut


def _positions(ids: list[Any]) -> dict[Any, list[int]]:
    """Each identity's old indexes, the smallest last (popped first)."""
    where: dict[Any, list[int]] = {}
    for i in range(len(ids) - 1, -1, -1):
        where.setdefault(ids[i], []).append(i)
    return where


def _take(where: dict[Any, list[int]], key: Any, pos: int) -> int | None:
    """The first old index at or after ``pos`` of an element of identity ``key``, taken."""
    found = where.get(key)
    while found:
        j = found.pop()
        if j >= pos:
            return j
    return None


def patch(old: Any, node: Any) -> Any:
    """``old`` with ``node`` (a :func:`diff` answer) applied; raises :class:`PatchError`."""
    if node is SAME:
        return old
    if isinstance(node, list) and len(node) == 1:
        return node[0]
    if isinstance(node, dict) and "o" in node and isinstance(old, dict):
        return _dict_patch(old, node)
    if isinstance(node, dict) and "l" in node and isinstance(old, list):
        return _list_patch(old, node["l"])
    raise PatchError(f"a {type(node).__name__} delta does not apply to a {type(old).__name__}")


def _dict_patch(old: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    gone = set(node.get("x", ()))
    out = {k: v for k, v in old.items() if k not in gone}
    for k, sub in node["o"].items():
        out[k] = patch(out[k], sub) if k in out else _whole(sub)
    if "k" in node:
        if set(node["k"]) != set(out):
            raise PatchError("a dict delta's key order names other keys than it leaves")
        out = {k: out[k] for k in node["k"]}
    return out


def _whole(node: Any) -> Any:
    if isinstance(node, list) and len(node) == 1:
        return node[0]
    raise PatchError("a delta patches an element or key the tree does not have")


def _list_patch(old: list[Any], hunks: list[Any]) -> list[Any]:
    out: list[Any] = []
    at = 0
    for gap, cut, nodes in hunks:
        if gap < 0 or cut < 0 or at + gap + cut > len(old):
            raise PatchError(f"a list delta reaches past the list's {len(old)} elements")
        out.extend(old[at : at + gap])
        at += gap
        for i, sub in enumerate(nodes):
            out.append(patch(old[at + i], sub) if i < cut else _whole(sub))
        at += cut
    out.extend(old[at:])
    return out
