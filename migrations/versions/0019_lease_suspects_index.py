"""lease suspects index

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-06

A partial index on ``request_records.proxy_in`` holding only the lease-expiry suspects
(``lease_expiry_suspect``): the controller reads a window's suspects every tick, a few among every
request of the window (and its lookback). Through the ``proxy_in`` index alone that read walked every
record of the window and kept two: 178 ms in one ``EXPLAIN ANALYZE`` on PostgreSQL at 3,000 instances
(231,601 rows removed by its filter). The predicate is the query's term as each dialect writes it (``IS true`` on PostgreSQL,
``IS 1`` on SQLite): both planners use a partial index only for a query whose terms imply it, and SQLite
only for the same term.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_request_records_lease_suspects",
        "request_records",
        ["proxy_in"],
        unique=False,
        postgresql_where=sa.text("lease_expiry_suspect IS true"),
        sqlite_where=sa.text("lease_expiry_suspect IS 1"),
    )


def downgrade() -> None:
    op.drop_index("ix_request_records_lease_suspects", table_name="request_records")
