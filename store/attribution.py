"""What SLO-miss attribution reads of the store: the records of a range (the columns
:data:`STAGE_COLUMNS`) and, for the failed or retried ones, the steps of the D's
``nixl_failed_transfers`` counter around them. One read for the controller's API and CLI
(``controller.attribution``) and the dashboard's *Why we missed* page; the rows become stage records
in ``analysis.attribution_records``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

from sqlalchemy import Connection, select

from pdscope.config import Settings
from store import queries as q
from store.models import RequestRecord

FAILURE_SLACK_S: Final = 120.0  # a request's attempts may run this long past its proxy_in

_R = RequestRecord
STAGE_COLUMNS: Final = (
    _R.request_id,
    _R.proxy_in,
    _R.status,
    _R.p_instance,
    _R.d_instance,
    _R.p_sent,
    _R.p_done,
    _R.d_sent,
    _R.first_token,
    _R.done,
    _R.p_queue_s,
    _R.ttft_s,
    _R.tpot_s,
    _R.completion_tokens,
    _R.lease_expiry_suspect,
    _R.attributes,
    _R.retries,
    _R.error,
)


def trusted_senders(settings: Settings) -> tuple[str, ...] | None:
    """``controller.trusted_span_senders`` as a sorted tuple (hashable: a cache key); None: every sender."""
    senders = settings.controller.trusted_span_senders
    return None if senders is None else tuple(sorted(senders))


def trusted_records(senders: Iterable[str] | None, *, charged_only: bool = False) -> q.RecordFilter:
    """The request records a reader believes: those whose ``sender`` (the OTLP token name of the proxy
    root span) is one of ``senders`` (None: every record; a record without a sender never matches a
    list), and with ``charged_only`` none refused as invalid. The one rule for the controller's
    observation and attribution and the dashboard's SLO and *Why we missed* pages."""
    return q.RecordFilter(None if senders is None else frozenset(senders), charged_only=charged_only)


def failure_spans(conn: Connection, lo: float, hi: float) -> dict[str, tuple[tuple[float, float], ...]]:
    """Each D's scrape spans in which its ``nixl_failed_transfers`` counter rose."""
    out: dict[str, list[tuple[float, float]]] = {}
    for st in q.counter_steps(conn, "nixl_failed_transfers", lo, hi, role="decode"):  # type: ignore[arg-type]
        out.setdefault(st.instance, []).append((st.start_ts, st.end_ts))
    return {k: tuple(v) for k, v in out.items()}


def read_stage_rows(
    conn: Connection, lo: float, hi: float, *, only: q.RecordFilter, limit: int
) -> tuple[list[Any], Mapping[str, tuple[tuple[float, float], ...]], bool]:
    """``(rows oldest first, failure spans, truncated)``: the newest ``limit`` records of the range
    (True when older ones were left out) and the D failure spans around the failed or retried ones."""
    stmt = only.apply(
        select(*STAGE_COLUMNS)
        .where(_R.proxy_in >= lo, _R.proxy_in <= hi)
        .order_by(_R.proxy_in.desc(), _R.id.desc())
        .limit(limit + 1)
    )
    rows = conn.execute(stmt).all()
    truncated = len(rows) > limit
    kept = rows[:limit]
    marked = [x.proxy_in for x in kept if x.retries or x.status != "ok"]
    spans = failure_spans(conn, min(marked), max(marked) + FAILURE_SLACK_S) if marked else {}
    return list(reversed(kept)), spans, truncated
