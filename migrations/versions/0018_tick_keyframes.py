"""tick keyframes

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-05

Tick records of format 2 are keyframes (the whole record) or deltas on the record before them
(``controller.tickchain``): ``tick_records.keyframe`` says which. Records stored before this revision
are all whole (format 1), so they read as keyframes (the column's server default).

A downgrade drops the column; the pdscope it goes back to reads format 1 only, so the deltas (which it
could not rebuild) are deleted and the keyframes, whose payload is a whole format 1 record, are marked
format 1. A window replayed there then has its delta ticks missing, and refuses as for ticks that left
no record.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tick_records", schema=None) as batch_op:
        batch_op.add_column(sa.Column("keyframe", sa.Boolean(), server_default=sa.true(), nullable=False))


def downgrade() -> None:
    records = sa.table("tick_records", sa.column("keyframe", sa.Boolean()), sa.column("format", sa.Integer()))
    op.execute(records.delete().where(records.c.keyframe.is_(False)))
    op.execute(records.update().where(records.c.format == 2).values(format=1))
    with op.batch_alter_table("tick_records", schema=None) as batch_op:
        batch_op.drop_column("keyframe")
