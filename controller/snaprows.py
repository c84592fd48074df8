"""The window's snapshots, kept between a leader's ticks: each tick reads only the snapshots stored since.

Snapshots are insert-only, so a kept window changes by the rows stored since the last read (by their
stamps, ``store.changes``) and the rows the window leaves. :class:`SnapshotRows` keeps them per instance in
(time, id) order, as ``store.queries.snapshot_window`` reads them, and answers that read's rows for any
``[since, until]`` within what it holds. A row stamped ahead of the clock waits until it is due.

**Overlap.** A read by stamp may bring a row again (on PostgreSQL, the rows of a transaction that ran
beside an older one); a row already held, by id, is not added twice.

Pure: no I/O; :class:`controller.kept.KeptReads` reads and decides when a whole read is due.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterable
from typing import Any


def _ts(row: Any) -> float:
    return float(row.ts)


def _order(row: Any) -> tuple[float, int]:
    return float(row.ts), int(row.id)


class SnapshotRows:
    """The snapshot rows of a window, per instance, in (ts, id) order."""

    def __init__(self) -> None:
        self.since = -math.inf  # where it last let go (:meth:`slide`): it holds nothing before
        self._rows: dict[str, list[Any]] = {}
        self._ids: set[int] = set()

    def __len__(self) -> int:
        return len(self._ids)

    def update(self, rows: Iterable[Any]) -> None:
        """Hold ``rows`` (each with ``id``, ``instance`` and ``ts``), but not one already held."""
        for row in rows:
            if row.id in self._ids:
                continue
            self._ids.add(row.id)
            held = self._rows.setdefault(row.instance, [])
            if not held or _order(held[-1]) <= _order(row):
                held.append(row)  # the usual case: stored in time order
            else:
                insort(held, row, key=_order)

    def slide(self, since: float) -> None:
        """Let go of the rows before ``since`` (the window's start)."""
        self.since = max(self.since, since)
        for name in list(self._rows):
            held = self._rows[name]
            cut = bisect_left(held, since, key=_ts)
            if not cut:
                continue
            self._ids.difference_update(row.id for row in held[:cut])
            if cut == len(held):
                del self._rows[name]
            else:
                del held[:cut]

    def read(self, since: float, until: float) -> dict[str, list[Any]]:
        """Every instance's rows of ``[since, until]``, in (ts, id) order: ``snapshot_window``'s answer."""
        out: dict[str, list[Any]] = {}
        for name, held in self._rows.items():
            rows = held[bisect_left(held, since, key=_ts) : bisect_right(held, until, key=_ts)]
            if rows:
                out[name] = rows
        return out
