"""policy state and config

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01

The policy's carried state per subject (``policy_state``: smoothed weight, streaks, when a
weight was last lowered or raised, its ceiling; a pool's cooldown and streaks), which used to
travel in ``decisions.scores`` under underscore keys, and the policy configs decisions were
taken under (``policy_configs``, named by ``decisions.policy``).
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'policy_configs',
        sa.Column('fingerprint', sa.String(length=40), nullable=False),
        sa.Column('version', sa.Integer(), nullable=False),
        sa.Column('config', sa.JSON(), nullable=False),
        sa.Column('first_seen', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('fingerprint'),
    )
    op.create_table(
        'policy_state',
        sa.Column('subject_kind', sa.String(length=16), nullable=False),
        sa.Column('subject', sa.String(length=128), nullable=False),
        sa.Column('state', sa.JSON(), nullable=False),
        sa.Column('tick', sa.Integer(), nullable=False),
        sa.Column('ts', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('subject_kind', 'subject'),
    )
    with op.batch_alter_table('decisions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('policy', sa.String(length=40), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('decisions', schema=None) as batch_op:
        batch_op.drop_column('policy')
    op.drop_table('policy_state')
    op.drop_table('policy_configs')
