"""record handoff

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-05

How each request's KV went from P to D (``request_records.handoff``: ``pull``, ``push``, or
``push_early`` when the proxy sent D's leg with P's), from the proxy's root span
(``pdscope.handoff``). Nullable: records stored before this revision, and requests with no handoff
(rejected, decode-only), have none.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("request_records", schema=None) as batch_op:
        batch_op.add_column(sa.Column("handoff", sa.String(length=16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("request_records", schema=None) as batch_op:
        batch_op.drop_column("handoff")
