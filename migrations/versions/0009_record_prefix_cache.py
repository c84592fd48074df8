"""record prefix cache

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01

What KV-aware routing adds to a request record, from the proxy's root span: the path taken
(``route_path``: "pd", or "decode_only" when D alone computed the prompt), the prompt tokens the
router predicted the chosen P and D already held, the tokens P and D reported they reused
(vLLM's usage.prompt_tokens_details.cached_tokens), and the deepest matched prefix (its block
chain key in hex and its length in tokens). All nullable: records of a proxy without KV-aware
routing, and every record stored before this revision, have none. No index: the dashboard reads
them from its bounded window sample (every k-th record by id), as it reads the handoff times.
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '0009'
down_revision: str | None = '0008'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_INT_COLUMNS = (
    'p_predicted_cached_tokens',
    'd_predicted_cached_tokens',
    'p_cached_tokens',
    'd_cached_tokens',
    'prefix_tokens',
)


def upgrade() -> None:
    with op.batch_alter_table('request_records', schema=None) as batch_op:
        batch_op.add_column(sa.Column('route_path', sa.String(length=16), nullable=True))
        for name in _INT_COLUMNS:
            batch_op.add_column(sa.Column(name, sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('prefix_key', sa.String(length=16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('request_records', schema=None) as batch_op:
        batch_op.drop_column('prefix_key')
        for name in reversed(_INT_COLUMNS):
            batch_op.drop_column(name)
        batch_op.drop_column('route_path')
