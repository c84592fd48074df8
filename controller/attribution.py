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
:func:`analysis.attribution.attribute` under the configured ``slo.*``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy.orm import Session, sessionmaker

from analysis.attribution import Attribution, StageRecord, attribute
from analysis.attribution_records import FailureSteps, stage_record
from analysis.prediction import ErrorFigures, PredictionFacts, measure
from controller.observe import trusted_filter
from controller.policy.alerts import AlertState
from pdscope.config import Settings
from store import queries as q
from store.attribution import read_stage_rows
from store.db import transaction
from store.prediction import prediction_rows

MAX_RANGE_S: Final = 7 * 86400.0
MAX_RECORDS: Final = 200_000
DEFAULT_RECORDS: Final = 50_000
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


def read_records(
    session: Session, lo: float, hi: float, *, only: q.RecordFilter, limit: int
) -> tuple[list[StageRecord], bool]:
    """The newest ``limit`` records of the range, oldest first; True when older ones were left out."""
    rows, spans, truncated = read_stage_rows(session.connection(), lo, hi, only=only, limit=limit)
    failures = FailureSteps(spans)
    return [stage_record(x, failures) for x in rows], truncated


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


def window_prediction(
    factory: sessionmaker[Session], settings: Settings, lo: float, hi: float, *, limit: int = DEFAULT_RECORDS
) -> ErrorFigures:
    """The proxy's TTFT predictions over the same records as :func:`window_attribution` (at most ``limit``,
    the newest): how far off they were, and which TTFT misses were mispredicted (``analysis.prediction``)."""
    only = q.RecordFilter(trusted_filter(settings).senders, charged_only=True)
    with transaction(factory) as session:
        rows = prediction_rows(session, lo, hi, only=only, limit=limit).rows
    return measure(PredictionFacts(*r) for r in rows).fleet


def attribution_link(base_url: str, st: AlertState, window_s: float) -> dict[str, str]:
    """An alert's annotation pointing at why the SLO was missed around it (``attribution_url``):
    ``GET /v1/slo/attribution`` from one SLO window before the alert became active to when it
    resolved (while firing: to when it fired), a range that stays the same on every re-send."""
    lo = st.active_since - window_s
    hi = st.resolved_at or st.fired_at or st.last_eval
    hi = max(hi, lo + 1.0)
    return {"attribution_url": f"{base_url}/v1/slo/attribution?from={lo:.3f}&until={hi:.3f}"}
