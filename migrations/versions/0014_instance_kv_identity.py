"""instance kv_identity

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05

What an instance's latest up scrape reported of the fields a P x D pair must agree on
(``instances.kv_identity``, JSON ``{field: value}``: its model, KV block size and KV cache dtype, from
vLLM's ``model_name`` label and ``vllm:cache_config_info``). Nullable: no instance has one on record
before this revision (the controller reads that as "not reported yet"). The controller pairs only
compatible instances by it (``controller.policy.compat``).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("instances", schema=None) as batch_op:
        batch_op.add_column(sa.Column("kv_identity", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("instances", schema=None) as batch_op:
        batch_op.drop_column("kv_identity")
