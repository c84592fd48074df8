"""What a controller keeps of its reads between ticks, so a tick reads only what changed.

:class:`KeptReads` is owned by the leader's reconciler (``controller.loop``) and handed to
``controller.observe`` each tick. It holds the SLO window (``controller.slowindow``) and the cursor
of the records read into it (``store.changes``); with tenants on, the tenants' window
(``controller.tenantrows``, with the tally of their figures) with its own cursor, read whole on the
same occasions (and when the clock went back before what it retired), its reads counted apart
(``tenant_counts``); and the window's snapshots (``controller.snaprows``: insert-only, so only those
stored since are read), with a cursor of their own, on the same occasions (and when the window would
reach before what it let go), counted in ``snapshot_counts``; and the evidence window
(``controller.evidencerows``: the records each instance is charged with, and their charges), with its own
cursor, on the same occasions (and when the window would reach before what it retired or end before what
it charged), counted in ``evidence_counts``. A tick reads the
records stamped since the last read; a whole read (the window's records, as
``store.queries.slo_summary`` reads them) happens:

- on the first tick, and when this controller becomes the leader (a new ``KeptReads``);
- when the mark means nothing any more (SQLite: the table's newest rows were deleted);
- when the window asked for changed (``slo.window_s``, ``slo.*`` targets or percentiles, or
  ``controller.trusted_span_senders`` after a config reload);
- every ``controller.whole_read_every_s`` (a safety net: a kept window that drifted, by a record
  deleted inside it say, is right again from there).

:class:`ReadCounts` counts each window's reads over the process's life
(``pdscope_controller_window_reads_total{window}``, :meth:`KeptReads.read_counts`).
Without a ``KeptReads`` (replay, tests, the dashboard's own reads) ``observe`` reads the window whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from analysis.rates import EXTRA_FIELDS
from analysis.tenants import terms_of
from controller.evidencerows import EvidenceRows
from controller.policy.charges import RecordFacts
from controller.slowindow import SLORow, SLOWindow, WindowFigures
from controller.snaprows import SnapshotRows
from controller.tenantrows import TenantRows
from controller.tenants import ReadTenants
from pdscope.config import Settings
from store.attribution import trusted_records
from store.changes import ChangeCursor
from store.models import RequestRecord, Snapshot
from store.queries import SNAPSHOT_SCALARS, FiguresMemo
from store.tenants import TENANT_COLUMNS
from store.window import WindowRows

# the columns SLOWindow reads, in SLORow's order
SLO_COLUMNS = tuple(getattr(RequestRecord, name) for name in SLORow._fields)
# the columns SnapshotRows keeps: a window read's (store.queries.snapshot_window), then the id
SNAPSHOT_ROW_COLUMNS = (*SNAPSHOT_SCALARS, Snapshot.id)
# the columns EvidenceRows keeps: id, sender, the charging rules' (RecordFacts), the rates' fit's besides
EVIDENCE_COLUMNS = (
    RequestRecord.id,
    RequestRecord.sender,
    *(getattr(RequestRecord, name) for name in (*RecordFacts._fields, *EXTRA_FIELDS)),
)
# the columns TenantRows reads: id, sender, then the tenants' own
TENANT_ROW_COLUMNS = (RequestRecord.id, RequestRecord.sender, *TENANT_COLUMNS)


def _trust(settings: Settings) -> frozenset[str] | None:
    """The span senders the controller believes (None: every one), as both windows match them."""
    senders = settings.controller.trusted_span_senders
    return None if senders is None else frozenset(senders)


@dataclass
class ReadCounts:
    """One kept window's reads: whole, and of the changes only."""

    whole: int = 0
    changes: int = 0


