"""What a controller keeps of its reads between ticks, so a tick reads only what changed.

:class:`KeptReads` is owned by the leader's reconciler (``controller.loop``) and handed to
``controller.observe`` each tick. It keeps four windows, each a :class:`Kept` (its rows, the cursor of
the changes read into them, ``store.changes``, its last whole read and its reads' counts), and each
brought to the tick the same way (:meth:`Kept.bring`): the SLO window (``controller.slowindow``); with
tenants on, the tenants' window (``controller.tenantrows``, with the tally of their figures; read whole
too when the clock went back before what it retired); the window's snapshots (``controller.snaprows``:
insert-only, so only those stored since are read; read whole too when the window would reach before
what it let go); and the evidence window (``controller.evidencerows``: the records each instance is
charged with, and their charges; read whole too when the window would reach before what it retired or
end before what it charged). A tick reads the records stamped since the last read; a whole read (the
window's records, as ``store.queries.slo_summary`` reads them) happens:

- on the first tick, and when this controller becomes the leader (:meth:`KeptReads.restarted`);
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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from sqlalchemy import Select, select
from sqlalchemy.orm import InstrumentedAttribute, Session

from analysis.rates import EXTRA_FIELDS
from analysis.tenants import terms_of
from controller.evidencerows import EvidenceRows
from controller.policy.charges import RecordFacts
from controller.policy.signals import PairSignals
from controller.slowindow import SLORow, SLOWindow, WindowFigures
from controller.snaprows import SnapshotRows
from controller.tenantrows import TenantRows
from controller.tenants import ReadTenants
from pdscope.config import Settings
from pdscope.tenantcost import Costs
from store.attribution import trusted_records
from store.changes import ChangeCursor
from store.models import RequestRecord, Snapshot
from store.queries import SNAPSHOT_SCALARS, FiguresMemo, HandoffStats
from store.tenants import TENANT_COLUMNS
from store.window import WindowRows

T = TypeVar("T")

# a P x D pair's signals a tick made (controller.observe), with what they were made of: its handoff figures
# (kept as one object until its handoffs change) and the rest of its fields
PairMemo = dict[tuple[str, str], tuple[HandoffStats | None, tuple[Any, ...], PairSignals]]

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
class Kept(Generic[T]):
    """One window kept between ticks: its rows, the cursor of the changes read into them, its last whole
    read's time and its reads' counts (carried over the process's life by :meth:`KeptReads.restarted`)."""

    counts: ReadCounts = field(default_factory=ReadCounts)
    rows: T | None = None
    cursor: ChangeCursor | None = None
    whole_at: float | None = None

    def due(self, now: float, every_s: float) -> bool:
        """Whether a whole read is due: none yet, ``every_s`` since the last, or the clock gone back."""
        last = self.whole_at
        return last is None or now - last >= every_s or now < last

    def bring(
        self,
        session: Session,
        now: float,
        every_s: float,
        fits: Callable[[T], bool],
        changes: Callable[[], Select[Any]],
        whole: Callable[[], tuple[T, Select[Any]]],
        stamp: InstrumentedAttribute[int | None],
    ) -> tuple[T, Sequence[Any]]:
        """The rows and what to read into them at ``now``: the rows stamped since the last read
        (``changes``' rows) where the kept rows still ``fit`` and no whole read is due; else new rows
        and the whole read's (``whole``), the cursor (of ``stamp``) marked before that read."""
        rows, cur = self.rows, self.cursor
        if rows is not None and cur is not None and not self.due(now, every_s) and fits(rows):
            changed = cur.changed(session, changes())
            if changed is not None:
                self.counts.changes += 1
                return rows, changed
        rows, stmt = whole()
        self.rows, self.cursor = rows, ChangeCursor(stamp)
        self.cursor.start(session)
        changed = session.connection().execute(stmt).all()
        self.whole_at = now
        self.counts.whole += 1
        return rows, changed


@dataclass
class KeptReads:
    """The windows kept between one leader's ticks (the SLO window, the tenants', the snapshots, the
    evidence), each with its cursor."""

    whole_read_every_s: float = 300.0
    slo_window: Kept[SLOWindow] = field(default_factory=Kept)
    # the tenants' window (controller.tenantrows): kept apart from the SLO window's (read only while
    # tenants are on)
    tenant_window: Kept[TenantRows] = field(default_factory=Kept)
    # the window's snapshots (controller.snaprows)
    snapshot_window: Kept[SnapshotRows] = field(default_factory=Kept)
    # the scrape figures of the window's snapshots and of its tail (store.queries.signals_of_rows's memos)
    scrape_figures: tuple[FiguresMemo, FiguresMemo] = field(default_factory=lambda: ({}, {}))
    # the evidence window's records and their charges (controller.evidencerows)
    evidence_window: Kept[EvidenceRows] = field(default_factory=Kept)
    # each P x D pair's signals the last tick made, and of what (controller.observe's memo)
    pair_signals: PairMemo = field(default_factory=dict)

    def restarted(self, whole_read_every_s: float) -> KeptReads:
        """Nothing kept (the next tick reads every window whole), each window's read counts carried."""
        return KeptReads(
            whole_read_every_s,
            Kept(self.slo_window.counts),
            Kept(self.tenant_window.counts),
            Kept(self.snapshot_window.counts),
            evidence_window=Kept(self.evidence_window.counts),
        )

    def slo(self, session: Session, settings: Settings, now: float) -> WindowFigures | None:
        """The SLO window's figures at ``now``, reading only what changed since the last tick if it can."""
        trust = _trust(settings)
        span = settings.slo.window_s

        def whole() -> tuple[SLOWindow, Select[Any]]:
            # no upper bound: a record stamped ahead of the clock waits in the window until it is due
            stmt = select(*SLO_COLUMNS).where(RequestRecord.proxy_in >= now - span)
            return SLOWindow(span, trust, settings.slo), stmt

        w, rows = self.slo_window.bring(
            session,
            now,
            self.whole_read_every_s,
            lambda w: w.matches(span, trust, settings.slo),
            lambda: select(*SLO_COLUMNS),
            whole,
            RequestRecord.stamp,
        )
        w.update(rows)
        w.slide(now)
        return w.figures()

    def prediction(self, limit: int) -> tuple[int, float | None] | None:
        """The TTFT predictor's fleet figures (measured, error median) over the window :meth:`slo` read
        last, its ``limit`` newest predicted records (``SLOWindow.prediction``); None before any read."""
        w = self.slo_window.rows
        return None if w is None else w.prediction(limit)

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
        window, truncated = rows.window(lo, now, terms, Costs.of(settings.tenants))
        return ReadTenants(window, truncated, limit)

    def _tenants(self, session: Session, settings: Settings, now: float, limit: int) -> TenantRows:
        """The tenants' rows, brought to ``now``: the changed records read in, the window slid. A whole
        read holds the window's records that ``trust`` believes (those ahead of ``now`` too: they wait in
        it until due)."""
        trust = _trust(settings)
        span = settings.slo.window_s
        lo = now - span

        def whole() -> tuple[TenantRows, Select[Any]]:
            stmt = select(*TENANT_ROW_COLUMNS).where(RequestRecord.proxy_in >= lo)
            return TenantRows(span, trust, limit), trusted_records(trust).apply(stmt)

        rows, changed = self.tenant_window.bring(
            session,
            now,
            self.whole_read_every_s,
            lambda rows: rows.matches(span, trust, limit, lo),
            lambda: select(*TENANT_ROW_COLUMNS),
            whole,
            RequestRecord.stamp,
        )
        rows.update(changed)
        rows.slide(lo)
        return rows

    def snapshots(self, session: Session, span: float, now: float) -> dict[str, list[Any]]:
        """The window's snapshot rows at ``now`` as ``store.queries.snapshot_window`` reads them over
        ``[now - span, now]`` (each with its ``id`` besides), reading only those stored since the last tick
        if it can: a whole read when the window would reach before what was let go (a longer span, a clock
        gone back).

        Both reads are bounded in time: from the window's start (a cursor whose mark an old transaction
        holds back brings rows long gone again), and up to the next whole read's time (a snapshot stamped
        further ahead of the clock is read by the whole read that is due before it is)."""
        since = now - span
        kept, every = self.snapshot_window, self.whole_read_every_s

        def changes() -> Select[Any]:
            until = (kept.whole_at or now) + every
            return select(*SNAPSHOT_ROW_COLUMNS).where(Snapshot.ts >= since, Snapshot.ts <= until)

        def whole() -> tuple[SnapshotRows, Select[Any]]:
            stmt = (
                select(*SNAPSHOT_ROW_COLUMNS)
                .where(Snapshot.ts >= since, Snapshot.ts <= now + every)
                .order_by(Snapshot.ts, Snapshot.id)  # held in this order: each row appended
            )
            return SnapshotRows(), stmt

        # a longer span, or a clock gone back, reaches before what it let go
        rows, changed = kept.bring(
            session, now, every, lambda rows: rows.since <= since, changes, whole, Snapshot.stamp
        )
        rows.update(changed)
        rows.slide(since)
        return rows.read(since, now)

    def evidence(self, session: Session, settings: Settings, since: float, now: float) -> EvidenceRows:
        """The evidence window's records over ``[since, now]`` and their charges, reading only the
        records stamped since the last tick if it can: a whole read on the occasions above, and when the
        window would reach before what it retired (a longer window) or end before what it charged (a clock
        gone back). A record that arrived ahead of the clock waits, not charged. Every changed record is
        read: one whose arrival moved out of the window leaves it."""
        trust = _trust(settings)

        def whole() -> tuple[EvidenceRows, Select[Any]]:
            stmt = select(*EVIDENCE_COLUMNS).where(RequestRecord.proxy_in >= since)
            return EvidenceRows(trust), trusted_records(trust).apply(stmt)

        rows, changed = self.evidence_window.bring(
            session,
            now,
            self.whole_read_every_s,
            lambda rows: rows.matches(trust, since, now),
            lambda: select(*EVIDENCE_COLUMNS),
            whole,
            RequestRecord.stamp,
        )
        rows.update(changed)
        rows.slide(since, now)
        return rows

    def read_counts(self) -> tuple[tuple[str, int, int], ...]:
        """Each kept window's reads: (window, whole, changes only)."""
        windows = (
            ("slo", self.slo_window),
            ("evidence", self.evidence_window),
            ("snapshots", self.snapshot_window),
            ("tenants", self.tenant_window),
        )
        return tuple((name, k.counts.whole, k.counts.changes) for name, k in windows)
