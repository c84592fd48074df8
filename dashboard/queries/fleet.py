"""Fleet-level reads: instances, snapshots over a window, the latest snapshot and the
histogram edges per instance, and what the controller last set (weights, limits,
overrides). Every query is bounded by the window and served by an index on ``ts``
or ``(instance, ts)``.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
from sqlalchemy import Engine, and_, func, or_, select

from dashboard.queries.common import Window, connect, fast_frame, frame, loose_index_scan
from store.families import NIXL_COLUMNS as NIXL_FAMILY_COLUMNS
from store.models import Decision, InstanceRow, Snapshot, WeightOverride

# Columns the pages plot or difference; histograms are fetched only at the window edges.
SERIES_COLUMNS = (
    "ts",
    "instance",
    "pool",
    "role",
    "up",
    "kv_cache_usage",
    "num_running",
    "num_waiting",
    "kv_fetch_in_progress",
    "kv_fetch_waiting_to_start",
    "prompt_tokens",
    "generation_tokens",
    "ttft_sum",
    "ttft_count",
    "itl_sum",
    "itl_count",
    *NIXL_FAMILY_COLUMNS,
    "requests_stop",
    "requests_length",
    "requests_abort",
    "requests_error",
)

# Decision fields the controller writes (see controller/): per instance and per pool.
WEIGHT_FIELD = "weight"
LIMIT_FIELDS = ("max_inflight_requests", "max_inflight_kv_bytes", "max_queue_wait_s")


def instances(engine: Engine) -> pd.DataFrame:
    """Every instance the collector has seen (name, pool, role, url, last_seen)."""
    stmt = select(
        InstanceRow.name, InstanceRow.pool, InstanceRow.role, InstanceRow.url, InstanceRow.last_seen
    ).order_by(InstanceRow.role.desc(), InstanceRow.name)
    return frame(engine, stmt)


def snapshot_series(
    engine: Engine, window: Window, columns: tuple[str, ...] = SERIES_COLUMNS, max_points: int = 360
) -> pd.DataFrame:
    """Snapshots in the window, oldest first, with the named columns; at most about
    ``max_points`` per instance: a long range keeps every k-th scrape of each instance,
    always including its newest. Counter differences stay exact between kept scrapes
    (only a restart between two kept scrapes loses the counts before it).
    """
    in_window = (Snapshot.ts >= window.start, Snapshot.ts < window.end)
    with connect(engine) as conn:
        rows = conn.execute(select(func.count()).select_from(Snapshot).where(*in_window)).scalar() or 0
        n_inst = conn.execute(select(func.count()).select_from(InstanceRow)).scalar() or 0
        if not n_inst and rows:
            n_inst = (
                conn.execute(select(func.count(func.distinct(Snapshot.instance))).where(*in_window)).scalar()
                or 1
            )
    step = max(1, math.ceil(rows / max(n_inst, 1) / max(max_points, 1)))
    cols = [getattr(Snapshot, c) for c in columns]
    if step == 1:
        return fast_frame(engine, select(*cols).where(*in_window).order_by(Snapshot.ts), ("up",))
    if engine.dialect.name == "postgresql":
        return _series_by_slices(engine, window, columns, max_points)
    rn = func.row_number().over(partition_by=Snapshot.instance, order_by=Snapshot.ts.desc()).label("rn")
    inner = select(*cols, rn).where(*in_window).subquery()
    stmt = select(*[inner.c[c] for c in columns]).where((inner.c.rn - 1) % step == 0).order_by(inner.c.ts)
    return fast_frame(engine, stmt, ("up",))


# PostgreSQL: the instances present (a loose index scan: one probe per name, not per row), then per
# instance and slice of the window the newest scrape in it (one backward index probe each), then
# only those rows read whole.
_SLICES_SQL = (
    loose_index_scan("names", "n", "snapshots", "instance")
    + """SELECT {columns} FROM snapshots s WHERE s.id IN (
    SELECT k.id FROM names CROSS JOIN generate_series(0, %(points)s - 1) AS j
    CROSS JOIN LATERAL (
        SELECT id FROM snapshots
        WHERE instance = names.n
          AND ts >= greatest(%(start)s, %(end)s - (j + 1) * %(width)s) AND ts < %(end)s - j * %(width)s
        ORDER BY ts DESC LIMIT 1
    ) AS k
    WHERE names.n IS NOT NULL
)
ORDER BY s.ts
"""
)


def _series_by_slices(
    engine: Engine, window: Window, columns: tuple[str, ...], max_points: int
) -> pd.DataFrame:
    """A long range on PostgreSQL: each instance's newest scrape in each of ``max_points`` equal
    slices of the window (so its newest scrape in the window is always kept). Reads about
    ``max_points`` rows per instance however many the window holds; counter differences stay
    exact between kept scrapes, as with every-k-th."""
    sql = _SLICES_SQL.format(columns=", ".join(f's."{c}"' for c in columns))
    params = {
        "points": max(max_points, 1),
        "start": window.start,
        "end": window.end,
        "width": window.seconds / max(max_points, 1),
    }
    with connect(engine) as conn:
        cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
        try:
            cursor.execute(sql, params)
            names = [d[0] for d in cursor.description]
            rows = cursor.fetchall()
        finally:
            cursor.close()
    df = pd.DataFrame.from_records(rows, columns=names)
    if "up" in df:
        df["up"] = df["up"].astype("boolean")
    return df


def latest_snapshots(engine: Engine, end: float, lookback_s: float = 900.0) -> pd.DataFrame:
    """The newest snapshot of each instance at or before ``end`` (within ``lookback_s``)."""
    newest = (
        select(Snapshot.instance, func.max(Snapshot.ts).label("ts"))
        .where(Snapshot.ts <= end, Snapshot.ts > end - lookback_s)
        .group_by(Snapshot.instance)
        .subquery()
    )
    cols = [getattr(Snapshot, c) for c in SERIES_COLUMNS if c not in ("ts", "instance")]
    stmt = (
        select(Snapshot.instance, Snapshot.ts, Snapshot.error, Snapshot.engines, *cols)
        .join(newest, and_(Snapshot.instance == newest.c.instance, Snapshot.ts == newest.c.ts))
        .order_by(Snapshot.role.desc(), Snapshot.instance)
    )
    df = frame(engine, stmt)
    return df.drop_duplicates("instance", keep="last") if not df.empty else df


def histogram_edges(engine: Engine, window: Window, names: list[str]) -> dict[str, tuple[Any, Any]]:
    """For each instance, the ``histograms`` of its first and last snapshot in the window."""
    edges: dict[str, tuple[Any, Any]] = {}
    with connect(engine) as conn:
        for name in names:
            base = select(Snapshot.histograms).where(
                Snapshot.instance == name, Snapshot.ts >= window.start, Snapshot.ts < window.end
            )
            first = conn.execute(base.order_by(Snapshot.ts).limit(1)).scalar()
            last = conn.execute(base.order_by(Snapshot.ts.desc()).limit(1)).scalar()
            if last is not None:
                edges[name] = (first, last)
    return edges


def latest_decisions(engine: Engine, end: float, subject_kind: str, fields: tuple[str, ...]) -> pd.DataFrame:
    """The newest decision per (subject, field) at or before ``end``."""
    newest = (
        select(func.max(Decision.id).label("id"))
        .where(Decision.ts <= end, Decision.subject_kind == subject_kind, Decision.field.in_(fields))
        .group_by(Decision.subject, Decision.field)
        .subquery()
    )
    stmt = select(
        Decision.subject, Decision.field, Decision.new_value, Decision.reason, Decision.ts, Decision.mode
    ).join(newest, Decision.id == newest.c.id)
    return frame(engine, stmt)


def current_weights(engine: Engine, end: float) -> pd.DataFrame:
    """Latest weight the controller set per instance: subject, weight, reason, ts."""
    df = latest_decisions(engine, end, "instance", (WEIGHT_FIELD,))
    return df.rename(columns={"new_value": "weight"}).drop(columns=["field"])


def pool_limits(engine: Engine, end: float) -> pd.DataFrame:
    """Latest admission limits and weight per pool, one row per pool."""
    df = latest_decisions(engine, end, "pool", (WEIGHT_FIELD, *LIMIT_FIELDS))
    if df.empty:
        return pd.DataFrame(columns=["pool", WEIGHT_FIELD, *LIMIT_FIELDS])
    wide = df.pivot_table(index="subject", columns="field", values="new_value", aggfunc="last")
    wide = wide.reset_index().rename(columns={"subject": "pool"})
    wide.columns.name = None
    return wide


def active_overrides(engine: Engine, now: float) -> pd.DataFrame:
    """Manual weights and drains that still win: not cleared and not expired at ``now``."""
    stmt = (
        select(
            WeightOverride.id,
            WeightOverride.subject_kind,
            WeightOverride.subject,
            WeightOverride.weight,
            WeightOverride.drained,
            WeightOverride.reason,
            WeightOverride.actor,
            WeightOverride.created,
            WeightOverride.expires,
        )
        .where(
            WeightOverride.cleared.is_(None),
            WeightOverride.created <= now,
            or_(WeightOverride.expires.is_(None), WeightOverride.expires > now),
        )
        .order_by(WeightOverride.created.desc())
    )
    return frame(engine, stmt)
