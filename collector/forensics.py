"""Join per-instance NIXL counters to the requests they concern, by evidence.

vLLM's NIXL metrics have no request or peer label, so the join is in time, and it is made
only with requests that could have caused the count. For every request whose handoff has
finished, this pass

- records the NIXL figures of its D (and P) over the scrape window covering the handoff
  (the last snapshot at or before ``p_done`` to the first at or after the handoff's end)
  in ``RequestRecord.attributes["nixl"]``: the transfer figures (time, bytes, failures) of the
  side that records them, ``transfers_on`` (``d``: D reads, pull mode; ``p``: P writes, push mode,
  from the record's ``handoff``), and ``per_request: false``, for they are an estimate: the
  instance's transfers over the window, which other requests' share (vLLM reports no transfer
  time, bytes or descriptors per request: no span, attribute or labelled metric carries them);
- keeps the failed attempts the record itself does not show (``attributes["failed_attempts"]``):
  a request the proxy retried keeps only its last P and D in the record, so a decode attempt
  that failed on another D (a timeout, ``stream_error``, ``no_done``, a 5xx) is read back from
  its trace's ``pdscope.prefill`` / ``pdscope.decode`` spans (instance, error kind, and for a
  decode attempt the P whose blocks it was to pull and when that P finished);
- joins every rise of P's ``vllm:nixl_num_kv_expired_reqs`` with the handoffs on *that P*
  that were still waiting when their lease could have run out: P done at least two thirds of
  ``lease_s`` before the rise (a D heartbeat may set a lease to two thirds of its length from
  then) and no first token before both that time and the rise's scrape step (no first token
  at all, a timeout, or one later than the lease). Each expired lease is assigned to one such
  handoff (first those D refused as the client's error -- a 4xx but 429: D never pulls them, so their
  lease must run out, and the controller charges nobody for them -- then those with no first token,
  then the oldest), which flags its record
  ``lease_expiry_suspect`` and names, in ``attributes["lease_expiry"]``, the D the handoff was
  sent to (for a retried attempt: the D of that attempt, not the record's last one) and the
  step (``to_ts``) the expiry was counted in. Expiries no waiting handoff explains stay
  unattributed (counted in the result; the controller shows them and charges no one). A
  handoff that finished within its lease is never flagged, however close in time.

The pass writes only forensics' part of a record (``collector.record``): the
``lease_expiry_suspect`` column and the ``nixl``, ``failed_attempts`` and ``lease_expiry`` keys
of its ``attributes``, through ``note_forensics`` and ``flag_lease_expiry``.

Assignments are only added, never moved: a pass counts the assignments already stored for a
step and assigns only the rest, so passes over overlapping windows agree. Runs in a worker
thread on the collector's cadence; idempotent over its window.
"""

from __future__ import annotations

import bisect
import logging
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from collector.record import flag_lease_expiry, forensics_part, note_forensics, store_forensics
from pdscope import semconv as sc
from store.models import RequestRecord, Snapshot, SpanRow
from store.queries import CounterStep, counter_steps, is_client_error

log = logging.getLogger(__name__)

# the transfer figures: on the side that records the transfers (D in pull mode, P in push mode)
_XFER_FIELDS = ("nixl_xfer_time_count", "nixl_xfer_time_sum", "nixl_bytes_sum", "nixl_failed_transfers")
_P_FIELDS = ("nixl_kv_expired_reqs", "nixl_failed_transfers", "nixl_notifications_after_expiry")
_PUSHED = (sc.HANDOFF_PUSH, sc.HANDOFF_PUSH_EARLY)

DEFAULT_LEASE_S = 30.0  # vLLM's kv_lease_duration default (controller.kv_lease_s)
# The earliest a lease can run out after P finished, as a share of its length: D heartbeats every
# lease/6 while it waits and each one sets the lease to 2/3 of its length from then.
EARLIEST_EXPIRY = 2.0 / 3.0
# Clocks of the proxy (records) and of P (scrapes), and a scrape's own duration.
SKEW_S = 1.0
# A handoff is looked for at most this many leases before the step its expiry was counted in.
LOOKBACK_LEASES = 3.0
# Decode attempts that hand the same blocks on to the next D (D never saw the request, or
# refused it up front): the next attempt decides whether the lease runs out.
PASSED_ON = frozenset({"connect", "status_503"})
MAX_ATTEMPTS_KEPT = 16
_IN_CHUNK = 500


