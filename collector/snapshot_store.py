"""Write each scrape round to the store: one snapshot row per instance, in one transaction.

Rows go in with one multi-row INSERT (SQLAlchemy's insertmanyvalues), not one ORM
object each: at a thousand instances that is the difference between a few milliseconds
and a few hundred. ``write_round`` blocks (run it in a thread) and raises
``store.db.StoreError``; the service counts the failure and carries on.

It also notices counter resets (an instance restarted: its process start time moved, or
a counter went down). Snapshots keep the counters as scraped; readers handle resets in
``pdscope.stats.counter_increase``. The reset is counted and logged here so an operator
sees restarts.

A restart is **confirmed** only when two of the instance's own signals agree between two
consecutive up scrapes: its ``process_start_time_seconds`` moved forward and one of its
counters went down (:func:`restart_signals`). One signal alone (a counter that went down
with the start time unchanged or not exported, or a start time that moved while every
counter kept growing) is counted and logged, never confirmed. A confirmed restart is stored
on the instance (``InstanceRow.restarted_at``): the controller reads it to tell a D's stale peer
from a failing D. It is the time of the scrape that confirmed it (the new process's first up
scrape, within a scrape interval of its being ready), not the process's start time: a vLLM
spends its first minute or more loading weights, and the controller judges a D's failures
toward a P that came back "within its window" from that time; counted from the start time,
the window had passed before the new P served its first handoff (a CPU P took 36 s to start
in CI, the controller's window was 15 s, and the D was charged the stale pair's failures).

Each instance's identity (``Signals.identity``: its model, KV block size and dtype, which a P x D pair
must agree on) is stored on the instance too (``InstanceRow.kv_identity``) when an up scrape finds it
changed, for the controller's compatible-pairs rule (``controller.policy.compat``).
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
SNAPSHOT_COLUMNS = tuple(
    c.name for c in Snapshot.__table__.columns if c.name not in ("id", "stamp")
)  # the database's own


PROCESS_START = "process_start"
COUNTER_RESET = "counter_reset"


def restart_signals(prev: dict[str, Any] | None, cur: dict[str, Any]) -> tuple[str, ...]:
    """The signals of a restart between ``prev`` and ``cur`` (two up snapshot rows of one instance):
    :data:`PROCESS_START` (its start time moved forward by over a second), :data:`COUNTER_RESET` (a
    watched counter went down)."""
    if prev is None or not prev.get("up") or not cur.get("up"):
        return ()
    out: list[str] = []
    prev_start, c_start = prev.get("process_start_ts"), cur.get("process_start_ts")
    if prev_start is not None and c_start is not None and c_start > prev_start + 1.0:
        out.append(PROCESS_START)
    for col in RESET_WATCH:
        a, b = prev.get(col), cur.get(col)
        if a is not None and b is not None and b < a:
            out.append(COUNTER_RESET)
            break
    return tuple(out)


def counter_reset(prev: dict[str, Any] | None, cur: dict[str, Any]) -> bool:
    """True when ``cur`` shows any sign of a restart since ``prev`` (both snapshot rows of one instance)."""
    return bool(restart_signals(prev, cur))


class SnapshotStore:
    """Owns the collector's writes of instances and snapshots."""

    def __init__(self, factory: sessionmaker[Session]) -> None:
        self.factory = factory
        self._last: dict[str, dict[str, Any]] = {}
        self.resets: dict[str, int] = {}
        self._restarted: dict[str, float] = {}  # confirmed restarts not yet stored: name -> when confirmed
        self._identity: dict[str, dict[str, str]] = {}  # each instance's identity as last stored

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
            signals = restart_signals(self._last.get(r.target.name), full)
            if signals:
                self._count_restart(r.target.name, signals, full)
            if full["up"]:
                self._last[r.target.name] = full
            rows.append(full)
        return rows

    def _count_restart(self, name: str, signals: tuple[str, ...], row: dict[str, Any]) -> None:
        self.resets[name] = self.resets.get(name, 0) + 1
        if len(signals) < 2:
            log.warning("%s on %s alone: not confirmed as a restart", signals[0].replace("_", " "), name)
            return
        log.warning("%s restarted: its process start time moved and its counters reset", name)
        self._restarted[name] = float(row["ts"])  # seen back, not started: see the module docstring

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
            for name, started in self._restarted.items():
                session.execute(
                    update(InstanceRow).where(InstanceRow.name == name).values(restarted_at=started)
                )
            changed = self._changed_identities(results)
            for name, ident in changed.items():
                session.execute(update(InstanceRow).where(InstanceRow.name == name).values(kv_identity=ident))
        self._restarted.clear()
        self._identity.update(changed)
        return len(rows)

    def _changed_identities(self, results: Sequence[ScrapeResult]) -> dict[str, dict[str, str]]:
        """The identities the round's up scrapes report that differ from those last stored."""
        out: dict[str, dict[str, str]] = {}
        for r in results:
            if r.up and r.signals is not None:
                ident = dict(r.signals.identity)
                if self._identity.get(r.target.name) != ident:
                    out[r.target.name] = ident
        return out
