"""proxy members

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01

The proxies admitting into the pools (``proxies``): one row per proxy id with its last
routing poll, the demand it reported and the share of the pools' limits it was given.
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'proxies',
        sa.Column('id', sa.String(length=128), nullable=False),
        sa.Column('boot', sa.String(length=32), nullable=False),
        sa.Column('started', sa.Float(), nullable=False),
        sa.Column('first_seen', sa.Float(), nullable=False),
        sa.Column('last_seen', sa.Float(), nullable=False),
        sa.Column('served_by', sa.String(length=256), nullable=True),
        sa.Column('applied_version', sa.BigInteger(), nullable=True),
        sa.Column('demand', sa.JSON(), nullable=False),
        sa.Column('rates', sa.JSON(), nullable=False),
        sa.Column('inflight', sa.JSON(), nullable=False),
        sa.Column('served', sa.JSON(), nullable=False),
        sa.Column('duplicates', sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_proxies')),
    )
    with op.batch_alter_table('proxies', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_proxies_last_seen'), ['last_seen'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('proxies', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_proxies_last_seen'))
    op.drop_table('proxies')