@dataclass(frozen=True)
class ForensicsResult:
    linked: int
    suspects: int
    unattributed: int = 0  # lease expiries in the steps looked at that no waiting handoff explains
    attempts: int = 0  # records whose failed attempts were read back from their spans this pass


def handoff_end(rec: RequestRecord) -> float | None:
    return rec.first_token if rec.first_token is not None else rec.done


def overlaps(step: CounterStep, p_done: float, end: float | None) -> bool:
    """Does the handoff [p_done, end] overlap the counter step (start_ts, end_ts]?"""
    stop = end if end is not None else float("inf")
    return p_done <= step.end_ts and stop > step.start_ts


@dataclass
class Handoff:
    """One handoff of blocks from a P to a D: the record's own, or a failed attempt's."""

    rec: RequestRecord
    p_instance: str
    d_instance: str | None
    p_done: float
    first_token: float | None
    assigned: bool = False
    refused: bool = False  # D refused the request as the client's error: it never pulls, the lease runs out

    def waiting_at(self, ts: float) -> bool:
        return self.first_token is None or self.first_token > ts


def expiry_could_be(h: Handoff, step: CounterStep, lease_s: float) -> bool:
    """Could this handoff's lease have run out in ``step`` (start_ts, end_ts] with the handoff waiting?"""
    earliest = h.p_done + EARLIEST_EXPIRY * lease_s
    if earliest > step.end_ts + SKEW_S or h.p_done < step.start_ts - LOOKBACK_LEASES * lease_s:
        return False
    if h.first_token is not None and h.first_token <= earliest:
        # Its first token came before its lease could run out, both times on the proxy's clock: no skew
        # against P's scrapes applies. With the skew, a 3 s lease took every handoff over 1 s as a
        # suspect, and a healthy D that had taken a stuck D's load was charged its expiries.
        return False
    return h.waiting_at(max(earliest, step.start_ts) - SKEW_S)


class _Series:
    def __init__(self) -> None:
        self.ts: list[float] = []
        self.rows: list[dict[str, float | None]] = []

    def window(self, start: float, end: float) -> tuple[int, int] | None:
        i = bisect.bisect_right(self.ts, start) - 1
        j = bisect.bisect_left(self.ts, end)
        if i < 0 or j >= len(self.ts):
            return None
        return i, j


def _delta(series: _Series, i: int, j: int, fields: tuple[str, ...]) -> dict[str, Any]:
    a, b = series.rows[i], series.rows[j]
    out: dict[str, Any] = {"from_ts": series.ts[i], "to_ts": series.ts[j]}
    for f in fields:
        x, y = a.get(f), b.get(f)
        out[f] = None if x is None or y is None else (y - x if y >= x else y)
    return out


def _series(session: Session, instances: set[str], since: float, until: float) -> dict[str, _Series]:
    cols = sorted(set(_XFER_FIELDS) | set(_P_FIELDS))
    stmt = (
        select(Snapshot.instance, Snapshot.ts, *[getattr(Snapshot, c) for c in cols])
        .where(
            Snapshot.instance.in_(instances),
            Snapshot.ts >= since,
            Snapshot.ts <= until,
            Snapshot.up.is_(True),
        )
        .order_by(Snapshot.ts)
    )
    out: dict[str, _Series] = defaultdict(_Series)
    for row in session.execute(stmt):
        s = out[row[0]]
        s.ts.append(row[1])
        s.rows.append(dict(zip(cols, row[2:], strict=True)))
    return out


# -- failed attempts, from the spans ------------------------------------------------------------


@dataclass
class _Span:
    name: str
    start: float
    end: float
    instance: str | None
    error: str | None


def _span_of(name: str, start: float, end: float, attrs: Any) -> _Span:
    a = attrs if isinstance(attrs, dict) else {}
    inst = a.get(sc.INSTANCE)
    err = a.get(sc.ERROR_TYPE)
    return _Span(
        name,
        float(start),
        float(end),
        inst[:128] if isinstance(inst, str) and inst else None,
        err[:64] if isinstance(err, str) and err else None,
    )


