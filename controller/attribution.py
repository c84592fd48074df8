"""The SLO-miss attribution of a stored window: the range asked for, the records read, the pure attribution.

Shared by ``GET /v1/slo/attribution`` and ``pdscope explain``. A range is either ``since`` (a
duration back from now: ``90``, ``90s``, ``30m``, ``2h``, ``1d``) or ``from`` / ``until`` (Unix
seconds; ``until`` defaults to now); it spans at most :data:`MAX_RANGE_S`. A bad one raises
:class:`BadRange` naming the parameter. The records read are those the controller believes
(``controller.trusted_span_senders``, :func:`controller.observe.trusted_filter`), requests refused
as invalid (a 4xx other than 429, the client's fault) left out, at most ``limit`` of them: the
newest, the answer saying when older ones were left out (``truncated``). Of each record's
``attributes`` the collector's forensics wrote, it reads the D's NIXL figures over the handoff
(failed transfers, the mean transfer time), the D's its expired leases waited on, and its failed
attempts; a failed decode attempt is marked a transfer failure when its D's
``nixl_failed_transfers`` counter rose in a scrape step overlapping it. The attribution itself is
:func:`controller.policy.attribution.attribute` under the configured ``slo.*``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from controller.observe import trusted_filter
from controller.policy.alerts import AlertState
from controller.policy.attribution import Attempt, Attribution, StageRecord, attribute
from pdscope.config import Settings
from store import queries as q
from store.db import transaction
from store.models import RequestRecord

MAX_RANGE_S: Final = 7 * 86400.0
MAX_RECORDS: Final = 200_000
DEFAULT_RECORDS: Final = 50_000
FAILURE_SLACK_S: Final = 120.0  # a request's attempts may run this long past its proxy_in
_UNITS: Final = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")


class BadRange(ValueError):
    """A range parameter that is not valid: ``param`` names it."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"{param}: {reason}")
        self.param = param
        self.reason = reason


def parse_duration(text: str, param: str = "since") -> float:
    """Seconds of ``90``, ``90s``, ``30m``, ``2h``, ``1d``: more than 0, at most :data:`MAX_RANGE_S`."""
    m = _DURATION.match(text)
    if m is None:
        raise BadRange(param, f"{text[:40]!r} is not a duration (a number with s, m, h or d: 30m)")
    seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if not 0 < seconds <= MAX_RANGE_S:
        raise BadRange(param, f"must be more than 0 and at most {MAX_RANGE_S / 86400:.0f}d")
    return seconds


def resolve_range(
    now: float, *, since: str | None = None, from_: float | None = None, until: float | None = None
) -> tuple[float, float]:
    """The range (lo, hi) in Unix seconds: ``since`` back from ``now``, or ``from`` .. ``until``."""
    if since is not None and from_ is not None:
        raise BadRange("since", "give either since or from, not both")
    for name, v in (("from", from_), ("until", until)):
        if v is not None and not math.isfinite(v):
            raise BadRange(name, "must be a finite number of Unix seconds")
    hi = now if until is None else until
    if since is not None:
        lo = hi - parse_duration(since)
    elif from_ is not None:
        lo = from_
    else:
        raise BadRange("since", "give since (a duration such as 30m) or from (Unix seconds)")
    if lo >= hi:
        raise BadRange("from" if from_ is not None else "until", "the range must start before it ends")
    if hi - lo > MAX_RANGE_S:
        raise BadRange("from", f"the range spans at most {MAX_RANGE_S / 86400:.0f}d")
    return lo, hi


def _num(x: object) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) else None


def _nixl_d(attributes: Mapping[str, Any] | None) -> Mapping[str, Any]:
    nixl = (attributes or {}).get("nixl")
    d = nixl.get("d") if isinstance(nixl, dict) else None
    return d if isinstance(d, dict) else {}


def _transfer_failed(attributes: Mapping[str, Any] | None) -> bool:
    """A NIXL transfer failed on the D during this request's handoff (forensics' ``nixl`` join)."""
    n = _num(_nixl_d(attributes).get("nixl_failed_transfers"))
    return n is not None and n > 0


def _transfer_s(attributes: Mapping[str, Any] | None) -> float | None:
    """The D's mean NIXL transfer time over the scrape window of this request's handoff."""
    d = _nixl_d(attributes)
    n, total = _num(d.get("nixl_xfer_time_count")), _num(d.get("nixl_xfer_time_sum"))
    return total / n if n is not None and total is not None and n > 0 and total >= 0 else None


