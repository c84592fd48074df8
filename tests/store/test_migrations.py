from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import insert, inspect, select, text, update
from sqlalchemy.schema import CreateIndex

from store import Base, make_engine
from store.migrate import check, downgrade, upgrade
from store.models import RequestRecord


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_check_downgrade(store_url: str) -> None:
    upgrade(store_url)
    assert set(Base.metadata.tables) <= _tables(store_url)
    check(store_url)  # models and migrations never drift
    downgrade(store_url, "base")
    assert _tables(store_url) <= {"alembic_version"}
    upgrade(store_url)  # and back up again from base
    check(store_url)


def test_indexes_for_time_window_queries(store_url: str) -> None:
    upgrade(store_url)
    engine = make_engine(store_url)
    try:
        insp = inspect(engine)
        snap_ix = {tuple(ix["column_names"]) for ix in insp.get_indexes("snapshots")}
        req_ix = {tuple(ix["column_names"]) for ix in insp.get_indexes("request_records")}
    finally:
        engine.dispose()
    assert ("instance", "ts") in snap_ix
    assert ("ts",) in snap_ix
    assert ("proxy_in",) in req_ix
    assert ("d_instance", "proxy_in") in req_ix


def test_0009_adds_the_routing_columns_to_stored_records_and_takes_them_back(store_url: str) -> None:
    """Records stored before 0009 keep every value and get the new columns as null; a downgrade to
    0008 drops only those columns."""
    from sqlalchemy import text

    upgrade(store_url, "0008")
    engine = make_engine(store_url)
    insert = text(
        "INSERT INTO request_records"
        " (request_id, status, retries, proxy_in, lease_expiry_suspect, attributes)"
        " VALUES (:rid, 'ok', 0, :t, false, '{}')"
    )
    new = ("route_path", "p_predicted_cached_tokens", "d_cached_tokens", "prefix_key", "prefix_tokens")
    try:
        with engine.begin() as conn:
            conn.execute(insert, {"rid": "old", "t": 1.0})
        upgrade(store_url, "0009")
        with engine.begin() as conn:
            row = conn.execute(text(f"SELECT request_id, {', '.join(new)} FROM request_records")).one()
            assert tuple(row) == ("old", None, None, None, None, None)
            conn.execute(
                text("UPDATE request_records SET route_path = 'decode_only', prefix_key = 'abcdef0123456789'")
            )
        downgrade(store_url, "0008")
        cols = {c["name"] for c in inspect(engine).get_columns("request_records")}
        assert not cols & set(new) and {"request_id", "sender"} <= cols
        with engine.begin() as conn:
            assert conn.execute(text("SELECT request_id FROM request_records")).scalar() == "old"
    finally:
        engine.dispose()


def test_0012_adds_the_prediction_columns_to_stored_records_and_takes_them_back(store_url: str) -> None:
    """Records stored before 0012 keep every value and get the predictor's columns as null; a
    downgrade to 0011 drops only those columns."""
    from sqlalchemy import text

    upgrade(store_url, "0011")
    engine = make_engine(store_url)
    insert = text(
        "INSERT INTO request_records"
        " (request_id, status, retries, proxy_in, lease_expiry_suspect, attributes, route_path)"
        " VALUES (:rid, 'ok', 0, :t, false, '{}', 'pd')"
    )
    new = ("predicted_ttft_s", "ttft_target_s", "predict_tokens_ahead", "predict_tokens", "predict_source")
    try:
        with engine.begin() as conn:
            conn.execute(insert, {"rid": "old", "t": 1.0})
        upgrade(store_url, "0012")
        with engine.begin() as conn:
            row = conn.execute(text(f"SELECT request_id, {', '.join(new)} FROM request_records")).one()
            assert tuple(row) == ("old", None, None, None, None, None)
            conn.execute(
                text(
                    "UPDATE request_records SET predicted_ttft_s = 0.25, ttft_target_s = 1.5,"
                    " predict_tokens_ahead = 4096, predict_tokens = 512, predict_source = 'table'"
                )
            )
            row = conn.execute(text(f"SELECT {', '.join(new)} FROM request_records")).one()
            assert tuple(row) == (0.25, 1.5, 4096, 512, "table")
        downgrade(store_url, "0011")
        cols = {c["name"] for c in inspect(engine).get_columns("request_records")}
        assert not cols & set(new) and {"request_id", "route_path", "sender"} <= cols
        with engine.begin() as conn:
            assert conn.execute(text("SELECT route_path FROM request_records")).scalar() == "pd"
    finally:
        engine.dispose()


_RECORD = (
    "INSERT INTO request_records"
    " (request_id, status, retries, proxy_in, lease_expiry_suspect, attributes, route_path)"
    " VALUES ('old', 'ok', 0, 1.0, false, '{}', 'pd')"
)
_INSTANCE = (
    "INSERT INTO instances (name, pool, role, url, labels, first_seen, last_seen)"
    " VALUES ('p0', 'prefill', 'prefill', 'http://p0', '{}', 1.0, 2.0)"
)