@dataclass
class KeptReads:
    """The windows kept between one leader's ticks (the SLO window, the tenants', the snapshots), each
    with its cursor."""

    whole_read_every_s: float = 300.0
    counts: ReadCounts = field(default_factory=ReadCounts)
    window: SLOWindow | None = None
    cursor: ChangeCursor | None = None
    last_whole: float | None = None
    # the tenants' window (controller.tenantrows), its cursor and its last whole read: kept apart from
    # the SLO window's (read only while tenants are on)
    tenant_counts: ReadCounts = field(default_factory=ReadCounts)
    tenant_rows: TenantRows | None = None
    tenant_cursor: ChangeCursor | None = None
    tenant_whole: float | None = None
    # the window's snapshots (controller.snaprows), their cursor and their last whole read
    snapshot_counts: ReadCounts = field(default_factory=ReadCounts)
    snapshot_rows: SnapshotRows | None = None
    snapshot_cursor: ChangeCursor | None = None
    snapshot_whole: float | None = None
    # the scrape figures of the window's snapshots and of its tail (store.queries.signals_of_rows's memos)
    scrape_figures: tuple[FiguresMemo, FiguresMemo] = field(default_factory=lambda: ({}, {}))
    # the evidence window's records and their charges (controller.evidencerows), their cursor and whole read
    evidence_counts: ReadCounts = field(default_factory=ReadCounts)
    evidence_rows: EvidenceRows | None = None
    evidence_cursor: ChangeCursor | None = None
    evidence_whole: float | None = None

    def slo(self, session: Session, settings: Settings, now: float) -> WindowFigures | None:
        """The SLO window's figures at ``now``, reading only what changed since the last tick if it can."""
        trust = _trust(settings)
        span = settings.slo.window_s
        w, cur = self.window, self.cursor
        rows = None
        if (
            w is not None
            and cur is not None
            and w.matches(span, trust, settings.slo)
            and not self._due(now, self.last_whole)
        ):
            rows = cur.changed(session, select(*SLO_COLUMNS))
        if rows is None or w is None:
            w, rows = self._whole(session, span, trust, settings, now)
        else:
            self.counts.changes += 1
        w.update(rows)
        w.slide(now)
        return w.figures()

    def prediction(self, limit: int) -> tuple[int, float | None] | None:
        """The TTFT predictor's fleet figures (measured, error median) over the window :meth:`slo` read
        last, its ``limit`` newest predicted records (``SLOWindow.prediction``); None before any read."""
        return None if self.window is None else self.window.prediction(limit)

    def tenants(self, session: Session, settings: Settings, now: float, limit: int) -> WindowRows:
        """The believed records of the tenants' window at ``now`` as ``store.tenants.tenant_rows`` reads
        them (at most ``limit``), reading only what changed since the last tick if it can."""
        return self._tenants(session, settings, now, limit).read(now - settings.slo.window_s, now)

    def tenant_figures(self, session: Session, settings: Settings, now: float, limit: int) -> ReadTenants:
        """The figures of the tenants' window at ``now`` (``controller.tenants.read_tenants``' over
        ``slo.window_s``), from the rows and tally kept between ticks (``TenantRows.window``)."""
        lo = now - settings.slo.window_s
        terms = terms_of(settings.tenants, settings.slo)
        rows = self._tenants(session, settings, now, limit)
        window, truncated = rows.window(lo, now, terms, settings.tenants.cost_per_decode_token)
        return ReadTenants(window, truncated, limit)

    def _tenants(self, session: Session, settings: Settings, now: float, limit: int) -> TenantRows:
        """The tenants' rows, brought to ``now``: the changed records read in, the window slid."""
        trust = _trust(settings)
        lo = now - settings.slo.window_s
        rows, cur = self.tenant_rows, self.tenant_cursor
        changed = None
        if rows is not None and cur is not None and rows.matches(settings.slo.window_s, trust, limit, lo):
            due = self._due(now, self.tenant_whole)
            changed = None if due else cur.changed(session, select(*TENANT_ROW_COLUMNS))
        if changed is None or rows is None:
            rows, changed = self._whole_tenants(session, settings.slo.window_s, trust, limit, now)
        else:
            self.tenant_counts.changes += 1
        rows.update(changed)
        rows.slide(lo)
        return rows

    def _whole_tenants(
        self, session: Session, span: float, trust: frozenset[str] | None, limit: int, now: float
    ) -> tuple[TenantRows, Sequence[Any]]:
        """New tenant rows and the records to fill them: the window's that ``trust`` believes (those
        ahead of ``now`` too: they wait in it until due); the cursor marked before the read."""
        self.tenant_rows = TenantRows(span, trust, limit)
        self.tenant_cursor = ChangeCursor(RequestRecord.stamp)
        self.tenant_cursor.start(session)
        stmt = select(*TENANT_ROW_COLUMNS).where(RequestRecord.proxy_in >= now - span)
        rows = session.connection().execute(trusted_records(trust).apply(stmt)).all()
        self.tenant_whole = now
        self.tenant_counts.whole += 1
        return self.tenant_rows, rows

    def snapshots(self, session: Session, span: float, now: float) -> dict[str, list[Any]]:
        """The window's snapshot rows at ``now`` as ``store.queries.snapshot_window`` reads them over
        ``[now - span, now]`` (each with its ``id`` besides), reading only those stored since the last tick
        if it can: a whole read when the window would reach before what was let go (a longer span, a clock
        gone back).

        Both reads are bounded in time: from the window's start (a cursor whose mark an old transaction
        holds back brings rows long gone again), and up to the next whole read's time (a snapshot stamped
        further ahead of the clock is read by the whole read that is due before it is)."""
        since = now - span
        rows, cur, last = self.snapshot_rows, self.snapshot_cursor, self.snapshot_whole
        changed = None
        if (
            rows is not None
            and cur is not None
            and last is not None
            and rows.since <= since  # a longer span, or a clock gone back, reaches before what it let go
        ):
            bounded = select(*SNAPSHOT_ROW_COLUMNS).where(
                Snapshot.ts >= since, Snapshot.ts <= last + self.whole_read_every_s
            )
            changed = None if self._due(now, last) else cur.changed(session, bounded)
        if changed is None or rows is None:
            rows = self.snapshot_rows = SnapshotRows()
            self.snapshot_cursor = ChangeCursor(Snapshot.stamp)
            self.snapshot_cursor.start(session)
            stmt = (
                select(*SNAPSHOT_ROW_COLUMNS)
                .where(Snapshot.ts >= since, Snapshot.ts <= now + self.whole_read_every_s)
                .order_by(Snapshot.ts, Snapshot.id)  # held in this order: each row appended
            )
            changed = session.connection().execute(stmt).all()
            self.snapshot_whole = now
            self.snapshot_counts.whole += 1
        else:
            self.snapshot_counts.changes += 1
        rows.update(changed)
        rows.slide(since)
        return rows.read(since, now)

    def evidence(self, session: Session, settings: Settings, since: float, now: float) -> EvidenceRows:
        """The evidence window's records over ``[since, now]`` and their charges, reading only the
        records stamped since the last tick if it can: a whole read on the occasions above, and when the
        window would reach before what it retired (a longer window) or end before what it charged (a clock
        gone back). A record that arrived ahead of the clock waits, not charged."""
        trust = _trust(settings)
        rows, cur = self.evidence_rows, self.evidence_cursor
        changed = None
        if rows is not None and cur is not None and rows.matches(trust, since, now):
            # every changed record: one whose arrival moved out of the window leaves it
            stmt = select(*EVIDENCE_COLUMNS)
            changed = None if self._due(now, self.evidence_whole) else cur.changed(session, stmt)
        if changed is None or rows is None:
            rows = self.evidence_rows = EvidenceRows(trust)
            self.evidence_cursor = ChangeCursor(RequestRecord.stamp)
            self.evidence_cursor.start(session)
            stmt = select(*EVIDENCE_COLUMNS).where(RequestRecord.proxy_in >= since)
            changed = session.connection().execute(trusted_records(trust).apply(stmt)).all()
            self.evidence_whole = now
            self.evidence_counts.whole += 1
        else:
            self.evidence_counts.changes += 1
        rows.update(changed)
        rows.slide(since, now)
        return rows

    def read_counts(self) -> tuple[tuple[str, int, int], ...]:
        """Each kept window's reads: (window, whole, changes only)."""
        windows = (
            ("slo", self.counts),
            ("evidence", self.evidence_counts),
            ("snapshots", self.snapshot_counts),
            ("tenants", self.tenant_counts),
        )
        return tuple((name, c.whole, c.changes) for name, c in windows)

    def _due(self, now: float, last: float | None) -> bool:
        return last is None or now - last >= self.whole_read_every_s or now < last

    def _whole(
        self, session: Session, span: float, trust: frozenset[str] | None, settings: Settings, now: float
    ) -> tuple[SLOWindow, Sequence[Any]]:
        """A new window and the records of ``[now - span, now]``; the cursor marked before the read."""
        self.window = SLOWindow(span, trust, settings.slo)
        self.cursor = ChangeCursor(RequestRecord.stamp)
        self.cursor.start(session)
        # no upper bound: a record stamped ahead of the clock waits in the window until it is due
        stmt = select(*SLO_COLUMNS).where(RequestRecord.proxy_in >= now - span)
        rows = session.connection().execute(stmt).all()
        self.last_whole = now
        self.counts.whole += 1
        return self.window, rows
