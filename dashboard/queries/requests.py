"""Request-record reads: search (newest first, bounded), one request by id, the NIXL
figures of a decode instance around a moment, and lease-expiry suspects.

Searches always carry the window and a LIMIT and order by ``proxy_in``, so SQLite
and PostgreSQL walk ``ix_request_records_*_ts`` backwards and stop early.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd
from sqlalchemy import Engine, func, or_, select, text

from dashboard.queries import records
from dashboard.queries.common import Window, connect, frame, loose_index_scan
from store.families import NIXL_COLUMNS as NIXL_FAMILY_COLUMNS
from store.models import RequestRecord, Snapshot

LIST_COLUMNS = (
    "request_id",
    "proxy_in",
    "status",
    "http_status",
    "p_instance",
    "d_instance",
    "prompt_tokens",
    "completion_tokens",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "slo_met",
    "lease_expiry_suspect",
    "retries",
    "route_path",
)

NIXL_COLUMNS = (
    "ts",
    "up",
    "kv_cache_usage",
    "num_running",
    "num_waiting",
    "kv_fetch_in_progress",
    *NIXL_FAMILY_COLUMNS,
)


@dataclass(frozen=True)
class RequestFilter:
    """What the SRE typed: all fields optional; empty means "any"."""

    request_id: str = ""
    status: str = ""
    instance: str = ""
    slo_miss: bool = False
    lease_expiry: bool = False
    limit: int = 200


def search(engine: Engine, window: Window, flt: RequestFilter) -> pd.DataFrame:
    """Matching requests, newest first, at most ``flt.limit``.

    A request id (or its prefix) searches the whole store, not only the window.
    """
    cols = [getattr(RequestRecord, c) for c in LIST_COLUMNS]
    stmt = select(*cols)
    if flt.request_id:
        stmt = stmt.where(
            or_(
                RequestRecord.request_id == flt.request_id,
                RequestRecord.trace_id == flt.request_id,
                RequestRecord.request_id.startswith(flt.request_id, autoescape=True),
            )
        )
    else:
        stmt = stmt.where(RequestRecord.proxy_in >= window.start, RequestRecord.proxy_in < window.end)
    if flt.status:
        stmt = stmt.where(RequestRecord.status == flt.status)
    if flt.instance:
        stmt = stmt.where(
            or_(RequestRecord.p_instance == flt.instance, RequestRecord.d_instance == flt.instance)
        )
    if flt.slo_miss:
        stmt = stmt.where(RequestRecord.slo_met.is_(False))
    if flt.lease_expiry:
        stmt = stmt.where(RequestRecord.lease_expiry_suspect.is_(True))
    stmt = stmt.order_by(RequestRecord.proxy_in.desc()).limit(flt.limit)
    return frame(engine, stmt)


# PostgreSQL: the statuses present (a loose index scan: one probe per status), then each one's
# count in the window from ix_request_records_status_ts alone, counting at most :bound entries.
_STATUS_COUNTS_SQL = (
    loose_index_scan("statuses", "v", "request_records", "status")
    + """SELECT status, requests FROM (
    SELECT v AS status, (
        SELECT count(*) FROM (
            SELECT 1 FROM request_records
            WHERE status = statuses.v AND proxy_in >= :start AND proxy_in < :end
            LIMIT :bound
        ) AS found
    ) AS requests
    FROM statuses WHERE statuses.v IS NOT NULL AND statuses.v <> ALL(CAST(:skip AS text[]))
) AS counted
WHERE requests > 0
"""
)


def status_counts(engine: Engine, window: Window) -> pd.DataFrame:
    """Requests per status in the window (for the filter and a summary), most first; ``estimated``
    says which counts are not exact.

    Exact on SQLite. On PostgreSQL each status is counted from its index up to
    ``records.COUNTED_MAX_ROWS``; a status with more requests than that in the window (a long range
    of a large fleet) is estimated from the window's every-k-th-id sample (``records.sample``'s)."""
    if engine.dialect.name != "postgresql":
        stmt = (
            select(RequestRecord.status, func.count().label("requests"))
            .where(RequestRecord.proxy_in >= window.start, RequestRecord.proxy_in < window.end)
            .group_by(RequestRecord.status)
            .order_by(func.count().desc())
        )
        return frame(engine, stmt).assign(estimated=False)
    bound = records.COUNTED_MAX_ROWS
    # A large window's sample first: a status it puts over the bound is not counted at all.
    sampled = records.sampled_status_counts(engine, window)
    step, seen = sampled if sampled is not None else (1, {})
    sure = tuple(s for s, n in seen.items() if step * n > bound)
    sql = text(_STATUS_COUNTS_SQL).bindparams(
        start=window.start, end=window.end, bound=bound + 1, skip=list(sure)
    )
    df = frame(engine, sql).assign(estimated=False)
    if sure:
        guessed = pd.DataFrame({"status": list(sure), "requests": [step * seen[s] for s in sure]})
        df = pd.concat([df, guessed.assign(estimated=True)], ignore_index=True)
    # counted past the bound: estimated from the sample when there is one, else counted in full
    over = (df["requests"] > bound) & ~df["estimated"].astype(bool) if not df.empty else None
    if over is not None and over.any():
        for i in df.index[over]:
            status = str(df.at[i, "status"])
            if sampled is not None:
                df.at[i, "requests"], df.at[i, "estimated"] = step * seen.get(status, 0), True
            else:
                df.at[i, "requests"] = _count_status(engine, window, status)
    if df.empty:
        return df
    df["requests"] = df["requests"].astype(int)
    return df.sort_values("requests", ascending=False, kind="stable").reset_index(drop=True)


def _count_status(engine: Engine, window: Window, status: str) -> int:
    stmt = select(func.count()).where(
        RequestRecord.status == status,
        RequestRecord.proxy_in >= window.start,
        RequestRecord.proxy_in < window.end,
    )
    with connect(engine) as conn:
        return int(conn.execute(stmt).scalar() or 0)


def get_request(engine: Engine, request_id: str) -> dict[str, Any] | None:
    """Every column of one request record, or None."""
    with connect(engine) as conn:
        table = RequestRecord.__table__
        row = conn.execute(select(table).where(table.c.request_id == request_id)).first()
    return None if row is None else dict(row._mapping)


def nixl_around(engine: Engine, instance: str, start: float, end: float, pad_s: float = 30.0) -> pd.DataFrame:
    """The instance's snapshots from ``pad_s`` before ``start`` to ``pad_s`` after ``end``."""
    cols = [getattr(Snapshot, c) for c in NIXL_COLUMNS]
    stmt = (
        select(*cols)
        .where(Snapshot.instance == instance, Snapshot.ts >= start - pad_s, Snapshot.ts <= end + pad_s)
        .order_by(Snapshot.ts)
    )
    return frame(engine, stmt)


def lease_expiry_suspects(engine: Engine, window: Window, limit: int = 50) -> pd.DataFrame:
    """Requests the collector flagged as likely KV-lease expiries, newest first."""
    return search(engine, window, RequestFilter(lease_expiry=True, limit=limit))