def failed_attempts(spans: Sequence[_Span]) -> list[dict[str, Any]]:
    """The failed prefill/decode attempts of one trace, except the last of each stage (the record's own)."""
    prefills = sorted((s for s in spans if s.name == sc.SPAN_PREFILL), key=lambda s: s.start)
    decodes = sorted((s for s in spans if s.name == sc.SPAN_DECODE), key=lambda s: s.start)
    out: list[dict[str, Any]] = []
    for p in prefills[:-1]:
        if p.error is not None and p.instance is not None:
            out.append(
                {"stage": "prefill", "instance": p.instance, "kind": p.error, "start": p.start, "end": p.end}
            )
    for d in decodes[:-1]:
        if d.error is None or d.instance is None:
            continue
        before = [p for p in prefills if p.error is None and p.end <= d.start + 1e-3]
        src = before[-1] if before else None
        out.append(
            {
                "stage": "decode",
                "instance": d.instance,
                "kind": d.error,
                "start": d.start,
                "end": d.end,
                "p_instance": None if src is None else src.instance,
                "p_done": None if src is None else src.end,
            }
        )
    out.sort(key=lambda a: a["start"])
    return out[:MAX_ATTEMPTS_KEPT]


def _read_attempts(session: Session, records: Iterable[RequestRecord]) -> int:
    """Store ``attributes["failed_attempts"]`` on retried records that lack it; returns how many."""
    todo = {
        r.trace_id: r
        for r in records
        if r.retries and r.trace_id and "failed_attempts" not in (r.attributes or {})
    }
    if not todo:
        return 0
    by_trace: dict[str, list[_Span]] = defaultdict(list)
    ids = sorted(todo)
    for i in range(0, len(ids), _IN_CHUNK):
        stmt = select(
            SpanRow.trace_id, SpanRow.name, SpanRow.start_ts, SpanRow.end_ts, SpanRow.attributes
        ).where(
            SpanRow.trace_id.in_(ids[i : i + _IN_CHUNK]), SpanRow.name.in_((sc.SPAN_PREFILL, sc.SPAN_DECODE))
        )
        for trace_id, name, start, end, attrs in session.execute(stmt):
            by_trace[trace_id].append(_span_of(name, start, end, attrs))
    for trace_id, rec in todo.items():
        note_forensics(rec, "failed_attempts", failed_attempts(by_trace.get(trace_id, [])))
    return len(todo)


def handoffs_of(rec: RequestRecord) -> list[Handoff]:
    """The record's own handoff and those of its failed decode attempts that pinned a lease of their own."""
    out: list[Handoff] = []
    if rec.p_instance and rec.p_done is not None:
        refused = is_client_error(rec.status, rec.http_status)
        out.append(Handoff(rec, rec.p_instance, rec.d_instance, rec.p_done, rec.first_token, refused=refused))
    for a in (rec.attributes or {}).get("failed_attempts") or []:
        if (
            isinstance(a, dict)
            and a.get("stage") == "decode"
            and a.get("kind") not in PASSED_ON
            and isinstance(a.get("p_instance"), str)
            and isinstance(a.get("p_done"), int | float)
        ):
            out.append(Handoff(rec, a["p_instance"], a.get("instance"), float(a["p_done"]), None))
    return out


# -- the lease join ------------------------------------------------------------------------------


@dataclass
class _Join:
    suspects: set[int] = field(default_factory=set)
    unattributed: int = 0


def _stored_assignments(records: Iterable[RequestRecord]) -> dict[tuple[str, float], int]:
    done: dict[tuple[str, float], int] = defaultdict(int)
    for rec in records:
        for e in (rec.attributes or {}).get("lease_expiry") or []:
            if (
                isinstance(e, dict)
                and isinstance(e.get("p_instance"), str)
                and isinstance(e.get("to_ts"), int | float)
            ):
                done[(e["p_instance"], float(e["to_ts"]))] += 1
    return done


def join_expiries(
    steps: Sequence[CounterStep],
    handoffs: Sequence[Handoff],
    lease_s: float,
    stored: dict[tuple[str, float], int],
) -> _Join:
    """Assign each expired lease of ``steps`` to a handoff on that P still waiting when it could run out."""
    by_p: dict[str, list[Handoff]] = defaultdict(list)
    for h in handoffs:
        by_p[h.p_instance].append(h)
    taken = {(id(h.rec), h.p_done) for h in handoffs if _already(h)}
    out = _Join()
    for st in sorted(steps, key=lambda s: (s.instance, s.end_ts)):
        want = max(0, round(st.increase) - stored.get((st.instance, st.end_ts), 0))
        if want == 0:
            continue
        eligible = [
            h
            for h in by_p.get(st.instance, [])
            if (id(h.rec), h.p_done) not in taken and expiry_could_be(h, st, lease_s)
        ]
        # A handoff D refused is a certain expiry: it explains one before any handoff that may still be
        # pulled, so the D of a genuine handoff is not charged for the client's error.
        eligible.sort(key=lambda h: (not h.refused, h.first_token is not None, h.p_done))
        for h in eligible[:want]:
            taken.add((id(h.rec), h.p_done))
            flag_lease_expiry(
                h.rec,
                {
                    "p_instance": st.instance,
                    "d_instance": h.d_instance,
                    "p_done": h.p_done,
                    "from_ts": st.start_ts,
                    "to_ts": st.end_ts,
                },
            )
            out.suspects.add(id(h.rec))
        out.unattributed += max(0, want - len(eligible))
    return out


