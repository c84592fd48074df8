"""Write each scrape round to the store: one snapshot row per instance, in one transaction.

Rows go in with one multi-row INSERT (SQLAlchemy's insertmanyvalues), not one ORM
object each: at a thousand instances that is the difference between a few milliseconds
and a few hundred. ``write_round`` blocks (run it in a thread) and raises
``store.db.StoreError``; the service counts the failure and carries on.

It also notices counter resets (an instance restarted: its process start time moved, or
a counter went down). Snapshots keep the counters as scraped; readers handle resets in
``pdscope.stats.counter_increase``. The reset is counted and logged here so an operator
sees restarts.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from collector.bulk import insert_rows
from collector.scraper import ScrapeResult
from collector.targets import ScrapeTarget, snapshot_row
from store.db import transaction
from store.families import RESET_WATCH
from store.models import InstanceRow, Snapshot

log = logging.getLogger(__name__)

_SNAPSHOTS = Snapshot.metadata.tables["snapshots"]
SNAPSHOT_COLUMNS = tuple(c.name for c in Snapshot.__table__.columns if c.name != "id")


def counter_reset(prev: dict[str, Any] | None, cur: dict[str, Any]) -> bool:
    """True when ``cur`` shows a restart since ``prev`` (both snapshot rows of one instance)."""
    if prev is None or not prev.get("up") or not cur.get("up"):
        return False
    prev_start, c_start = prev.get("process_start_ts"), cur.get("process_start_ts")
    if prev_start is not None and c_start is not None and c_start > prev_start + 1.0:
        return True
    for col in RESET_WATCH:
        a, b = prev.get(col), cur.get(col)
        if a is not None and b is not None and b < a:
            return True
    return False


class SnapshotStore:
    """Owns the collector's writes of instances and snapshots."""

    def __init__(self, factory: sessionmaker[Session]) -> None:
        self.factory = factory
        self._last: dict[str, dict[str, Any]] = {}
        self.resets: dict[str, int] = {}

    def ensure_instances(self, targets: Sequence[ScrapeTarget], now: float) -> None:
        with transaction(self.factory) as session:
            known = {row.name: row for row in session.scalars(select(InstanceRow))}
            for t in targets:
                row = known.get(t.name)
                if row is None:
                    session.add(
                        InstanceRow(
                            name=t.name,
                            pool=t.pool,
                            role=t.role,
                            url=t.url,
                            metrics_url=t.metrics_url,
                            labels={},
                            first_seen=now,
                            last_seen=now,
                        )
                    )
                else:
                    row.pool, row.role, row.url, row.metrics_url = t.pool, t.role, t.url, t.metrics_url

    def rows_for(self, results: Sequence[ScrapeResult]) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for r in results:
            row = snapshot_row(r.target, r.ts, r.duration_s, r.signals, r.error)
            full = dict.fromkeys(SNAPSHOT_COLUMNS)
            full.update(row)
            if counter_reset(self._last.get(r.target.name), full):
                self.resets[r.target.name] = self.resets.get(r.target.name, 0) + 1
                log.warning("counter reset on %s: the instance restarted", r.target.name)
            if full["up"]:
                self._last[r.target.name] = full
            rows.append(full)
        return rows

    def write_round(self, results: Sequence[ScrapeResult]) -> int:
        """Insert one round; returns the number of rows. Raises StoreError."""
        if not results:
            return 0
        rows = self.rows_for(results)
        up_names = [r.target.name for r in results if r.up]
        with transaction(self.factory) as session:
            insert_rows(session, _SNAPSHOTS, rows)
            if up_names:
                last = max(r.ts for r in results)
                session.execute(
                    update(InstanceRow).where(InstanceRow.name.in_(up_names)).values(last_seen=last)
                )
        return len(rows)
