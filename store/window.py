"""A bounded read of a range of request records: the newest first, at most a limit, and whether the
oldest were left out. The one home of the shape every per-record figure reads (the TTFT predictor's
measurement, the tenants' figures): ``store.prediction`` and ``store.tenants`` name their columns and
their bound, this reads them. It reads; it never writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Connection, select
from sqlalchemy.orm import Session

from store.models import RequestRecord
from store.queries import RecordFilter

_R = RequestRecord


@dataclass(frozen=True)
class WindowRows:
    """Rows read, newest first; ``truncated``: more matched than the limit (the oldest were left out)."""

    rows: tuple[tuple[Any, ...], ...]
    truncated: bool


def window_rows(
    reader: Session | Connection,
    columns: Sequence[Any],
    since: float,
    until: float,
    *,
    only: RecordFilter,
    limit: int,
    max_limit: int,
    where: Sequence[ColumnElement[bool]] = (),
) -> WindowRows:
    """``columns`` (column expressions) of the records in ``[since, until]`` (by ``proxy_in``) that
    ``only`` and ``where`` keep, read through a session (the controller) or a connection (the
    dashboard), at most ``limit`` (1 to ``max_limit``, else ``ValueError``), the newest first."""
    if not 1 <= limit <= max_limit:
        raise ValueError(f"limit must be 1 to {max_limit}, got {limit}")
    stmt = select(*columns).where(_R.proxy_in >= since, _R.proxy_in <= until, *where)
    stmt = stmt.order_by(_R.proxy_in.desc(), _R.id.desc()).limit(limit + 1)
    rows = reader.execute(only.apply(stmt)).all()
    return WindowRows(tuple(tuple(r) for r in rows[:limit]), len(rows) > limit)
