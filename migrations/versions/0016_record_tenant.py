"""record tenant

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-05

Whose request each record is (``request_records.tenant``: a tenant id the config declares, from the
proxy's root span's ``pdscope.tenant``), and an index on (tenant, proxy_in) for one tenant's window.
Nullable: records stored before this revision, and those whose attribute was invalid, have none;
readers count them as the ``default`` tenant's.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("request_records", schema=None) as batch_op:
        batch_op.add_column(sa.Column("tenant", sa.String(length=64), nullable=True))
        batch_op.create_index("ix_request_records_tenant_ts", ["tenant", "proxy_in"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("request_records", schema=None) as batch_op:
        batch_op.drop_index("ix_request_records_tenant_ts")
        batch_op.drop_column("tenant")
