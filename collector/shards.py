"""Which collector scrapes which instance: rendezvous (highest-random-weight) hashing.

Every live collector computes the same assignment from the same two lists (the instance
names of the config and the ids of the live collectors, from the store's membership,
``collector.membership``): an instance belongs to the collector whose ``weight(collector,
instance)`` is highest. So every instance has exactly one owner; when a collector leaves,
only its instances move (each to the collector that was second for it); when one joins, it
takes about 1/N of the instances, each from a single previous owner, and nothing else moves.

The weight is a stable hash (BLAKE2b of both names, length-prefixed so no two pairs of
names make the same input), not Python's ``hash()``: every process, on every host, on every
run must agree. Ties (64-bit weights, so in practice never) go to the lexically smaller id.

Pure: no I/O, no clock, no logging.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


def _part(text: str) -> bytes:
    raw = text.encode("utf-8")
    return len(raw).to_bytes(4, "big") + raw


def weight(member: str, key: str) -> int:
    """The rendezvous weight of ``key`` (an instance name) on ``member`` (a collector id)."""
    digest = hashlib.blake2b(_part(member) + _part(key), digest_size=8, person=b"pdscope-shard")
    return int.from_bytes(digest.digest(), "big")


def owner(key: str, members: Iterable[str]) -> str | None:
    """The member that owns ``key``; None when there are no members."""
    best: tuple[int, str] | None = None
    for m in members:
        w = weight(m, key)
        # the highest weight wins; on a tie, the smaller id (so the order of ``members`` never matters)
        if best is None or w > best[0] or (w == best[0] and m < best[1]):
            best = (w, m)
    return None if best is None else best[1]


def assign(keys: Iterable[str], members: Iterable[str]) -> dict[str, str]:
    """key -> its owner, for every key; empty when there are no members."""
    live = sorted(set(members))
    if not live:
        return {}
    out: dict[str, str] = {}
    for k in keys:
        found = owner(k, live)
        assert found is not None  # live is not empty
        out[k] = found
    return out


def owned_by(me: str, keys: Iterable[str], members: Iterable[str]) -> list[str]:
    """The keys ``me`` owns among ``members`` (``me`` counts as a member even if absent), in
    the order given."""
    live = set(members) | {me}
    return [k for k, who in assign(keys, live).items() if who == me]


@dataclass(frozen=True)
class Change:
    """How one collector's share moved between two assignments."""

    gained: tuple[str, ...]
    lost: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.gained or self.lost)


def change(before: Iterable[str], after: Iterable[str]) -> Change:
    old, new = set(before), set(after)
    return Change(tuple(sorted(new - old)), tuple(sorted(old - new)))


def moved(before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    """Keys whose owner differs between two assignments (a key in only one counts as moved)."""
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