@dataclass(frozen=True)
class AddedColumn:
    """A revision that adds one column: the row stored before it, the column, a value it takes, and a
    column of the older schema whose value must survive the round trip."""

    revision: str
    before: str
    table: str
    insert: str
    column: str
    value: Any
    kept: tuple[str, Any]


ADDED_COLUMNS = (
    AddedColumn("0013", "0012", "instances", _INSTANCE, "restarted_at", 1796000000.5, ("last_seen", 2.0)),
    AddedColumn(
        "0014",
        "0013",
        "instances",
        _INSTANCE,
        "kv_identity",
        {"model": "m", "block_size": "16", "cache_dtype": "auto"},  # JSON: reads back as stored
        ("last_seen", 2.0),
    ),
    AddedColumn("0015", "0014", "request_records", _RECORD, "handoff", "push_early", ("route_path", "pd")),
    AddedColumn("0016", "0015", "request_records", _RECORD, "tenant", "team-a.batch", ("route_path", "pd")),
)


@pytest.mark.parametrize("added", ADDED_COLUMNS, ids=lambda a: f"{a.revision}-{a.column}")
def test_a_revision_adds_its_column_to_stored_rows_and_takes_it_back(
    store_url: str, added: AddedColumn
) -> None:
    """Rows stored before the revision keep every value and have nothing in the new column (None: not on
    record); a value written reads back as written; a downgrade drops only that column."""
    table = Base.metadata.tables[added.table]
    kept, kept_value = added.kept
    upgrade(store_url, added.before)
    engine = make_engine(store_url)
    try:
        with engine.begin() as conn:
            conn.execute(text(added.insert))
        upgrade(store_url, added.revision)
        with engine.begin() as conn:
            assert conn.execute(select(table.c[added.column])).scalar_one() is None
            conn.execute(update(table).values({added.column: added.value}))
            assert conn.execute(select(table.c[added.column])).scalar_one() == added.value
        downgrade(store_url, added.before)
        cols = {c["name"] for c in inspect(engine).get_columns(added.table)}
        assert added.column not in cols and kept in cols
        with engine.begin() as conn:
            assert conn.execute(text(f"SELECT {kept} FROM {added.table}")).scalar() == kept_value
    finally:
        engine.dispose()


def test_0016_indexes_one_tenants_window(store_url: str) -> None:
    upgrade(store_url)
    engine = make_engine(store_url)
    try:
        req_ix = {tuple(ix["column_names"]) for ix in inspect(engine).get_indexes("request_records")}
    finally:
        engine.dispose()
    assert ("tenant", "proxy_in") in req_ix


_SNAPSHOT = (
    "INSERT INTO snapshots (instance, pool, role, ts, up, histograms)"
    " VALUES ('p0', 'prefill', 'prefill', {ts}, true, '{{}}')"
)


def _stamps(conn: Any, table: str) -> dict[int, int | None]:
    return dict(conn.execute(text(f"SELECT id, stamp FROM {table} ORDER BY id")).all())


def test_0017_the_database_stamps_every_insert_and_update_and_takes_it_back(store_url: str) -> None:
    """Rows stored before 0017 have no stamp; from 0017 the database stamps each insert and update of
    request_records and snapshots (a later write above an earlier one's; an update of a row moves it
    up), whatever writes them; a downgrade drops the column and the triggers (writes still work)."""
    upgrade(store_url, "0016")
    engine = make_engine(store_url)
    try:
        with engine.begin() as conn:
            conn.execute(text(_RECORD))
            conn.execute(text(_SNAPSHOT.format(ts=1.0)))
        upgrade(store_url, "0017")
        for table, insert in (
            ("request_records", _RECORD.replace("'old'", "'{n}'").replace("'{}'", "'{{}}'")),
            ("snapshots", _SNAPSHOT),
        ):
            with engine.begin() as conn:
                conn.execute(text(insert.format(n="new", ts=2.0)))
            with engine.begin() as conn:
                conn.execute(text(insert.format(n="newer", ts=3.0)))
            with engine.begin() as conn:
                old, new, newer = _stamps(conn, table).values()
            assert old is None and new is not None and newer is not None and newer > new
            with engine.begin() as conn:  # an update of the oldest row, in a later transaction
                conn.execute(
                    text(
                        f"UPDATE {table} SET ts = 9.0 WHERE id = 2"
                        if table == "snapshots"
                        else f"UPDATE {table} SET status = 'error' WHERE id = 2"
                    )
                )
            with engine.begin() as conn:
                assert _stamps(conn, table)[2] > newer  # type: ignore[operator]
        downgrade(store_url, "0016")
        assert "stamp" not in {c["name"] for c in inspect(engine).get_columns("request_records")}
        with engine.begin() as conn:  # no trigger left behind to write a column that is gone
            conn.execute(text(_RECORD.replace("'old'", "'after'")))
            conn.execute(text(_SNAPSHOT.format(ts=4.0)))
            conn.execute(text("UPDATE request_records SET status = 'ok'"))
    finally:
        engine.dispose()


