"""tick records

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02

One row per controller tick holding everything the tick decided from (the observation, the carried
state, the overrides, the fleet, the mode) and the state it left, compressed: ``pdscope replay``
re-runs the policy over a stored window from these. Ticks taken before this revision have no row, so
a replay of a window that starts before it refuses and names the first recorded tick.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tick_records",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("tick", sa.Integer(), nullable=False),
        sa.Column("leader_epoch", sa.Integer(), nullable=True),
        sa.Column("policy", sa.String(length=40), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("format", sa.Integer(), nullable=False),
        sa.Column("codec", sa.String(length=16), nullable=False),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tick_records")),
    )
    with op.batch_alter_table("tick_records", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_tick_records_ts"), ["ts"], unique=False)
        batch_op.create_index("ix_tick_records_epoch_tick", ["leader_epoch", "tick"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("tick_records", schema=None) as batch_op:
        batch_op.drop_index("ix_tick_records_epoch_tick")
        batch_op.drop_index(batch_op.f("ix_tick_records_ts"))
    op.drop_table("tick_records")
