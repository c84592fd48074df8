"""The evidence window's handoffs grouped per D, per P and per pair, each group's figures kept until it
changes.

``controller.observe`` took the handoff percentiles of every D, P and P×D pair from the window's charged
handoffs each tick (``store.queries.handoff_stats_of``): at 1,000 instances about 19,000 groups, most of
them pairs with a handoff or two, few of them changed since the tick before. :class:`HandoffGroups` keeps
each charged record's handoff in its three groups by the record's id (``controller.evidencerows`` adds and
takes them back with the record's charges) and each group's ``HandoffStats`` until a handoff joins or
leaves it. A group's figures do not depend on the order of its handoffs (percentiles; the mean summed
exactly), so they equal ``handoff_stats_of`` over the same records. The answer of :meth:`HandoffGroups.stats`
is kept too, in the groups' order, and only the groups that changed since the last are worked out again:
walking every group each tick cost more than the few that changed.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from typing import cast

from controller.policy.charges import HandoffFacts
from store.queries import HandoffKey, HandoffStats, handoff_group, handoff_keys, handoff_took

BYS: tuple[HandoffKey, ...] = ("d_instance", "p_instance", "pair")


class HandoffGroups:
    """Each kept handoff in its groups, and the groups' figures (see the module docstring)."""

    def __init__(self) -> None:
        # (grouping, key) -> record id -> (its handoff time, whether a lease-expiry suspect)
        self._groups: dict[tuple[HandoffKey, str], dict[int, tuple[float, bool]]] = {}
        # the figures per grouping, in the groups' order: None where a group changed since the last stats()
        self._out: dict[HandoffKey, dict[str, HandoffStats | None]] = {by: {} for by in BYS}
        self._changed: set[tuple[HandoffKey, str]] = set()

    def add(self, rid: int, facts: HandoffFacts) -> None:
        took = handoff_took(facts.p_done, facts.first_token)
        if took is None:
            return
        for by, key in handoff_keys(facts.p_instance, facts.d_instance).items():
            self._groups.setdefault((by, key), {})[rid] = (took, bool(facts.lease_expiry_suspect))
            self._out[by][key] = None  # a new group goes last, as in ``_groups``
            self._changed.add((by, key))

    def remove(self, rid: int, facts: HandoffFacts) -> None:
        if handoff_took(facts.p_done, facts.first_token) is None:
            return
        for by, key in handoff_keys(facts.p_instance, facts.d_instance).items():
            group = self._groups.get((by, key))
            if group is not None and group.pop(rid, None) is not None:
                self._out[by][key] = None
                self._changed.add((by, key))
                if not group:
                    del self._groups[by, key]
                    del self._out[by][key]

    def stats(self) -> dict[HandoffKey, dict[str, HandoffStats]]:
        """Every group's figures, per grouping, as ``handoff_stats_of(..., BYS)`` gives them (a copy: the
        caller may keep it)."""
        for by, key in self._changed:
            members = self._groups.get((by, key))
            if members is not None:
                took = [t for t, _ in members.values()]
                self._out[by][key] = handoff_group(key, took, sum(s for _, s in members.values()))
        self._changed.clear()
        return cast(dict[HandoffKey, dict[str, HandoffStats]], {by: dict(g) for by, g in self._out.items()})
