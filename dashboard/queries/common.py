"""What every dashboard query shares: the time window, turning a SELECT into a frame,
time buckets that work on SQLite and PostgreSQL, PostgreSQL's loose index scan, and "is there
any data yet".

Queries here only read. They take an Engine and plain values and return pandas
DataFrames; Streamlit caching happens one layer up (``dashboard.data``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd
from sqlalchemy import Connection, Engine, Integer, Select, cast, func, inspect, select
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.expression import Executable

from store.models import Decision, RequestRecord, Snapshot


def connect(engine: Engine) -> Connection:
    """A connection for the dashboard's reads. On PostgreSQL it runs without JIT compilation: the
    planner's estimates for a large store's window reads (loose index scans, probes per slice) pass
    ``jit_above_cost`` and compiling then takes longer (100-200 ms) than the query itself. Set once
    per pooled connection (a SELECT, which the dashboard's read-only engine allows)."""
    conn = engine.connect()
    if engine.dialect.name == "postgresql":
        info = conn.connection.info
        if not info.get("pdscope_no_jit"):
            conn.exec_driver_sql("SELECT set_config('jit', 'off', false)")
            conn.commit()  # a session setting made in a transaction rolled back on return is undone
            info["pdscope_no_jit"] = True
    return conn


@dataclass(frozen=True)
class Window:
    """A half-open time range [start, end) in Unix seconds."""

    start: float
    end: float

    @property
    def seconds(self) -> float:
        return max(self.end - self.start, 1e-9)

    def bucket_s(self, target_points: int = 60) -> float:
        """A readable bucket width giving about ``target_points`` points over the window."""
        raw = self.seconds / max(target_points, 1)
        for step in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 86400):
            if raw <= step:
                return float(step)
        return 86400.0


def loose_index_scan(cte: str, var: str, table: str, column: str) -> str:
    """PostgreSQL: ``WITH RECURSIVE cte(var)``, the distinct values of ``table.column`` in order, each
    found by one index probe past the one before (a loose index scan: one probe per value, not one
    read per row). Its last row is NULL: the query that follows filters ``cte.var IS NOT NULL``."""
    return (
        f"WITH RECURSIVE {cte}({var}) AS (\n"
        f"    (SELECT {column} FROM {table} ORDER BY {column} LIMIT 1)\n"
        "    UNION ALL\n"
        f"    SELECT (SELECT {column} FROM {table} WHERE {column} > {cte}.{var} ORDER BY {column} LIMIT 1)\n"
        f"    FROM {cte} WHERE {cte}.{var} IS NOT NULL\n"
        ")\n"
    )


def frame(engine: Engine, stmt: Executable) -> pd.DataFrame:
    """Run a SELECT and return its rows as a DataFrame (columns named as selected)."""
    with connect(engine) as conn:
        result = conn.execute(stmt)
        columns = list(result.keys())
        # Plain tuples: pandas probes Row objects attribute by attribute, which is slow.
        rows = [tuple(r) for r in result.all()]
    return pd.DataFrame.from_records(rows, columns=columns)


def bucket_index(
    engine: Engine, column: ColumnElement[float], start: float, width: float
) -> ColumnElement[int]:
    """floor((column - start) / width) as an integer, on SQLite and PostgreSQL alike."""
    scaled = (column - start) / width
    if engine.dialect.name == "sqlite":
        # Values are ≥ 0 inside the window, where truncation is floor.
        return cast(scaled, Integer)
    return cast(func.floor(scaled), Integer)


def fast_frame(engine: Engine, stmt: Select[Any], bool_columns: tuple[str, ...] = ()) -> pd.DataFrame:
    """Like :func:`frame` for wide, plain-column reads on hot paths: runs the compiled SELECT
    on the DBAPI cursor, skipping SQLAlchemy's per-row objects (about 3x less CPU).

    Only for columns that need no result processing (numbers, strings); booleans, which
    SQLite returns as 0/1, are converted for the columns named in ``bool_columns``.
    """
    # render_postcompile: an IN list (a sender filter) becomes plain parameters the cursor takes
    compiled = stmt.compile(dialect=engine.dialect, compile_kwargs={"render_postcompile": True})
    params: Any = compiled.params
    if compiled.positional:
        params = tuple(compiled.params[name] for name in (compiled.positiontup or ()))
    with connect(engine) as conn:
        cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
        try:
            cursor.execute(str(compiled), params)
            columns = [d[0] for d in cursor.description]
            rows = cursor.fetchall()
        finally:
            cursor.close()
    df = pd.DataFrame.from_records(rows, columns=columns)
    for col in bool_columns:
        if col in df:
            df[col] = df[col].astype("boolean")
    return df


@dataclass(frozen=True)
class Presence:
    """Whether the store has tables and any rows of each kind; drives the empty states."""

    schema: bool
    snapshots: bool
    requests: bool
    decisions: bool


def presence(engine: Engine) -> Presence:
    """Cheap checks (one indexed row each) of what the store holds."""
    if not inspect(engine).has_table(Snapshot.__tablename__):
        return Presence(False, False, False, False)
    with connect(engine) as conn:
        snaps = conn.execute(select(Snapshot.id).limit(1)).first() is not None
        reqs = conn.execute(select(RequestRecord.id).limit(1)).first() is not None
        decs = conn.execute(select(Decision.id).limit(1)).first() is not None
    return Presence(True, snaps, reqs, decs)


def latest_ts(engine: Engine) -> float | None:
    """The newest snapshot or request time (None for an empty or unmigrated store)."""
    if not inspect(engine).has_table(Snapshot.__tablename__):
        return None
    with connect(engine) as conn:
        snap = conn.execute(select(func.max(Snapshot.ts))).scalar()
        req = conn.execute(select(func.max(RequestRecord.proxy_in))).scalar()
    values = [v for v in (snap, req) if v is not None]
    return max(values) if values else None
