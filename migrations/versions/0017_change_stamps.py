"""change stamps

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-05

``request_records.stamp`` and ``snapshots.stamp``: which write last touched a row, so a reader can
read only what changed since its last read (``store.changes``) instead of its whole window. The
database writes them, in a trigger on every insert and update, so no writer can forget one:

- PostgreSQL: the writing transaction's id (``txid_current()``, 64-bit, never wrapping). A reader
  remembers the oldest transaction still running when it read (``txid_snapshot_xmin``); every row
  it could not see then was written by that one or a later one, so the next read asks for stamps at
  or above it: nothing committed late is missed.
- SQLite: one more than the table's highest stamp. SQLite has one writer at a time, so a write's
  stamp is above every stamp committed before it, and a reader asks for stamps above the highest it
  has read.

Nullable: rows stored before this revision have none, and are read only by a full read (every reader
starts with one).

SQLite's ``batch_alter_table`` recreates a table for some changes (dropping a column, say), and a
recreated table has lost these triggers: a later revision that recreates either table must create
them again (``tests/store/test_change_stamps.py`` checks they are there at head).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("request_records", "snapshots")

_PG_FUNCTION = """
CREATE OR REPLACE FUNCTION pdscope_change_stamp() RETURNS trigger AS $$
BEGIN
    NEW.stamp := txid_current();
    RETURN NEW;
END
$$ LANGUAGE plpgsql
"""


def _sqlite_triggers(table: str) -> list[str]:
    """An insert and an update stamp the row with the table's highest stamp plus one (an update of the
    stamp alone, the trigger's own, fires nothing: SQLite's triggers do not recurse by default)."""
    stamp = f"UPDATE {table} SET stamp = (SELECT coalesce(max(stamp), 0) + 1 FROM {table}) WHERE id = NEW.id"
    return [
        f"CREATE TRIGGER {table}_stamp_insert AFTER INSERT ON {table} BEGIN {stamp}; END",
        f"CREATE TRIGGER {table}_stamp_update AFTER UPDATE ON {table} WHEN NEW.stamp IS OLD.stamp "
        f"BEGIN {stamp}; END",
    ]


def create_triggers(dialect: str) -> None:
    """The triggers that write the stamps (also for a later revision that recreates a table)."""
    if dialect == "postgresql":
        op.execute(_PG_FUNCTION)
        for table in TABLES:
            op.execute(
                f"CREATE TRIGGER {table}_stamp BEFORE INSERT OR UPDATE ON {table} "
                "FOR EACH ROW EXECUTE FUNCTION pdscope_change_stamp()"
            )
    else:
        for table in TABLES:
            for sql in _sqlite_triggers(table):
                op.execute(sql)


def drop_triggers(dialect: str) -> None:
    if dialect == "postgresql":
        for table in TABLES:
            op.execute(f"DROP TRIGGER IF EXISTS {table}_stamp ON {table}")
        op.execute("DROP FUNCTION IF EXISTS pdscope_change_stamp()")
    else:
        for table in TABLES:
            op.execute(f"DROP TRIGGER IF EXISTS {table}_stamp_insert")
            op.execute(f"DROP TRIGGER IF EXISTS {table}_stamp_update")


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column("stamp", sa.BigInteger(), nullable=True))
            batch_op.create_index(f"ix_{table}_stamp", ["stamp"], unique=False)
    create_triggers(op.get_bind().dialect.name)


def downgrade() -> None:
    drop_triggers(op.get_bind().dialect.name)
    for table in TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_index(f"ix_{table}_stamp")
            batch_op.drop_column("stamp")
