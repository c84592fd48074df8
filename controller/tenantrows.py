"""The tenants' records kept between ticks: each tick adds the records that changed and slides the window.

The controller's tenant figures (``TenantSLOBreach``, ``TenantStarved``, the ``pdscope_tenant_*``
metrics; ``Observation.tenants``) cover ``slo.window_s`` of records, the newest
``store.tenants.DEFAULT_RECORDS`` of those the controller believes, and were read whole every tick.
:class:`TenantRows` keeps those rows instead: a tick hands it the records stamped since the last read
(``store.changes``) and the window; it replaces each changed record's row, drops one it no longer
believes, and retires what left the window. :meth:`TenantRows.read` gives the rows in the order and
bound of ``store.tenants.tenant_rows`` (newest first by ``proxy_in``, then ``id``; at most ``limit``,
saying when more matched), so ``analysis.tenants.tenant_window`` over them equals the whole read's,
to the bit (``tests/controller/test_tenantrows.py``, on SQLite and PostgreSQL).

It holds every believed row of the window, as ``controller.slowindow`` holds its part of each: the
bound is the window's, not ``limit`` (a newer row can stop being believed, and an older one then counts
again). A record deleted inside the window stays counted until it leaves it or the next whole read, as
in ``controller.slowindow``.

:meth:`TenantRows.window` gives the figures themselves without going over the rows again: it keeps an
``analysis.tenants.TenantTally`` of the rows of ``[lo, hi]`` (those ahead of the clock join it when
they are due), each changed row taken back and added anew, each retired one taken back. The tally is
exact, so its figures equal ``tenant_window`` over :meth:`TenantRows.read`'s rows to the bit. Built
again from the rows when the tenants' terms change (a config reload) or the clock went back; when more
than ``limit`` rows are inside, the figures are those of the newest ``limit``, from the rows.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice
from typing import Any

from sortedcontainers import SortedList

from analysis.tenants import TenantFacts, TenantTally, TenantTerms, TenantWindow, tenant_window
from pdscope.tenantcost import Costs
from store.window import WindowRows

# a row as read: id, sender, then store.tenants.TENANT_COLUMNS (proxy_in is the fourth of them)
_ID, _SENDER, _FACTS, _PROXY_IN = 0, 1, 2, 5


class TenantRows:
    """The believed records of a tenant window, by id, read newest first at most ``limit``."""

    def __init__(self, span_s: float, senders: frozenset[str] | None, limit: int) -> None:
        self.span_s, self.senders, self.limit = span_s, senders, limit
        self._rows: dict[int, TenantFacts] = {}
        self._order: SortedList[tuple[float, int]] = SortedList()  # (proxy_in, id), oldest first
        self.lo = -float("inf")  # rows that arrived before it are retired: a window from there is not held
        self._tally: TenantTally | None = None  # of the rows of [lo, _hi]: the ids in _tallied
        self._tallied: set[int] = set()
        self._hi = -float("inf")

    def matches(self, span_s: float, senders: frozenset[str] | None, limit: int, lo: float) -> bool:
        """Whether it holds the window of these settings starting at ``lo`` (not before what it retired:
        a clock that went back needs a whole read)."""
        return (self.span_s, self.senders, self.limit) == (span_s, senders, limit) and lo >= self.lo

    def __len__(self) -> int:
        return len(self._rows)

    def update(self, rows: Iterable[Sequence[Any]]) -> None:
        """Each row (id, sender, the tenant columns) replaces the record's last; one the controller does
        not believe, or without an arrival time, is dropped."""
        for row in rows:
            rid, at = int(row[_ID]), row[_PROXY_IN]
            self._drop(rid)
            trusted = self.senders is None or row[_SENDER] in self.senders
            if trusted and isinstance(at, float | int):
                facts = self._rows[rid] = TenantFacts(*row[_FACTS:])
                self._order.add((float(at), rid))
                if self._tally is not None and self.lo <= at <= self._hi:
                    self._tally.add(facts)
                    self._tallied.add(rid)

    def slide(self, lo: float) -> None:
        """Retire the rows that arrived before ``lo``."""
        while self._order and self._order[0][0] < lo:
            self._drop(self._order[0][1])
        self.lo = max(self.lo, lo)

    def read(self, lo: float, hi: float) -> WindowRows:
        """The rows of ``[lo, hi]``, newest first, at most ``limit`` (``truncated``: more matched)."""
        got = self._newest(lo, hi)
        return WindowRows(tuple(got[: self.limit]), len(got) > self.limit)

    def _newest(self, lo: float, hi: float) -> list[TenantFacts]:
        """The rows of ``[lo, hi]``, newest first, at most ``limit`` + 1."""
        inside = self._order.irange((lo, -1), (hi, float("inf")), reverse=True)
        return [self._rows[rid] for _, rid in islice(inside, self.limit + 1)]

    def window(
        self, lo: float, hi: float, terms: dict[str, TenantTerms], costs: Costs
    ) -> tuple[TenantWindow, bool]:
        """The figures of the rows of ``[lo, hi]`` under ``terms`` (at most the newest ``limit``), and
        whether more matched: ``tenant_window`` over :meth:`read`'s rows. Call after :meth:`slide` to
        ``lo``."""
        tally = self._tally
        if tally is None or tally.terms != terms or hi < self._hi:
            inside = [rid for _, rid in self._order.irange((lo, -1), (hi, float("inf")))]
            tally = self._tally = TenantTally.of((self._rows[rid] for rid in inside), terms)
            self._tallied = set(inside)
        else:  # the rows that came due since
            for _, rid in self._order.irange((self._hi, float("inf")), (hi, float("inf")), (False, True)):
                tally.add(self._rows[rid])
                self._tallied.add(rid)
        self._hi = hi
        if len(self._tallied) > self.limit:
            newest = self._newest(lo, hi)[: self.limit]
            return tenant_window(newest, terms, since=lo, until=hi, costs=costs), True
        return tally.window(lo, hi, costs), False

    def _drop(self, rid: int) -> None:
        old = self._rows.pop(rid, None)
        if old is not None:
            self._order.remove((float(old.proxy_in), rid))
            if rid in self._tallied:
                self._tallied.discard(rid)
                assert self._tally is not None
                self._tally.remove(old)
