"""The reads decision regret needs, shared by the controller's endpoint and the dashboard.

Decision regret (``analysis.regret``) judges every cut the controller stored against
what followed it. These functions read what it judges from, each as plain tuples in the order of
the pure module's fact types (``DecisionFact``, ``RecordFact``, ``ScrapeFact``), so each caller
builds those with ``Fact(*row)`` and this module needs nothing above the store. Every read is
bounded (``limit``) and says when it was cut short (:class:`Rows`). None writes. :class:`Reader`
is the three over one session, as ``analysis.regret_window.judge_window`` reads them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from pdscope.config import SLOSettings
from pdscope.slo import slo_verdict
from store.models import Decision, RequestRecord, Snapshot
from store.queries import RecordFilter


@dataclass(frozen=True)
class Rows:
    """Rows read, oldest first; ``truncated``: more matched than ``limit`` (the newest were left out)."""

    rows: tuple[tuple[Any, ...], ...]
    truncated: bool


def _bounded(rows: Sequence[Any], limit: int) -> Rows:
    return Rows(tuple(tuple(r) for r in rows[:limit]), len(rows) > limit)


def decisions(session: Session, since: float, fields: Iterable[str], *, limit: int) -> Rows:
    """Every decision of ``fields`` from ``since`` on, oldest first (by time, then id):
    ``(ts, tick, subject_kind, subject, field, old_value, new_value, reason, leader_epoch)``."""
    d = Decision
    stmt = (
        select(
            d.ts,
            d.tick,
            d.subject_kind,
            d.subject,
            d.field,
            d.old_value,
            d.new_value,
            d.reason,
            d.leader_epoch,
        )
        .where(d.ts >= since, d.field.in_(sorted(set(fields))))
        .order_by(d.ts, d.id)
        .limit(limit + 1)
    )
    return _bounded(session.connection().execute(stmt).all(), limit)


def records(
    session: Session, lo: float, hi: float, slo: SLOSettings, *, only: RecordFilter, limit: int
) -> Rows:
    """The records that came in over ``[lo, hi]`` (``only`` those), oldest first: ``(proxy_in, status,
    p_instance, d_instance, p_sent, p_done, d_sent, first_token, met)``, ``met`` the verdict under ``slo``."""
    r = RequestRecord
    stmt = only.apply(
        select(
            r.proxy_in,
            r.status,
            r.p_instance,
            r.d_instance,
            r.p_sent,
            r.p_done,
            r.d_sent,
            r.first_token,
            r.ttft_s,
            r.tpot_s,
        )
        .where(r.proxy_in >= lo, r.proxy_in <= hi)
        .order_by(r.proxy_in, r.id)
        .limit(limit + 1)
    )
    rows = [
        (*row[:8], slo_verdict(row[1], row[8], row[9], slo).met)
        for row in session.connection().execute(stmt).all()
    ]
    return _bounded(rows, limit)


def scrapes(session: Session, instances: Iterable[str], lo: float, hi: float, *, limit: int) -> Rows:
    """The scrapes of ``instances`` over ``[lo, hi]``, oldest first: ``(instance, ts, up, kv usage)``."""
    names = sorted(set(instances))
    if not names:
        return Rows((), False)
    s = Snapshot
    stmt = (
        select(s.instance, s.ts, s.up, s.kv_cache_usage)
        .where(s.instance.in_(names), s.ts >= lo, s.ts <= hi)
        .order_by(s.ts, s.id)
        .limit(limit + 1)
    )
    return _bounded(session.connection().execute(stmt).all(), limit)


@dataclass(frozen=True)
class Reader:
    """The reads of one regret judgement over ``session``: records ``only`` those, met under ``slo``;
    each read bounded by its own limit."""

    session: Session
    slo: SLOSettings
    only: RecordFilter
    max_decisions: int
    max_records: int
    max_scrapes: int

    def decisions(self, since: float, fields: Iterable[str]) -> Rows:
        return decisions(self.session, since, fields, limit=self.max_decisions)

    def records(self, lo: float, hi: float) -> Rows:
        return records(self.session, lo, hi, self.slo, only=self.only, limit=self.max_records)

    def scrapes(self, instances: Iterable[str], lo: float, hi: float) -> Rows:
        return scrapes(self.session, instances, lo, hi, limit=self.max_scrapes)