_TICK = (
    "INSERT INTO tick_records (ts, tick, leader_epoch, policy, policy_version, format, codec, payload)"
    " VALUES (:ts, :tick, 1, 'v1:x', 1, :format, 'json+zlib', :payload)"
)


def test_0018_marks_stored_tick_records_as_keyframes_and_takes_deltas_back(store_url: str) -> None:
    """Records stored before 0018 (format 1, all whole) read as keyframes; a downgrade to 0017 deletes
    the deltas (the older pdscope cannot rebuild them) and marks the keyframes format 1 (their payload
    is a whole record), so what stays is what that pdscope reads."""
    upgrade(store_url, "0017")
    engine = make_engine(store_url)
    try:
        with engine.begin() as conn:
            conn.execute(text(_TICK), {"ts": 1.0, "tick": 1, "format": 1, "payload": b"old"})
        upgrade(store_url, "0018")
        with engine.begin() as conn:
            assert conn.execute(text("SELECT keyframe FROM tick_records")).scalar_one() in (True, 1)
            conn.execute(text(_TICK), {"ts": 2.0, "tick": 2, "format": 2, "payload": b"key"})
            conn.execute(text(_TICK), {"ts": 3.0, "tick": 3, "format": 2, "payload": b"delta"})
            conn.execute(text("UPDATE tick_records SET keyframe = false WHERE tick = 3"))
        downgrade(store_url, "0017")
        assert "keyframe" not in {c["name"] for c in inspect(engine).get_columns("tick_records")}
        with engine.begin() as conn:
            rows = conn.execute(text("SELECT tick, format, payload FROM tick_records ORDER BY tick")).all()
        assert [tuple(r) for r in rows] == [(1, 1, b"old"), (2, 1, b"key")]
    finally:
        engine.dispose()


def _plan(conn: Any, stmt: Any) -> str:
    """The planner's plan for ``stmt`` (its parameters inlined), as one string."""
    sql = str(stmt.compile(conn, compile_kwargs={"literal_binds": True}))
    explain = "EXPLAIN QUERY PLAN " if conn.dialect.name == "sqlite" else "EXPLAIN "
    return " ".join(str(part) for row in conn.execute(text(explain + sql)) for part in row)


def _predicate(conn: Any) -> str:
    """The lease suspects' index's predicate as the database keeps it."""
    if conn.dialect.name == "sqlite":
        sql = "SELECT sql FROM sqlite_master WHERE name = 'ix_request_records_lease_suspects'"
    else:
        sql = "SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_request_records_lease_suspects'"
    return str(conn.execute(text(sql)).scalar()).partition(" WHERE ")[2]


def _model_predicate(conn: Any) -> str:
    """The same index built from the models (``store.models``), under another name, as kept."""
    index = next(
        ix for ix in RequestRecord.__table__.indexes if ix.name == "ix_request_records_lease_suspects"
    )
    ddl = str(CreateIndex(index).compile(dialect=conn.dialect)).replace(index.name, "ix_model_twin")
    conn.execute(text(ddl))
    try:
        name = "'ix_model_twin'"
        if conn.dialect.name == "sqlite":
            sql = f"SELECT sql FROM sqlite_master WHERE name = {name}"
        else:
            sql = f"SELECT indexdef FROM pg_indexes WHERE indexname = {name}"
        return str(conn.execute(text(sql)).scalar()).partition(" WHERE ")[2]
    finally:
        conn.execute(text("DROP INDEX ix_model_twin"))


def test_0019_the_controllers_lease_suspects_read_takes_their_partial_index(store_url: str) -> None:
    """The partial index is used only when the query's term implies its predicate (SQLite: is the same
    term), which a change of either side breaks silently: the read falls back to walking every record of
    the window. So the controller's own statement is planned, on a table of many records and few
    suspects; and a downgrade takes the index back."""
    from controller.observe import lease_suspects_query

    upgrade(store_url)
    engine = make_engine(store_url)
    rows = [
        {
            "request_id": f"r{i}",
            "status": "ok",
            "proxy_in": 1000.0 + i / 10,
            "lease_expiry_suspect": not i % 500,
        }
        for i in range(5000)
    ]
    try:
        with engine.begin() as conn:
            conn.execute(insert(RequestRecord), rows)
            conn.execute(text("ANALYZE"))
            plan = _plan(conn, lease_suspects_query(1100.0, 1400.0))
            got = conn.execute(lease_suspects_query(1100.0, 1400.0)).all()
            predicates = _predicate(conn), _model_predicate(conn)
        assert "ix_request_records_lease_suspects" in plan, plan
        assert predicates[0] == predicates[1] != ""  # the models create the migration's index
        assert sorted(r.proxy_in for r in got) == [1100.0, 1150.0, 1200.0, 1250.0, 1300.0, 1350.0, 1400.0]
    finally:
        engine.dispose()
    downgrade(store_url, "0018")
    engine = make_engine(store_url)
    try:
        names = {ix["name"] for ix in inspect(engine).get_indexes("request_records")}
    finally:
        engine.dispose()
    assert "ix_request_records_lease_suspects" not in names
