"""Join per-instance NIXL counters to the requests they concern.

vLLM's NIXL metrics have no request or peer label, so the only join is in time: a
request's handoff runs from P done (``p_done``) to D's first token (``first_token``, or
``done`` when it never came). For every request whose handoff has finished, this pass

- records the NIXL figures of its D (and P) over the scrape window covering the handoff
  (the last snapshot at or before ``p_done`` to the first at or after the handoff's end)
  in ``RequestRecord.attributes["nixl"]``;
- flags ``lease_expiry_suspect`` when P's ``vllm:nixl_num_kv_expired_reqs`` rose in a
  scrape step that overlaps the handoff (a D may answer 200 after reading blocks whose
  lease had already expired, so the HTTP status alone does not show it).

Runs in a worker thread on the collector's cadence; idempotent over its window.
"""

from __future__ import annotations

import bisect
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from store.models import RequestRecord, Snapshot
from store.queries import CounterStep, counter_steps

log = logging.getLogger(__name__)

_D_FIELDS = ("nixl_xfer_time_count", "nixl_xfer_time_sum", "nixl_bytes_sum", "nixl_failed_transfers")
_P_FIELDS = ("nixl_kv_expired_reqs", "nixl_failed_transfers", "nixl_notifications_after_expiry")


@dataclass(frozen=True)
class ForensicsResult:
    linked: int
    suspects: int


def handoff_end(rec: RequestRecord) -> float | None:
    return rec.first_token if rec.first_token is not None else rec.done


def overlaps(step: CounterStep, p_done: float, end: float | None) -> bool:
    """Does the handoff [p_done, end] overlap the counter step (start_ts, end_ts]?"""
    stop = end if end is not None else float("inf")
    return p_done <= step.end_ts and stop > step.start_ts


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
    cols = sorted(set(_D_FIELDS) | set(_P_FIELDS))
    stmt = (
        select(Snapshot.instance, Snapshot.ts, *[getattr(Snapshot, c) for c in cols])
        .where(Snapshot.instance.in_(instances), Snapshot.ts >= since, Snapshot.ts <= until, Snapshot.up.is_(True))
        .order_by(Snapshot.ts)
    )
    out: dict[str, _Series] = defaultdict(_Series)
    for row in session.execute(stmt):
        s = out[row[0]]
        s.ts.append(row[1])
        s.rows.append(dict(zip(cols, row[2:], strict=True)))
    return out


def run_pass(session: Session, since: float, until: float, slack_s: float = 30.0) -> ForensicsResult:
    """Link and flag the records that arrived in [since, until]. Writes through ``session``."""
    records = list(
        session.scalars(
            select(RequestRecord).where(
                RequestRecord.proxy_in >= since, RequestRecord.proxy_in <= until, RequestRecord.p_done.is_not(None)
            )
        )
    )
    if not records:
        return ForensicsResult(0, 0)
    lo = min(r.p_done or r.proxy_in for r in records) - slack_s
    hi = until + slack_s
    steps: dict[str, list[CounterStep]] = defaultdict(list)
    for st in counter_steps(session, "nixl_kv_expired_reqs", lo, hi):
        steps[st.instance].append(st)
    instances = {r.p_instance for r in records if r.p_instance} | {r.d_instance for r in records if r.d_instance}
    series = _series(session, instances, lo, hi)
    linked = suspects = 0
    for rec in records:
        p_done = rec.p_done
        if p_done is None:
            continue
        end = handoff_end(rec)
        hits = [s for s in steps.get(rec.p_instance or "", []) if overlaps(s, p_done, end)]
        attrs = dict(rec.attributes or {})
        changed = False
        # Re-checked on every pass: the span sink may have rewritten the attributes meanwhile.
        if hits and (not rec.lease_expiry_suspect or "lease_expiry" not in attrs):
            rec.lease_expiry_suspect = True
            attrs["lease_expiry"] = [
                {"p_instance": s.instance, "from_ts": s.start_ts, "to_ts": s.end_ts, "expired": s.increase} for s in hits
            ]
            changed = True
        if hits:
            suspects += 1
        if "nixl" not in attrs and end is not None:
            nixl: dict[str, Any] = {}
            for side, inst, fields in (("d", rec.d_instance, _D_FIELDS), ("p", rec.p_instance, _P_FIELDS)):
                ser = series.get(inst or "")
                win = ser.window(p_done, end) if ser else None
                if ser is not None and win is not None:
                    nixl[side] = {"instance": inst, **_delta(ser, win[0], win[1], fields)}
            if "d" in nixl:
                attrs["nixl"] = nixl
                linked += 1
                changed = True
        if changed:
            rec.attributes = attrs
    if suspects:
        log.info("lease-expiry forensics: %d suspect requests in [%.0f, %.0f]", suspects, since, until)
    return ForensicsResult(linked, suspects)
