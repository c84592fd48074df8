"""record prediction

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-10

What the proxy's TTFT predictor said of a request, from its root span: the TTFT it predicted at
admission for the P and D it chose (``predicted_ttft_s``, seconds from the proxy's receipt), the
target it was admitted against (``ttft_target_s``), the uncached prefill tokens ahead of it on that P
when sent (``predict_tokens_ahead``), its own uncached prefill tokens (``predict_tokens``) and where
the rates came from (``predict_source``: online, table or prior). All nullable: records of a proxy
without the predictor, and every record stored before this revision, have none. No index: readers
take them with the window's records (``store.prediction``).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_FLOAT_COLUMNS = ("predicted_ttft_s", "ttft_target_s")
_INT_COLUMNS = ("predict_tokens_ahead", "predict_tokens")


def upgrade() -> None:
    with op.batch_alter_table("request_records", schema=None) as batch_op:
        for name in _FLOAT_COLUMNS:
            batch_op.add_column(sa.Column(name, sa.Float(), nullable=True))
        for name in _INT_COLUMNS:
            batch_op.add_column(sa.Column(name, sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("predict_source", sa.String(length=8), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("request_records", schema=None) as batch_op:
        batch_op.drop_column("predict_source")
        for name in reversed(_INT_COLUMNS):
            batch_op.drop_column(name)
        for name in reversed(_FLOAT_COLUMNS):
            batch_op.drop_column(name)
