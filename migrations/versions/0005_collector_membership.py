"""collector membership

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

The collectors sharing a PostgreSQL store's scrape targets (``collectors``): one row per
collector id with its last heartbeat; those heard from within three scrape intervals split
the instances between them.
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'collectors',
        sa.Column('id', sa.String(length=128), nullable=False),
        sa.Column('incarnation', sa.String(length=32), nullable=False),
        sa.Column('started', sa.Float(), nullable=False),
        sa.Column('heartbeat', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_collectors')),
    )


def downgrade() -> None:
    op.drop_table('collectors')
