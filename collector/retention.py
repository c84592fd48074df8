"""Per-minute rollups and deletion of old rows, so the store stays bounded under load.

Each complete minute (older than ``lag_s``, so late spans and the scrape after the minute
are in) is rolled up once: per instance, counters become their increase over the minute
(baseline: the last snapshot before it; resets handled by ``pdscope.stats``), gauges
their average and maximum, histograms their bucket increases; per (P, D) pair, request
records become counts and sums. Then raw snapshots, spans and request records older than
``retention_raw_s`` (and the controller's tick records, which replay reads with them) and rollups
older than ``retention_rollup_s`` are deleted.

The walk over minutes never starts before the rollup horizon (``now - retention_rollup_s``:
nothing older would be kept) nor after the newest complete minute, and it jumps over
minutes without data, so one row dated 0 (or 2554) cannot stall it.

``Retention.run`` blocks (run it in a thread) and raises ``store.db.StoreError``.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, insert, select
from sqlalchemy.orm import Session, sessionmaker

from pdscope.stats import counter_increase, histogram_increase
from store.db import transaction
from store.families import COUNTER_COLUMNS, GAUGE_COLUMNS, histogram_of, shape_of
from store.models import RequestRecord, RequestRollup, Snapshot, SnapshotRollup, SpanRow, TickRecord

log = logging.getLogger(__name__)

MAX_MINUTES_PER_RUN = 60  # catching up after downtime happens over several runs


@dataclass(frozen=True)
class RetentionResult:
    minutes_rolled: int
    snapshots_deleted: int
    spans_deleted: int
    records_deleted: int
    rollups_deleted: int


def _hist_increase(
    base: dict[str, Any] | None, rows: Sequence[dict[str, Any] | None]
) -> dict[str, Any] | None:
    h = histogram_increase(histogram_of(s) if s else None for s in [base, *rows])
    return None if h is None else shape_of(h)


def rollup_snapshots(base: Snapshot | None, rows: Sequence[Snapshot], minute: float) -> dict[str, Any]:
    """One SnapshotRollup's values from an instance's snapshots in one minute."""
    up = [r for r in rows if r.up]
    chain = ([base] if base is not None and base.up else []) + up
    increases: dict[str, float] = {}
    for col in COUNTER_COLUMNS:
        inc = counter_increase(getattr(r, col) for r in chain)
        if inc is not None:
            increases[col] = inc
    gauges: dict[str, dict[str, float]] = {}
    for col in GAUGE_COLUMNS:
        vals = [v for v in (getattr(r, col) for r in up) if v is not None and math.isfinite(v)]
        if vals:
            gauges[col] = {"avg": sum(vals) / len(vals), "max": max(vals)}
    histograms: dict[str, Any] = {}
    families = set().union(*(r.histograms.keys() for r in up)) if up else set()
    for fam in sorted(families):
        h = _hist_increase(
            base.histograms.get(fam) if base is not None and base.up else None,
            [r.histograms.get(fam) for r in up],
        )
        if h is not None:
            histograms[fam] = h
    last = rows[-1]
    return {
        "instance": last.instance,
        "pool": last.pool,
        "role": last.role,
        "minute": minute,
        "scrapes": len(rows),
        "up_scrapes": len(up),
        "gauges": gauges,
        "increases": increases,
        "histograms": histograms,
    }


def rollup_requests(records: Sequence[RequestRecord], minute: float) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], list[RequestRecord]] = defaultdict(list)
    for r in records:
        groups[(r.p_instance or "", r.d_instance or "")].append(r)
    out = []
    for (p, d), recs in groups.items():
        ttfts = [r.ttft_s for r in recs if r.ttft_s is not None]
        handoffs = [
            r.first_token - r.p_done for r in recs if r.first_token is not None and r.p_done is not None
        ]
        out.append(
            {
                "minute": minute,
                "p_instance": p,
                "d_instance": d,
                "requests": len(recs),
                "ok": sum(1 for r in recs if r.status == "ok"),
                "slo_met": sum(1 for r in recs if r.slo_met),
                "lease_suspects": sum(1 for r in recs if r.lease_expiry_suspect),
                "ttft_sum_s": sum(ttfts),
                "ttft_max_s": max(ttfts) if ttfts else None,
                "handoff_sum_s": sum(handoffs),
                "handoff_count": len(handoffs),
                "handoff_max_s": max(handoffs) if handoffs else None,
                "e2e_sum_s": sum(r.e2e_s for r in recs if r.e2e_s is not None),
            }
        )
    return out


def tick_record_cutoff(session: Session, cutoff: float) -> float:
    """Where the tick records are deleted up to, given the raw rows' ``cutoff``: the newest keyframe at
    or before it, so that a delta kept always has the keyframe it is rebuilt from (a record of format 2
    between keyframes holds only its difference from the one before). Records are so kept up to
    ``controller.tick_keyframe_every`` ticks longer than the raw rows. With no keyframe at or before the
    cutoff, the records before it are deltas that lost theirs already: deleted at the cutoff."""
    key = session.scalar(
        select(func.max(TickRecord.ts)).where(TickRecord.keyframe.is_(True), TickRecord.ts <= cutoff)
    )
    return cutoff if key is None else key


class Retention:
    def __init__(
        self, factory: sessionmaker[Session], raw_s: float, rollup_s: float, lag_s: float = 120.0
    ) -> None:
        self.factory = factory
        self.raw_s = raw_s
        self.rollup_s = rollup_s
        self.lag_s = lag_s
        self._next_minute: float | None = None

    def _frontier(self, now: float) -> float:
        """The first minute that is not complete yet (not to be rolled up now)."""
        return math.floor((now - self.lag_s) / 60.0) * 60.0

    def _clamp(self, minute: float, now: float) -> float:
        horizon = math.floor((now - self.rollup_s) / 60.0) * 60.0
        return min(max(minute, horizon), self._frontier(now))

    def _start_minute(self, session: Session, now: float) -> float | None:
        frontier = self._frontier(now)  # a rollup dated in the future (a bad clock) is not "done"
        last = session.scalar(select(func.max(SnapshotRollup.minute)).where(SnapshotRollup.minute < frontier))
        last_req = session.scalar(
            select(func.max(RequestRollup.minute)).where(RequestRollup.minute < frontier)
        )
        done = max((m for m in (last, last_req) if m is not None), default=None)
        if done is not None:
            return self._clamp(float(done) + 60.0, now)
        start = self._next_data(session, self._clamp(-math.inf, now))
        return None if start is None else self._clamp(start, now)

    def _next_data(self, session: Session, minute: float) -> float | None:
        """The start of the first minute at or after ``minute`` holding a snapshot or a record."""
        first = session.scalar(select(func.min(Snapshot.ts)).where(Snapshot.ts >= minute))
        first_req = session.scalar(
            select(func.min(RequestRecord.proxy_in)).where(RequestRecord.proxy_in >= minute)
        )
        start = min((m for m in (first, first_req) if m is not None), default=None)
        return None if start is None else math.floor(start / 60.0) * 60.0

    def _roll_minute(self, session: Session, minute: float) -> None:
        snaps = session.scalars(
            select(Snapshot)
            .where(Snapshot.ts >= minute - 60.0, Snapshot.ts < minute + 60.0)
            .order_by(Snapshot.ts)
        )
        before: dict[str, Snapshot] = {}
        inside: dict[str, list[Snapshot]] = defaultdict(list)
        for s in snaps:
            if s.ts < minute:
                if s.up:
                    before[s.instance] = s
            else:
                inside[s.instance].append(s)
        rows = [rollup_snapshots(before.get(inst), rs, minute) for inst, rs in inside.items()]
        if rows:
            session.execute(insert(SnapshotRollup), rows)
        recs = list(
            session.scalars(
                select(RequestRecord).where(
                    RequestRecord.proxy_in >= minute, RequestRecord.proxy_in < minute + 60.0
                )
            )
        )
        req_rows = rollup_requests(recs, minute)
        if req_rows:
            session.execute(insert(RequestRollup), req_rows)

    def run(self, now: float) -> RetentionResult:
        rolled = 0
        with transaction(self.factory) as session:
            if self._next_minute is None:
                self._next_minute = self._start_minute(session, now)
            elif self._next_minute < self._clamp(self._next_minute, now):  # fell behind the horizon
                self._next_minute = self._clamp(self._next_minute, now)
            frontier = self._frontier(now)
            while (
                self._next_minute is not None
                and self._next_minute < frontier
                and rolled < MAX_MINUTES_PER_RUN
            ):
                nxt = self._next_data(session, self._next_minute)
                if nxt is None or nxt >= frontier:  # nothing to roll up before the frontier
                    self._next_minute = frontier
                    break
                self._next_minute = nxt  # skip empty minutes (they roll up to nothing)
                self._roll_minute(session, self._next_minute)
                self._next_minute += 60.0
                rolled += 1
        cutoff = now - self.raw_s
        # Never delete raw rows that are not rolled up yet.
        if self._next_minute is not None:
            cutoff = min(cutoff, self._next_minute)
        with transaction(self.factory) as session:
            snaps = session.execute(delete(Snapshot).where(Snapshot.ts < cutoff)).rowcount  # type: ignore[attr-defined]
            spans = session.execute(delete(SpanRow).where(SpanRow.received_ts < cutoff)).rowcount  # type: ignore[attr-defined]
            recs = session.execute(delete(RequestRecord).where(RequestRecord.proxy_in < cutoff)).rowcount  # type: ignore[attr-defined]
            # the controller's tick records are replayed with the raw rows' window: kept as long
            session.execute(
                delete(TickRecord).where(TickRecord.ts < tick_record_cutoff(session, now - self.raw_s))
            )
            roll_cut = now - self.rollup_s
            rollups = session.execute(delete(SnapshotRollup).where(SnapshotRollup.minute < roll_cut)).rowcount  # type: ignore[attr-defined]
            rollups += session.execute(delete(RequestRollup).where(RequestRollup.minute < roll_cut)).rowcount  # type: ignore[attr-defined]
        result = RetentionResult(rolled, snaps or 0, spans or 0, recs or 0, rollups or 0)
        if rolled or snaps or spans or recs:
            log.info("retention: %s", result)
        return result
