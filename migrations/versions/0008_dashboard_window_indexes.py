"""dashboard window indexes

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01

Covering indexes for the dashboard's window reads on large stores: request records by
arrival time with their id, status, TTFT and TPOT (the window's count, its sample's ids
and its per-status and per-SLO counts are read from the index alone), and snapshots by
instance and time with their id (a long range's every-k-th-scrape pick reads the index,
then fetches only the rows it keeps).
"""
from __future__ import annotations

from collections.abc import Sequence

from alembic import op


revision: str = '0008'
down_revision: str | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('request_records', schema=None) as batch_op:
        batch_op.create_index(
            'ix_request_records_window', ['proxy_in', 'id', 'status', 'ttft_s', 'tpot_s'], unique=False
        )
    with op.batch_alter_table('snapshots', schema=None) as batch_op:
        batch_op.create_index('ix_snapshots_instance_ts_id', ['instance', 'ts', 'id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('snapshots', schema=None) as batch_op:
        batch_op.drop_index('ix_snapshots_instance_ts_id')
    with op.batch_alter_table('request_records', schema=None) as batch_op:
        batch_op.drop_index('ix_request_records_window')
