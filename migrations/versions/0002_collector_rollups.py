"""collector rollups

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29

Per-minute rollups of snapshots and request records (kept longer than the raw rows)
and ``snapshots.extra`` for vllm:nixl_* series pdscope has no column for.
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('request_rollups',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('minute', sa.Float(), nullable=False),
    sa.Column('p_instance', sa.String(length=128), nullable=False),
    sa.Column('d_instance', sa.String(length=128), nullable=False),
    sa.Column('requests', sa.Integer(), nullable=False),
    sa.Column('ok', sa.Integer(), nullable=False),
    sa.Column('slo_met', sa.Integer(), nullable=False),
    sa.Column('lease_suspects', sa.Integer(), nullable=False),
    sa.Column('ttft_sum_s', sa.Float(), nullable=False),
    sa.Column('ttft_max_s', sa.Float(), nullable=True),
    sa.Column('handoff_sum_s', sa.Float(), nullable=False),
    sa.Column('handoff_count', sa.Integer(), nullable=False),
    sa.Column('handoff_max_s', sa.Float(), nullable=True),
    sa.Column('e2e_sum_s', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_request_rollups')),
    sa.UniqueConstraint('minute', 'p_instance', 'd_instance', name=op.f('uq_request_rollups_minute'))
    )
    with op.batch_alter_table('request_rollups', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_request_rollups_minute'), ['minute'], unique=False)

    op.create_table('snapshot_rollups',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('instance', sa.String(length=128), nullable=False),
    sa.Column('pool', sa.String(length=128), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('minute', sa.Float(), nullable=False),
    sa.Column('scrapes', sa.Integer(), nullable=False),
    sa.Column('up_scrapes', sa.Integer(), nullable=False),
    sa.Column('gauges', sa.JSON(), nullable=False),
    sa.Column('increases', sa.JSON(), nullable=False),
    sa.Column('histograms', sa.JSON(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_snapshot_rollups')),
    sa.UniqueConstraint('instance', 'minute', name=op.f('uq_snapshot_rollups_instance'))
    )
    with op.batch_alter_table('snapshot_rollups', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_snapshot_rollups_minute'), ['minute'], unique=False)
        batch_op.create_index('ix_snapshot_rollups_pool_minute', ['pool', 'minute'], unique=False)

    with op.batch_alter_table('snapshots', schema=None) as batch_op:
        batch_op.add_column(sa.Column('extra', sa.JSON(), nullable=False, server_default=sa.text("'{}'")))



def downgrade() -> None:
    with op.batch_alter_table('snapshots', schema=None) as batch_op:
        batch_op.drop_column('extra')

    with op.batch_alter_table('snapshot_rollups', schema=None) as batch_op:
        batch_op.drop_index('ix_snapshot_rollups_pool_minute')
        batch_op.drop_index(batch_op.f('ix_snapshot_rollups_minute'))

    op.drop_table('snapshot_rollups')
    with op.batch_alter_table('request_rollups', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_request_rollups_minute'))

    op.drop_table('request_rollups')