def _lease_ds(attributes: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The D's the record's expired leases were waiting on (forensics' ``lease_expiry``)."""
    entries = (attributes or {}).get("lease_expiry")
    if not isinstance(entries, list):
        return ()
    return tuple(
        sorted(
            {e["d_instance"] for e in entries if isinstance(e, dict) and isinstance(e.get("d_instance"), str)}
        )
    )


def _attempts(attributes: Mapping[str, Any] | None, failures: FailureSteps) -> tuple[Attempt, ...]:
    """The record's failed attempts (forensics' ``failed_attempts``), a decode attempt marked when its D
    counted NIXL failures while it ran."""
    raw = (attributes or {}).get("failed_attempts")
    out: list[Attempt] = []
    for a in raw if isinstance(raw, list) else []:
        if not isinstance(a, dict):
            continue
        stage, inst, kind = a.get("stage"), a.get("instance"), a.get("kind")
        start, end = _num(a.get("start")), _num(a.get("end"))
        if stage not in ("prefill", "decode") or not isinstance(inst, str) or start is None or end is None:
            continue
        p = a.get("p_instance")
        out.append(
            Attempt(
                stage,
                inst,
                kind if isinstance(kind, str) else "error",
                start,
                end,
                p if isinstance(p, str) else None,
                stage == "decode" and failures.rose(inst, start, end),
            )
        )
    return tuple(sorted(out, key=lambda x: x.start))


@dataclass(frozen=True)
class FailureSteps:
    """The steps of the D's ``nixl_failed_transfers`` counter: did a D count failures in a time span?"""

    steps: Mapping[str, tuple[tuple[float, float], ...]]

    def rose(self, instance: str, start: float, end: float) -> bool:
        """A step of ``instance`` overlaps [start, end] (one scrape interval either side, at most)."""
        return any(lo <= end and hi >= start for lo, hi in self.steps.get(instance, ()))


def failure_steps(session: Session, lo: float, hi: float) -> FailureSteps:
    out: dict[str, list[tuple[float, float]]] = {}
    for st in q.counter_steps(session, "nixl_failed_transfers", lo, hi, role="decode"):
        out.setdefault(st.instance, []).append((st.start_ts, st.end_ts))
    return FailureSteps({k: tuple(v) for k, v in out.items()})


def _handoff_failed(row: Any, failures: FailureSteps) -> bool:
    """The NIXL join says a transfer failed on the D during the handoff; or, a failed request's handoff
    not joined yet, its D's failure counter rose in a scrape step overlapping it."""
    if "nixl" in (row.attributes or {}):
        return _transfer_failed(row.attributes)
    end = row.first_token if row.first_token is not None else row.done
    return (
        row.status != "ok"
        and row.d_instance is not None
        and row.p_done is not None
        and end is not None
        and failures.rose(row.d_instance, row.p_done, end)
    )


def _stage_record(row: Any, failures: FailureSteps) -> StageRecord:
    return StageRecord(
        request_id=row.request_id,
        proxy_in=row.proxy_in,
        status=row.status,
        p_instance=row.p_instance,
        d_instance=row.d_instance,
        p_sent=row.p_sent,
        p_done=row.p_done,
        d_sent=row.d_sent,
        first_token=row.first_token,
        done=row.done,
        p_queue_s=row.p_queue_s,
        ttft_s=row.ttft_s,
        tpot_s=row.tpot_s,
        completion_tokens=row.completion_tokens,
        lease_expired=bool(row.lease_expiry_suspect),
        transfer_failed=_handoff_failed(row, failures),
        retries=row.retries or 0,
        lease_expired_ds=_lease_ds(row.attributes),
        attempts=_attempts(row.attributes, failures) if row.retries else (),
        transfer_s=_transfer_s(row.attributes),
        error=row.error if isinstance(row.error, str) else None,
    )


def read_records(
    session: Session, lo: float, hi: float, *, only: q.RecordFilter, limit: int
) -> tuple[list[StageRecord], bool]:
    """The newest ``limit`` records of the range, oldest first; True when older ones were left out."""
    r = RequestRecord
    stmt = only.apply(
        select(
            r.request_id,
            r.proxy_in,
            r.status,
            r.p_instance,
            r.d_instance,
            r.p_sent,
            r.p_done,
            r.d_sent,
            r.first_token,
            r.done,
            r.p_queue_s,
            r.ttft_s,
            r.tpot_s,
            r.completion_tokens,
            r.lease_expiry_suspect,
            r.attributes,
            r.retries,
            r.error,
        )
        .where(r.proxy_in >= lo, r.proxy_in <= hi)
        .order_by(r.proxy_in.desc(), r.id.desc())
        .limit(limit + 1)
    )
    rows = session.connection().execute(stmt).all()
    truncated = len(rows) > limit
    kept = rows[:limit]
    failures = FailureSteps({})
    marked = [x.proxy_in for x in kept if x.retries or x.status != "ok"]
    if marked:  # failed attempts and handoffs to mark: the D's failure counter around those requests
        failures = failure_steps(session, min(marked), max(marked) + FAILURE_SLACK_S)
    return [_stage_record(x, failures) for x in reversed(kept)], truncated


@dataclass(frozen=True)
class WindowAttribution:
    """The attribution of a stored range, and whether its oldest records were left out."""

    attribution: Attribution
    truncated: bool
    limit: int

    def as_dict(self, max_misses: int = 100) -> dict[str, Any]:
        return {
            **self.attribution.as_dict(max_misses),
            "truncated": self.truncated,
            "record_limit": self.limit,
        }


def window_attribution(
    factory: sessionmaker[Session], settings: Settings, lo: float, hi: float, *, limit: int = DEFAULT_RECORDS
) -> WindowAttribution:
    """Read the range's records (at most ``limit``) and attribute its misses under ``settings.slo``."""
    only = q.RecordFilter(trusted_filter(settings).senders, charged_only=True)
    with transaction(factory) as session:
        records, truncated = read_records(session, lo, hi, only=only, limit=limit)
    return WindowAttribution(attribute(records, settings.slo, since=lo, until=hi), truncated, limit)


def attribution_link(base_url: str, st: AlertState, window_s: float) -> dict[str, str]:
    """An alert's annotation pointing at why the SLO was missed around it (``attribution_url``):
    ``GET /v1/slo/attribution`` from one SLO window before the alert became active to when it
    resolved (while firing: to when it fired), a range that stays the same on every re-send."""
    lo = st.active_since - window_s
    hi = st.resolved_at or st.fired_at or st.last_eval
    hi = max(hi, lo + 1.0)
    return {"attribution_url": f"{base_url}/v1/slo/attribution?from={lo:.3f}&until={hi:.3f}"}
