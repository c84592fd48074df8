"""Where received spans go: the ``Sink`` seam and the store-backed sink.

``Sink.write(batch) -> WriteResult`` is the one method the receiver calls, from a worker
thread, with a batch of decoded spans. A sink reports failure in the result; it does
not raise into the receiver. ``retry`` says the store was unavailable (down, locked, unreachable):
the span writer keeps the batch in the spool and writes it again later (``collector.spool``);
otherwise ``failed`` spans were refused for their data and are counted as dropped.

``StoreSink`` inserts the spans, then (re)assembles the request record of every trace
the batch touched whose proxy root span is in the store: a record is created when the
root arrives and updated when vLLM's spans arrive later, in another export.

A bad item costs only itself: a trace whose record cannot be assembled is counted
(``WriteResult.assemble_errors``) and its spans are still stored; a batch the database
refuses for its data (not for being down) is retried one trace at a time, so only the
traces the database refuses are lost (``failed``).

The sink writes assembly's part of a record only (``collector.record``): a new row gets
forensics' part as it starts, an existing row keeps it. A span's events are stored in its
``attributes`` under ``EVENTS_KEY`` (name and time) and read back as ``SpanEvent`` values.

**A trace split over collectors** (several collectors on one PostgreSQL store, each taking any
span) still gets exactly one record, equal to the one assembled from all its spans at once,
whatever the split and the order. The merge is atomic in the database, not in one process's
memory: each batch's transaction first serialises itself with every other transaction that
touches one of its traces (``lock_traces``), and only then reads the spans stored by others:

- on PostgreSQL, one statement takes a transaction-scoped advisory lock per trace
  (``pg_advisory_xact_lock(TRACE_LOCK_CLASS, trace_lock_key(trace))``, the two-int form,
  whose key space never meets the one-bigint keys such as the controller's leader lock), in
  ascending key order so two batches never deadlock; under READ COMMITTED the read that
  follows sees every span the previous holder committed, and the locks go at commit;
- on SQLite, the transaction begins with ``BEGIN IMMEDIATE``: it holds the database's one
  write lock before it reads (Python's sqlite3 would otherwise begin only at the first
  INSERT, after the read).

Then, whichever transaction of a trace commits last has read all the others' spans, and its
record is the whole trace's. A record is found by its trace (``trace_id``) and read under a
row lock (``FOR UPDATE``: a forensics write that committed first is read, and kept); a request
id that a record of another trace already holds is left to that record (``ON CONFLICT DO
NOTHING``): a reused X-Request-Id keeps its first record. A span sent twice (an export
retried) is counted once.

``shared`` says whether other processes may write spans to this store (default: any store but
SQLite, where one collector runs). Alone, the sink reads stored spans only for traces it wrote
spans of (its last ``max_seen``) or that started before it did, which saves one query per
batch; shared, it reads them for every trace of the batch.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from sqlalchemy import ARRAY, Integer, RowMapping, bindparam, select, text
from sqlalchemy.exc import DataError, IntegrityError, ProgrammingError
from sqlalchemy.orm import Session, sessionmaker

from collector.assemble import assemble
from collector.bulk import RawJSON, insert_rows
from collector.otlp import SpanData, SpanEvent
from collector.record import AssembledRecord
from pdscope import semconv as sc
from pdscope.config import SLOSettings, TenantSettings
from store.db import StoreError, transaction
from store.models import RequestRecord, SpanRow

log = logging.getLogger(__name__)

# Core tables: a multi-row INSERT without the ORM's per-row bookkeeping.
_SPANS = SpanRow.metadata.tables["spans"]
_RECORDS = RequestRecord.metadata.tables["request_records"]
MAX_ATTR_CHARS = 2048  # one long prompt in an attribute must not bloat the store
_dumps = functools.partial(json.dumps, allow_nan=False, separators=(",", ":"))
EVENTS_KEY = "otel.events"  # where span events are kept in a stored span's attributes
_CHUNK = 500  # ids per IN (...) list


def _int32(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=4).digest(), "big", signed=True)


# The class of the trace locks, the first int of ``pg_advisory_xact_lock(int4, int4)``: a key
# space apart from the one-bigint keys (the controller's leader lock), and from other classes.
TRACE_LOCK_CLASS = _int32(b"pdscope.collector.trace")
# A collector that stops in the middle of a transaction (SIGSTOP, a stalled host) would hold its
# traces' locks, and so stall every other collector's batches of them, until its connection
# closed: PostgreSQL ends a session idle that long inside the transaction (its batch is lost).
LOCK_IDLE_S = 60.0
_LOCK_TRACES = text(
    "SELECT set_config('idle_in_transaction_session_timeout', :idle_ms, true), count(*) "
    "FROM (SELECT pg_advisory_xact_lock(:cls, k) FROM unnest(:keys) AS k) AS locked"
).bindparams(bindparam("keys", type_=ARRAY(Integer)))


def trace_lock_key(trace_id: str) -> int:
    """The trace's lock key: a stable 32-bit hash (two traces on one key only wait for each other)."""
    return _int32(trace_id.encode())


