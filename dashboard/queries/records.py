"""Window-wide reads over request records: a bounded sample of per-request figures, SLO
counts per time bucket, and handoff time per (P, D) pair.

Large windows are sampled by primary key (every k-th row) so a page never pulls more
than ``max_rows`` rows into Python; counts per bucket are always exact (SQL GROUP BY).
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
from sqlalchemy import Engine, Select, case, func, select
from sqlalchemy.sql.elements import ColumnElement

from dashboard.queries.common import Window, bucket_index, connect, fast_frame, frame
from pdscope.config import SLOSettings
from store.models import RequestRecord
from store.queries import EVERY_RECORD, RecordFilter, slo_met_clause

SAMPLE_COLUMNS = (
    "proxy_in",
    "status",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "prompt_tokens",
    "completion_tokens",
    "slo_met",
    "p_instance",
    "d_instance",
    "p_done",
    "first_token",
    "lease_expiry_suspect",
)


# what the Prefix cache page reads of each sampled record (dashboard.prefix)
PREFIX_COLUMNS = (
    "proxy_in",
    "status",
    "p_instance",
    "d_instance",
    "route_path",
    "prompt_tokens",
    "p_predicted_cached_tokens",
    "d_predicted_cached_tokens",
    "p_cached_tokens",
    "d_cached_tokens",
    "prefix_key",
    "prefix_tokens",
)


def _in_window(window: Window) -> tuple[ColumnElement[bool], ColumnElement[bool]]:
    return (RequestRecord.proxy_in >= window.start, RequestRecord.proxy_in < window.end)


def count(engine: Engine, window: Window, only: RecordFilter = EVERY_RECORD) -> int:
    """The records in the window that ``only`` keeps."""
    stmt = only.apply(select(func.count()).select_from(RequestRecord).where(*_in_window(window)))
    with connect(engine) as conn:
        return int(conn.execute(stmt).scalar() or 0)


# On PostgreSQL a window holding more requests than this is sampled without counting it row by
# row (see :func:`_id_span`); below it, and always on SQLite, the count is exact.
COUNTED_MAX_ROWS = 250_000
# How far into the window from each edge the id span is looked for (records written this late,
# relative to the others, would fall outside it).
EDGE_S = 300.0


def sample(
    engine: Engine,
    window: Window,
    max_rows: int = 20_000,
    slo: SLOSettings | None = None,
    columns: tuple[str, ...] = SAMPLE_COLUMNS,
    only: RecordFilter = EVERY_RECORD,
) -> tuple[pd.DataFrame, int]:
    """Per-request figures in the window, every k-th row (``id % k == 0``) when there are more
    than ``max_rows``, in arrival order.

    Returns the frame and k (1 = every row), so callers can scale counts back up. With ``slo``, the
    ``slo_met`` column is each record's verdict under it (a changed ``slo.*`` applies at once), else
    the verdict stored when the record was assembled. ``columns``: which (``SAMPLE_COLUMNS``, or
    ``PREFIX_COLUMNS`` for the Prefix cache page); the rows kept are the same for any. ``only``: the
    records read (``store.attribution.trusted_records``; default every one).
    """
    cols: list[Any] = [
        getattr(RequestRecord, c) if c != "slo_met" or slo is None else slo_met_clause(slo).label("slo_met")
        for c in columns
    ]
    span = _id_span(engine, window) if engine.dialect.name == "postgresql" and max_rows > 0 else None
    if span is not None:
        step, kept_ids = _span_ids(span, max_rows)
        stmt = only.apply(select(*cols).where(RequestRecord.id.in_(kept_ids), *_in_window(window)))
        return _sampled(engine, stmt), step
    total = count(engine, window, only)
    step = max(1, math.ceil(total / max_rows)) if max_rows > 0 else 1
    if step > 1:
        # The kept ids come from the window index alone (ix_request_records_window); only those
        # rows are then read whole, not every row of a million-row window.
        kept = select(RequestRecord.id).where(*_in_window(window), RequestRecord.id % step == 0)
        stmt = select(*cols).where(RequestRecord.id.in_(kept))
    else:
        stmt = select(*cols).where(*_in_window(window))
    return _sampled(engine, only.apply(stmt)), step


def _span_ids(span: tuple[int, int], max_rows: int) -> tuple[int, Select[Any]]:
    """k for an id span and a SELECT of its every-k-th ids (the multiples of k in it)."""
    lo, hi = span
    step = max(2, math.ceil((hi - lo + 1) / max(max_rows, 1)))
    first = -(-lo // step) * step
    return step, select(func.generate_series(first, hi, step))


def sampled_status_counts(
    engine: Engine, window: Window, max_rows: int = 5_000
) -> tuple[int, dict[str, int]] | None:
    """PostgreSQL, a window of more than ``COUNTED_MAX_ROWS`` requests: k and the requests per
    status among :func:`sample`'s every-k-th ids (multiply by k to estimate). None for a smaller
    window (count it)."""
    span = _id_span(engine, window)
    if span is None:
        return None
    step, kept_ids = _span_ids(span, max_rows)
    stmt = (
        select(RequestRecord.status, func.count())
        .where(RequestRecord.id.in_(kept_ids), *_in_window(window))
        .group_by(RequestRecord.status)
    )
    with connect(engine) as conn:
        return step, {str(s): int(n) for s, n in conn.execute(stmt)}


def _sampled(engine: Engine, stmt: Select[Any]) -> pd.DataFrame:
    stmt = stmt.order_by(RequestRecord.proxy_in, RequestRecord.id)
    return fast_frame(engine, stmt, ("slo_met", "lease_expiry_suspect"))


def _id_span(engine: Engine, window: Window) -> tuple[int, int] | None:
    """For a window of more than ``COUNTED_MAX_ROWS`` requests, the ids its records span: the
    smallest id of those arriving in the first ``EDGE_S`` of its data and the largest of the last (records get
    ids as they are written, in about arrival order). None for a window whose span is no wider
    (nothing is counted: the span is at least the window's count, give or take records written out
    of order at its edges). The sample is then every k-th id of the span that arrived in the window
    (its rows fetched by id, the rest of the window never read), k from the span's width: a day of
    ten million requests costs what 20,000 rows cost."""
    rr = RequestRecord
    with connect(engine) as conn:
        # the first and last arrivals in the window (the data may start or stop inside it)
        first, last = conn.execute(
            select(func.min(rr.proxy_in), func.max(rr.proxy_in)).where(*_in_window(window))
        ).one()
        if first is None or last is None:
            return None
        edge = min(EDGE_S, (last - first) / 2)
        # id + 0: read the edge's entries of the window index, not the primary key in id order
        # until one arrived in the edge (most of the table, for a range ending now)
        lo = conn.execute(
            select(func.min(rr.id + 0)).where(rr.proxy_in >= first, rr.proxy_in <= first + edge)
        ).scalar()
        hi = conn.execute(
            select(func.max(rr.id + 0)).where(rr.proxy_in >= last - edge, rr.proxy_in <= last)
        ).scalar()
    if lo is None or hi is None or hi - lo + 1 <= COUNTED_MAX_ROWS:
        return None
    return int(lo), int(hi)


def _verdicts(
    slo: SLOSettings | None,
) -> tuple[ColumnElement[bool], ColumnElement[bool], ColumnElement[bool]]:
    """Met every SLO, missed TTFT, missed TPOT: recomputed under ``slo``, else the stored verdicts."""
    if slo is None:
        return (
            RequestRecord.slo_met.is_(True),
            RequestRecord.slo_ttft_met.is_(False),
            RequestRecord.slo_tpot_met.is_(False),
        )
    return (
        slo_met_clause(slo),
        RequestRecord.ttft_s * 1000.0 > slo.ttft.target_ms,
        RequestRecord.tpot_s * 1000.0 > slo.tpot.target_ms,
    )


def slo_buckets(
    engine: Engine,
    window: Window,
    width_s: float,
    slo: SLOSettings | None = None,
    only: RecordFilter = EVERY_RECORD,
) -> pd.DataFrame:
    """Per time bucket: arrivals, completed (status ok), met every SLO, TTFT and TPOT misses.

    Columns: t (bucket start, Unix s), arrivals, completed, met, ttft_miss, tpot_miss,
    errors, rejected. With ``slo``, verdicts are recomputed under it; else the stored ones. ``only``:
    the records counted (default every one).
    """
    met, ttft_miss, tpot_miss = _verdicts(slo)
    b = bucket_index(engine, RequestRecord.__table__.c.proxy_in, window.start, width_s).label("b")

    def n_if(cond: ColumnElement[bool]) -> ColumnElement[Any]:
        return func.sum(case((cond, 1), else_=0))

    stmt = only.apply(
        select(
            b,
            func.count().label("arrivals"),
            n_if(RequestRecord.status == "ok").label("completed"),
            n_if(met).label("met"),
            n_if(ttft_miss).label("ttft_miss"),
            n_if(tpot_miss).label("tpot_miss"),
            n_if(RequestRecord.status.in_(("error", "timeout"))).label("errors"),
            n_if(RequestRecord.status == "rejected").label("rejected"),
        )
        .where(*_in_window(window))
        .group_by(b)
        .order_by(b)
    )
    df = frame(engine, stmt)
    if df.empty:
        return df
    df["t"] = window.start + df["b"].astype(float) * width_s
    for col in ("arrivals", "completed", "met", "ttft_miss", "tpot_miss", "errors", "rejected"):
        df[col] = df[col].fillna(0).astype(int)
    return df.drop(columns=["b"])


def pair_handoff(engine: Engine, window: Window) -> pd.DataFrame:
    """Handoff time (P done → D first token) per (P, D) pair: requests, mean and max in ms."""
    handoff = (RequestRecord.first_token - RequestRecord.p_done) * 1000.0
    stmt = (
        select(
            RequestRecord.p_instance,
            RequestRecord.d_instance,
            func.count().label("requests"),
            func.avg(handoff).label("mean_ms"),
            func.max(handoff).label("max_ms"),
            func.sum(case((RequestRecord.lease_expiry_suspect.is_(True), 1), else_=0)).label("lease_expiry"),
        )
        .where(
            *_in_window(window),
            RequestRecord.first_token.is_not(None),
            RequestRecord.p_done.is_not(None),
            RequestRecord.p_instance.is_not(None),
            RequestRecord.d_instance.is_not(None),
        )
        .group_by(RequestRecord.p_instance, RequestRecord.d_instance)
    )
    return frame(engine, stmt)
