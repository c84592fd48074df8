"""The evidence window's records kept between ticks, with their charges (``controller.policy.kepttally``).

``controller.observe`` charges the believed records of ``[now - controller.window_s, now]`` every tick.
:class:`EvidenceRows` keeps them instead: a tick hands it the records stamped since the last read
(``store.changes``); it replaces each changed record's row (and its charges), drops one it no longer
believes, charges the rows that came due (a record stamped ahead of the clock waits, as a whole read
leaves it out until then) and takes back those that left the window. The tally it lays out
(:meth:`EvidenceRows.tally`) is the one a whole read of the same records builds, and the rates' facts
(:meth:`EvidenceRows.rate_facts`) are those records' in the whole read's order, (arrival, id).

A record deleted inside the window stays charged until it leaves it or the next whole read, as in
``controller.slowindow``.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sortedcontainers import SortedList

from analysis.rates import RateFacts
from controller.handoffgroups import HandoffGroups
from controller.policy.charges import Charge, RecordFacts, charge_of
from controller.policy.evidence import WindowTally
from controller.policy.kepttally import KeptTally
from controller.policy.signals import Role
from store.queries import is_client_error

# a row as read: id, sender, the charging rules' columns (RecordFacts), then the rates' fit's besides
_ID, _SENDER, _FACTS = 0, 1, 2
_END = _FACTS + len(RecordFacts._fields)
_PROXY_IN = _FACTS + RecordFacts._fields.index("proxy_in")


def charged(row: Sequence[Any]) -> tuple[RecordFacts, bool]:
    """A kept row's facts, and whether it was refused as invalid (charged to nobody)."""
    return facts_of(row[_FACTS:_END])


def facts_of(values: Sequence[Any]) -> tuple[RecordFacts, bool]:
    """The charging rules' columns as read (``RecordFacts``' fields, in order) as facts, and whether the
    record was refused as invalid (charged to nobody): a kept row's and a whole read's alike."""
    r = RecordFacts._make(values)
    status = r.status if isinstance(r.status, str) else None
    return r, is_client_error(status, r.http_status if isinstance(r.http_status, int) else None)


def served_facts(r: RecordFacts, extra: Sequence[Any]) -> RateFacts | None:
    """A served record's facts for the rates' fit (``extra``: the fit's columns read besides the charging
    rules'); None for a record not served."""
    if r.status != "ok":
        return None
    return RateFacts(r.p_instance, r.d_instance, r.status, r.p_sent, r.p_done, r.first_token, *extra)


class EvidenceRows:
    """The believed records of an evidence window, by id, and the charges of those inside it."""

    def __init__(self, senders: frozenset[str] | None) -> None:
        self.senders = senders
        self._rows: dict[int, Sequence[Any]] = {}
        self._order: SortedList[tuple[float, int]] = SortedList()  # (proxy_in, id), oldest first
        self.kept = KeptTally()  # the charges of the rows of [lo, hi]
        self.handoffs = HandoffGroups()  # their handoffs, per D, P and pair
        self.lo = -float("inf")  # rows that arrived before it are retired: a window from there is not held
        self.hi = -float("inf")  # rows that arrived after it wait, not charged

    def __len__(self) -> int:
        return len(self._rows)

    def matches(self, senders: frozenset[str] | None, lo: float, hi: float) -> bool:
        """Whether it holds the window of these senders over ``[lo, hi]``: not reaching before what it
        retired (a longer span), nor ending before what it charged (a clock that went back). A shorter span
        is served from what it holds."""
        return self.senders == senders and lo >= self.lo and hi >= self.hi

    def update(self, rows: Iterable[Sequence[Any]]) -> None:
        """Each row replaces the record's last (and its charges); one the controller does not believe, or
        without an arrival time, or one that arrived before the window, is dropped."""
        for row in rows:
            rid, at = int(row[_ID]), row[_PROXY_IN]
            self._drop(rid)
            trusted = self.senders is None or row[_SENDER] in self.senders
            if trusted and isinstance(at, float | int) and at >= self.lo:
                self._rows[rid] = row
                self._order.add((float(at), rid))
                if self.lo <= at <= self.hi:
                    self._charge(rid, charge_of(*charged(row)))

    def slide(self, lo: float, hi: float) -> None:
        """Retire the rows that arrived before ``lo``; charge those of ``(hi before, hi]``."""
        while self._order and self._order[0][0] < lo:
            self._drop(self._order[0][1])
        due = (
            self._order.irange((lo, -1), (hi, float("inf")))  # nothing of what it charged is left
            if lo > self.hi
            else self._order.irange((self.hi, float("inf")), (hi, float("inf")), (False, True))
        )
        for _, rid in due:
            self._charge(rid, charge_of(*charged(self._rows[rid])))
        self.lo, self.hi = max(self.lo, lo), hi

    def tally(self, pools: Mapping[str, Role], restarted: Mapping[str, float] | None) -> WindowTally:
        """The window's tally at ``hi`` (``KeptTally.tally``): a fresh one, for the tick to charge on."""
        return self.kept.tally(pools, self.hi, restarted)

    def rate_facts(self) -> list[RateFacts]:
        """The served records' facts the rates' fit reads, in (arrival, id) order."""
        out = []
        for _, rid in self._order.irange((self.lo, -1), (self.hi, float("inf"))):
            row = self._rows[rid]
            facts = served_facts(RecordFacts._make(row[_FACTS:_END]), row[_END:])
            if facts is not None:
                out.append(facts)
        return out

    def _charge(self, rid: int, c: Charge) -> None:
        self._uncharge(rid)
        self.kept.add(rid, c)
        if c.handoff_facts is not None:
            self.handoffs.add(rid, c.handoff_facts)

    def _uncharge(self, rid: int) -> None:
        old = self.kept.charge(rid)
        if old is not None:
            self.kept.remove(rid)
            if old.handoff_facts is not None:
                self.handoffs.remove(rid, old.handoff_facts)

    def _drop(self, rid: int) -> None:
        old = self._rows.pop(rid, None)
        if old is not None:
            self._order.remove((float(old[_PROXY_IN]), rid))
            self._uncharge(rid)