def lock_traces(session: Session, traces: Iterable[str], *, idle_s: float = LOCK_IDLE_S) -> None:
    """Serialise this transaction with every other one that locks one of ``traces``, until it ends.

    PostgreSQL: one advisory transaction lock per trace, taken in ascending key order in one
    statement, which also has the server end this session should it then sit idle in the
    transaction for ``idle_s`` (its locks go with it). SQLite: ``BEGIN IMMEDIATE`` (the write
    lock), so call it first in the transaction. Anything else: nothing (the read may then miss a
    concurrent writer's spans).
    """
    conn = session.connection()
    dialect = conn.dialect.name
    if dialect == "postgresql":
        keys = sorted({trace_lock_key(t) for t in traces})
        if keys:
            idle_ms = str(max(1, round(idle_s * 1000)))
            conn.execute(_LOCK_TRACES, {"cls": TRACE_LOCK_CLASS, "keys": keys, "idle_ms": idle_ms})
    elif dialect == "sqlite" and not conn.connection.dbapi_connection.in_transaction:  # type: ignore[union-attr]
        conn.exec_driver_sql("BEGIN IMMEDIATE")


@dataclass(frozen=True)
class WriteResult:
    written: int
    failed: int = 0
    records: int = 0
    error: str | None = None
    assemble_errors: int = 0
    # root attributes left out of records as invalid, by key: counted once, when the root is written
    attributes_dropped: tuple[tuple[str, int], ...] = ()
    # the store is down, locked or unreachable (not: refused the data): write the whole batch again
    # later (a span written twice is counted once); ``failed`` then says how many are not stored yet
    retry: bool = False


class Sink(Protocol):
    def write(self, batch: Sequence[SpanData]) -> WriteResult: ...


def _clip(value: Any) -> Any:
    if isinstance(value, str) and len(value) > MAX_ATTR_CHARS:
        return value[:MAX_ATTR_CHARS]
    if isinstance(value, float) and value != value:  # NaN: JSON in the store refuses it
        return None
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return None
    if isinstance(value, list):
        return [_clip(v) for v in value[:64]]
    if isinstance(value, dict):
        return {k: _clip(v) for k, v in list(value.items())[:64]}
    return value


def stored_events(events: Sequence[SpanEvent]) -> list[dict[str, Any]]:
    """Events as kept under ``EVENTS_KEY``: name and time (their attributes are not kept)."""
    return [{"name": e.name, "ts": e.ts} for e in events]


def read_events(attributes: Any) -> tuple[dict[str, Any], tuple[SpanEvent, ...]]:
    """A stored span's attributes without ``EVENTS_KEY``, and the events kept there.

    An entry without a string name or a finite time is left out.
    """
    attrs: dict[str, Any] = attributes if isinstance(attributes, dict) else {}
    if EVENTS_KEY not in attrs:
        return attrs, ()
    kept = attrs[EVENTS_KEY]
    events: list[SpanEvent] = []
    for ev in kept if isinstance(kept, list) else []:
        name, ts = (ev.get("name"), ev.get("ts")) if isinstance(ev, dict) else (None, None)
        if (
            isinstance(name, str)
            and isinstance(ts, int | float)
            and not isinstance(ts, bool)
            and math.isfinite(ts)
        ):
            events.append(SpanEvent(name, float(ts), {}))
    return {k: v for k, v in attrs.items() if k != EVENTS_KEY}, tuple(events)


def _attributes_json(span: SpanData) -> RawJSON:
    attrs: dict[str, Any] = span.attributes
    if span.events:
        attrs = {**attrs, EVENTS_KEY: stored_events(span.events)}
    try:
        text = orjson.dumps(attrs).decode()  # NaN and Infinity become null, as the store needs
    except orjson.JSONEncodeError:  # e.g. an integer past 64 bits
        text = ""
    if not text or len(text) > MAX_ATTR_CHARS:  # rare: clip each value, then serialise again
        text = _dumps({k: _clip(v) for k, v in attrs.items()})
    return RawJSON(text)


