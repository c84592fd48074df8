"""record sender

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

Who sent a span (the sender name of its OTLP bearer token) and, on a request record,
the sender of its proxy root span. Null: sent without authentication.
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('request_records', schema=None) as batch_op:
        batch_op.add_column(sa.Column('sender', sa.String(length=64), nullable=True))
    with op.batch_alter_table('spans', schema=None) as batch_op:
        batch_op.add_column(sa.Column('sender', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('spans', schema=None) as batch_op:
        batch_op.drop_column('sender')
    with op.batch_alter_table('request_records', schema=None) as batch_op:
        batch_op.drop_column('sender')
