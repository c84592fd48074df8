"""Multi-row INSERT straight through the DB driver, for the collector's hot writes.

SQLAlchemy's Core ``executemany`` spends most of its time per row binding parameters
and running the JSON type's processor; at 20,000 spans a second that is the bottleneck.
``insert_rows`` serialises JSON columns once with orjson (NaN and Infinity become null:
PostgreSQL's JSON refuses them; callers keep them out) and hands plain tuples to the driver's
``executemany`` in the session's transaction. It works with the ``qmark`` (sqlite3) and
``format``/``pyformat`` (psycopg) parameter styles and falls back to a Core insert for
any other driver. It raises what the driver raises (SQLAlchemy-wrapped), like any query.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any

import orjson
from sqlalchemy import JSON, Table, insert
from sqlalchemy.orm import Session


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


class RawJSON(str):
    """A value for a JSON column that is already serialised (``insert_rows`` passes it as is)."""

    __slots__ = ()


@functools.lru_cache(maxsize=32)
def _statement(table: Table, columns: tuple[str, ...], placeholder: str, ignore_conflicts: bool) -> str:
    cols = ", ".join(columns)
    marks = ", ".join([placeholder] * len(columns))
    tail = " ON CONFLICT DO NOTHING" if ignore_conflicts else ""
    return f"INSERT INTO {table.name} ({cols}) VALUES ({marks}){tail}"


def insert_rows(
    session: Session, table: Table, rows: Sequence[dict[str, Any]], *, ignore_conflicts: bool = False
) -> None:
    """Insert ``rows`` (dicts with the same keys) into ``table`` in the session's transaction.

    ``ignore_conflicts`` skips rows that would break a unique constraint (``ON CONFLICT DO
    NOTHING``, which SQLite and PostgreSQL both speak).
    """
    if not rows:
        return
    conn = session.connection()
    style = conn.dialect.paramstyle
    if style == "qmark":
        placeholder = "?"
    elif style in ("format", "pyformat"):
        placeholder = "%s"
    else:
        stmt = insert(table)
        if ignore_conflicts:
            stmt = stmt.prefix_with("OR IGNORE") if conn.dialect.name == "sqlite" else stmt
        session.execute(stmt, list(rows))
        return
    columns = tuple(rows[0])
    getter = operator.itemgetter(*columns)
    params: list[Any] = [getter(r) for r in rows] if len(columns) > 1 else [(getter(r),) for r in rows]
    json_cols = [i for i, c in enumerate(columns) if isinstance(table.c[c].type, JSON)]
    for i in json_cols:  # serialise what is not serialised yet
        for n, row in enumerate(params):
            v = row[i]
            if v is not None and not isinstance(v, RawJSON):
                params[n] = (*row[:i], _dumps(v), *row[i + 1 :])
    conn.exec_driver_sql(_statement(table, columns, placeholder, ignore_conflicts), params)
