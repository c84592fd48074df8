"""controller leader epoch

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01

The controller's leader epoch (``controller_leader``: one row, bumped by each takeover; a tick
writes only while the epoch is its own) and the epoch each decision was taken under
(``decisions.leader_epoch``; null for decisions stored before).
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    leader = op.create_table(
        'controller_leader',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('epoch', sa.Integer(), nullable=False),
        sa.Column('holder', sa.String(length=256), nullable=False),
        sa.Column('since', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_controller_leader')),
    )
    op.bulk_insert(leader, [{'id': 1, 'epoch': 0, 'holder': '', 'since': 0.0}])
    with op.batch_alter_table('decisions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('leader_epoch', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('decisions', schema=None) as batch_op:
        batch_op.drop_column('leader_epoch')
    op.drop_table('controller_leader')
