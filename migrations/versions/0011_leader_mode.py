"""the leader's mode

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-09

The mode (``advisory`` or ``enforce``) the leader took over in, on the ``controller_leader`` row: a
standby serves the leader's mode, not its own. Null: taken before this revision (a standby then
serves its own, as before).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("controller_leader", schema=None) as batch_op:
        batch_op.add_column(sa.Column("mode", sa.String(length=16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("controller_leader", schema=None) as batch_op:
        batch_op.drop_column("mode")