def span_row(span: SpanData, received: float) -> dict[str, Any]:
    return {
        "trace_id": span.trace_id,
        "span_id": span.span_id,
        "parent_span_id": span.parent_span_id,
        "name": span.name[:256],
        "service": span.service[:256] if span.service else None,
        "kind": span.kind,
        "start_ts": span.start_ts,
        "end_ts": span.end_ts,
        "status_code": span.status_code,
        "attributes": _attributes_json(span),
        "received_ts": received,
        "sender": span.sender,
    }


class StoreSink:
    """Spans into ``spans``; assembled records into ``request_records``.

    ``shared``: other processes may write spans to this store (None: any store but SQLite).
    """

    def __init__(
        self,
        factory: sessionmaker[Session],
        slo: SLOSettings,
        clock: Callable[[], float] | None = None,
        *,
        shared: bool | None = None,
        tenants: TenantSettings | None = None,
    ) -> None:
        self.factory = factory
        self.slo = slo
        self.tenants = tenants  # the ids a record's tenant may be (collector.tenant)
        self.clock = clock or time.time
        bind = factory.kw.get("bind")
        self.shared = shared if shared is not None else bind is None or bind.dialect.name != "sqlite"
        self.started_at = self.clock() - 60.0  # spans older than this may predate this sink
        self.max_seen = 200_000
        self.lock_idle_s = LOCK_IDLE_S  # PostgreSQL: see lock_traces
        self._seen: dict[str, None] = {}  # insertion-ordered: the oldest trace ids go first

    def write(self, batch: Sequence[SpanData]) -> WriteResult:
        if not batch:
            return WriteResult(0)
        try:
            result = self._write(batch)
        except Exception as exc:  # StoreError, or a value the driver cannot bind (OverflowError...)
            if not _refused_data(exc) or len({s.trace_id for s in batch}) < 2:
                log.warning("span batch of %d not stored yet (store unavailable): %r", len(batch), exc)
                return WriteResult(0, failed=len(batch), error=str(exc), retry=True)
            return self._write_each_trace(batch)
        self._remember(batch)
        return result

    def _write(self, batch: Sequence[SpanData]) -> WriteResult:
        """One transaction for the batch. Raises StoreError."""
        now = self.clock()
        with transaction(self.factory) as session:
            # First the traces' locks, then the spans other transactions stored (read before
            # the insert, so that this batch's spans are not read back).
            self._lock(session, {s.trace_id for s in batch})
            stored = self._stored_spans(session, self._may_have_stored(batch))
            insert_rows(session, _SPANS, [span_row(s, now) for s in batch])
            records, errors, dropped = self._assemble(session, batch, stored)
        return WriteResult(
            len(batch),
            records=records,
            assemble_errors=errors,
            attributes_dropped=tuple(sorted(dropped.items())),
        )

    def _lock(self, session: Session, traces: set[str]) -> None:
        lock_traces(session, traces, idle_s=self.lock_idle_s)

    def _write_each_trace(self, batch: Sequence[SpanData]) -> WriteResult:
        """The database refused the batch's data: find the traces it refuses, keep the rest."""
        traces: dict[str, list[SpanData]] = {}
        for s in batch:
            traces.setdefault(s.trace_id, []).append(s)
        written = failed = records = errors = 0
        dropped: Counter[str] = Counter()
        last_error: str | None = None
        down = False
        for spans in traces.values():
            try:
                r = self._write(spans)
            except Exception as exc:
                failed += len(spans)
                last_error = str(exc)
                if not _refused_data(exc):  # the store went down meanwhile: the batch goes again later
                    failed, down = len(batch) - written, True
                    break
                continue
            self._remember(spans)
            written += r.written
            records += r.records
            errors += r.assemble_errors
            dropped.update(dict(r.attributes_dropped))
        if failed:
            log.warning(
                "%d of %d spans refused by the store (one trace at a time): %s",
                failed,
                len(batch),
                last_error,
            )
        return WriteResult(
            written,
            failed=failed,
            records=records,
            error=last_error,
            assemble_errors=errors,
            attributes_dropped=tuple(sorted(dropped.items())),
            retry=down,
        )

    def _remember(self, batch: Sequence[SpanData]) -> None:
        if self.shared:  # not used: every batch reads the stored spans of all its traces
            return
        for s in batch:
            self._seen[s.trace_id] = None
        while len(self._seen) > self.max_seen:
            del self._seen[next(iter(self._seen))]

    def _may_have_stored(self, batch: Sequence[SpanData]) -> set[str]:
        """Traces of the batch that may have spans in the store already.

        Shared: every one (another collector may have stored any). Alone: a trace this sink
        wrote spans of (remembered for the last ``max_seen`` traces), or one whose spans started
        before this sink did (written by an earlier collector process). Everything else is new,
        which saves one query per batch in the common case.
        """
        if self.shared:
            return {s.trace_id for s in batch}
        horizon = self.started_at
        return {s.trace_id for s in batch if s.trace_id in self._seen or s.start_ts < horizon}

    def _stored_spans(self, session: Session, traces: set[str]) -> dict[str, list[SpanData]]:
        out: dict[str, list[SpanData]] = {}
        if not traces:
            return out
        ids = sorted(traces)
        for i in range(0, len(ids), _CHUNK):
            for row in session.execute(
                select(*_SPAN_COLUMNS).where(SpanRow.trace_id.in_(ids[i : i + _CHUNK]))
            ):
                out.setdefault(row.trace_id, []).append(_span_of(row._mapping))
        return out

    def _assemble(
        self, session: Session, batch: Sequence[SpanData], stored: dict[str, list[SpanData]]
    ) -> tuple[int, int, Counter[str]]:
        """(records created or updated, traces whose record could not be assembled, the invalid root
        attributes of the records whose root is in ``batch``: a root is written once, re-assembly
        with later spans does not count them again)."""
        spans: dict[str, dict[str, SpanData]] = {}  # trace -> span id -> span (a resent span once)
        for trace, old in stored.items():
            spans[trace] = {s.span_id: s for s in old}
        for s in batch:
            spans.setdefault(s.trace_id, {}).setdefault(s.span_id, s)
        assembled: list[AssembledRecord] = []
        errors = 0
        for by_id in spans.values():
            trace_spans = list(by_id.values())
            if not any(s.name == sc.SPAN_REQUEST for s in trace_spans):
                continue
            try:
                a = assemble(trace_spans, self.slo, self.tenants)
            except Exception as exc:  # a bug or a value assembly cannot take: this trace only
                errors += 1
                log.debug("record of trace %s not assembled: %r", trace_spans[0].trace_id, exc)
                continue
            if a is not None:
                assembled.append(a)
        new_roots = {s.trace_id for s in batch if s.name == sc.SPAN_REQUEST}
        dropped: Counter[str] = Counter()
        for a in assembled:
            if a.trace_id in new_roots:
                dropped.update(a.attributes.dropped)
        if not assembled:
            return 0, errors, dropped
        existing = self._records_of(session, sorted({a.trace_id for a in assembled if a.trace_id in stored}))
        new_rows: dict[str, dict[str, Any]] = {}
        for a in assembled:
            rec = existing.get(a.trace_id)
            if rec is not None:
                a.update(rec)
            else:  # one id in two traces of a batch: the first keeps it
                new_rows.setdefault(a.request_id, a.insert_row())
        if new_rows:
            # ON CONFLICT DO NOTHING: a reused X-Request-Id keeps its first record. In request id
            # order, so two transactions inserting the same ids wait for each other in one order.
            insert_rows(session, _RECORDS, [new_rows[k] for k in sorted(new_rows)], ignore_conflicts=True)
        return len(assembled), errors, dropped

    def _records_of(self, session: Session, traces: Sequence[str]) -> dict[str, RequestRecord]:
        """The stored records of ``traces`` (only traces with spans stored before can have one),
        locked for update (forensics may write the same rows)."""
        out: dict[str, RequestRecord] = {}
        for i in range(0, len(traces), _CHUNK):
            query = (
                select(RequestRecord)
                .where(RequestRecord.trace_id.in_(traces[i : i + _CHUNK]))
                .order_by(RequestRecord.id)
                .with_for_update()
            )
            for r in session.scalars(query):
                if r.trace_id is not None:
                    out.setdefault(r.trace_id, r)
        return out


# A stored span's columns, read back by name into a SpanData (its events out of its attributes).
_SPAN_COLUMNS = (
    SpanRow.trace_id,
    SpanRow.span_id,
    SpanRow.parent_span_id,
    SpanRow.name,
    SpanRow.service,
    SpanRow.kind,
    SpanRow.start_ts,
    SpanRow.end_ts,
    SpanRow.status_code,
    SpanRow.attributes,
    SpanRow.sender,
)


def _span_of(row: RowMapping) -> SpanData:
    attributes, events = read_events(row["attributes"])
    return SpanData(
        trace_id=row["trace_id"],
        span_id=row["span_id"],
        parent_span_id=row["parent_span_id"],
        name=row["name"],
        service=row["service"],
        kind=row["kind"],
        start_ts=row["start_ts"],
        end_ts=row["end_ts"],
        status_code=row["status_code"],
        attributes=attributes,
        events=events,
        sender=row["sender"],
    )


def _refused_data(exc: Exception) -> bool:
    """The database (or its driver) refused the values (not: is down, locked or unreachable)."""
    if not isinstance(exc, StoreError):
        return True
    return isinstance(exc.__cause__, DataError | IntegrityError | ProgrammingError)
