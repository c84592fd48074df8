"""instance restarted_at

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05

When the collector last confirmed that an instance restarted (``instances.restarted_at``: the new
process's start time, set when its ``process_start_time_seconds`` moved and its counters reset
between two scrapes). Nullable: no instance has a restart on record before this revision. The
controller reads it to charge the failed handoffs of a D's stale peer to the pair, not to the D.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("instances", schema=None) as batch_op:
        batch_op.add_column(sa.Column("restarted_at", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("instances", schema=None) as batch_op:
        batch_op.drop_column("restarted_at")
