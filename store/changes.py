"""Rows changed since a reader's last read, by the stamps the database writes (migration 0017).

A reader that keeps a window between reads (the controller's SLO window, ``controller.slowindow``)
reads it whole once, then only the rows inserted or updated since: :class:`ChangeCursor` holds the
mark of its last read and reads the rows of one table stamped after it, in the caller's transaction.

The mark, per dialect (how the stamps are written: migration 0017):

- PostgreSQL: the oldest transaction still running when the read's snapshot was taken
  (``txid_snapshot_xmin``). A row the read could not see was written by that transaction or a later
  one, so the next read asks for stamps at or above it. Rows already read come again when their
  transaction ran beside an older one: the reader keeps the latest of each row by id.
- SQLite: the highest stamp of the table when it read. One writer at a time: a write not yet
  committed then stamps above it. If the table's highest stamp goes below the mark (its newest rows
  were deleted, or the database was replaced), the mark means nothing: :meth:`ChangeCursor.changed`
  answers None and the reader reads its window whole again. Not seen: the newest row deleted and a row
  inserted before the next read (it may take the deleted row's stamp and id); the reader has it at its
  next whole read (``controller.whole_read_every_s``).

A row stored before the stamps (``stamp`` null) is never read as a change: a reader starts from a
whole read (:meth:`ChangeCursor.start`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Select, func, select, text
from sqlalchemy.orm import InstrumentedAttribute, Session

_PG_XMIN = text("SELECT txid_snapshot_xmin(txid_current_snapshot())")


class ChangeCursor:
    """The mark of one reader's last read of one table (``stamp``: the table's stamp column)."""

    def __init__(self, stamp: InstrumentedAttribute[int | None]) -> None:
        self.stamp = stamp
        self.mark: int | None = None

    def _now(self, session: Session) -> int:
        if session.get_bind().dialect.name == "postgresql":
            return int(session.scalar(_PG_XMIN) or 0)
        return int(session.scalar(select(func.coalesce(func.max(self.stamp), 0))) or 0)

    def start(self, session: Session) -> None:
        """Mark a whole read about to be made: call it first, so every change the whole read misses (not
        committed yet when it reads) is after the mark. A change both read whole and after the mark is
        read twice; the reader keeps the latest of each row by id."""
        self.mark = self._now(session)

    def changed(self, session: Session, stmt: Select[Any]) -> Sequence[Any] | None:
        """``stmt``'s rows stamped after the mark (at or after it on PostgreSQL), as Core rows, and the
        mark moved past them; None when there is no mark or it means nothing any more (read whole)."""
        if self.mark is None:
            return None
        now = self._now(session)
        postgres = session.get_bind().dialect.name == "postgresql"
        if not postgres and now < self.mark:
            self.mark = None
            return None
        after = self.stamp >= self.mark if postgres else self.stamp > self.mark
        rows = session.connection().execute(stmt.where(after)).all()
        self.mark = now
        return rows