def _already(h: Handoff) -> bool:
    for e in (h.rec.attributes or {}).get("lease_expiry") or []:
        if (
            isinstance(e, dict)
            and isinstance(e.get("p_done"), int | float)
            and abs(float(e["p_done"]) - h.p_done) < 1e-6
        ):
            return True
    return False


def run_pass(
    session: Session, since: float, until: float, slack_s: float = 30.0, lease_s: float = DEFAULT_LEASE_S
) -> ForensicsResult:
    """Link and flag the records that arrived in [since, until]. Writes through ``session``.

    Expiry steps are looked at from ``since`` plus the lookback (``LOOKBACK_LEASES`` leases, at
    most half the window) on, so every handoff that could explain one is among the records read.
    """
    records = list(
        session.scalars(
            select(RequestRecord).where(
                RequestRecord.proxy_in >= since,
                RequestRecord.proxy_in <= until,
                RequestRecord.p_done.is_not(None),
            )
        )
    )
    if not records:
        return ForensicsResult(0, 0)
    # detached: what the pass notes is stored by store_forensics, merged with what assembly wrote since
    before = {r.id: forensics_part(r) for r in records}
    for r in records:
        session.expunge(r)
    attempts = _read_attempts(session, records)
    lo = min(r.p_done or r.proxy_in for r in records) - slack_s
    hi = until + slack_s
    first_step = since + min(LOOKBACK_LEASES * lease_s, (until - since) / 2.0)
    steps = [
        st
        for st in counter_steps(session, "nixl_kv_expired_reqs", first_step, hi, role="prefill")
        if st.start_ts >= first_step
    ]
    handoffs = [h for r in records for h in handoffs_of(r)]
    join = join_expiries(steps, handoffs, lease_s, _stored_assignments(records))
    instances = {r.p_instance for r in records if r.p_instance} | {
        r.d_instance for r in records if r.d_instance
    }
    linked = _link_nixl(records, _series(session, instances, lo, hi))
    suspects = sum(1 for r in records if r.lease_expiry_suspect)
    store_forensics(session, records, before)
    if join.suspects or join.unattributed:
        log.info(
            "lease-expiry forensics: %d newly attributed requests, %d expiries unattributed in [%.0f, %.0f]",
            len(join.suspects),
            join.unattributed,
            since,
            until,
        )
    return ForensicsResult(linked, suspects, join.unattributed, attempts)


def _link_nixl(records: Iterable[RequestRecord], series: dict[str, _Series]) -> int:
    """Note on each record not yet linked the NIXL counters' moves over its handoff, on D (and P when
    its series covers it); returns how many records were linked (those with D's)."""
    linked = 0
    for rec in records:
        p_done = rec.p_done
        end = handoff_end(rec)
        if p_done is None or "nixl" in (rec.attributes or {}) or end is None:
            continue
        on = "p" if rec.handoff in _PUSHED else "d"
        nixl: dict[str, Any] = {}
        for side, inst, fields in _nixl_sides(rec, on):
            ser = series.get(inst or "")
            win = ser.window(p_done, end) if ser else None
            if ser is not None and win is not None:
                nixl[side] = {"instance": inst, **_delta(ser, win[0], win[1], fields)}
        if on in nixl:
            note_forensics(rec, "nixl", {**nixl, "transfers_on": on, "per_request": False})
            linked += 1
    return linked


def _nixl_sides(rec: RequestRecord, on: str) -> tuple[tuple[str, str | None, tuple[str, ...]], ...]:
    """Each side's instance and the counters read of it: the transfer figures where they are recorded
    (``on``: D reads in pull mode, P writes in push mode); on P its lease figures too; on D in push
    mode its failed registrations (``nixl_failed_transfers``)."""
    d_fields = _XFER_FIELDS if on == "d" else ("nixl_failed_transfers",)
    p_fields = _P_FIELDS if on == "d" else tuple(dict.fromkeys(_XFER_FIELDS + _P_FIELDS))
    return (("d", rec.d_instance, d_fields), ("p", rec.p_instance, p_fields))
