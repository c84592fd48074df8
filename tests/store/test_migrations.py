from __future__ import annotations

from sqlalchemy import inspect

from store import Base, make_engine
from store.migrate import check, downgrade, upgrade


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


def test_0013_adds_restarted_at_to_known_instances_and_takes_it_back(store_url: str) -> None:
    """Instances stored before 0013 keep every value and have no restart on record; a downgrade to 0012
    drops only that column."""
    from sqlalchemy import text

    upgrade(store_url, "0012")
    engine = make_engine(store_url)
    insert = text(
        "INSERT INTO instances (name, pool, role, url, labels, first_seen, last_seen)"
        " VALUES ('p0', 'prefill', 'prefill', 'http://p0', '{}', 1.0, 2.0)"
    )
    try:
        with engine.begin() as conn:
            conn.execute(insert)
        upgrade(store_url, "0013")
        with engine.begin() as conn:
            assert tuple(conn.execute(text("SELECT name, restarted_at FROM instances")).one()) == ("p0", None)
            conn.execute(text("UPDATE instances SET restarted_at = 1796000000.5"))
            assert conn.execute(text("SELECT restarted_at FROM instances")).scalar() == 1796000000.5
        downgrade(store_url, "0012")
        cols = {c["name"] for c in inspect(engine).get_columns("instances")}
        assert "restarted_at" not in cols and {"name", "engine_id", "last_seen"} <= cols
        with engine.begin() as conn:
            assert conn.execute(text("SELECT last_seen FROM instances")).scalar() == 2.0
    finally:
        engine.dispose()


def test_0014_adds_kv_identity_to_known_instances_and_takes_it_back(store_url: str) -> None:
    """Instances stored before 0014 keep every value and have no identity on record (None: not reported
    yet); one stored reads back as its JSON; a downgrade to 0013 drops only that column."""
    from sqlalchemy import select, text, update

    from store.models import InstanceRow

    upgrade(store_url, "0013")
    engine = make_engine(store_url)
    insert = text(
        "INSERT INTO instances (name, pool, role, url, labels, restarted_at, first_seen, last_seen)"
        " VALUES ('d0', 'decode', 'decode', 'http://d0', '{}', 5.0, 1.0, 2.0)"
    )
    try:
        with engine.begin() as conn:
            conn.execute(insert)
        upgrade(store_url, "0014")
        ident = {"model": "m", "block_size": "16", "cache_dtype": "auto"}
        with engine.begin() as conn:
            assert tuple(conn.execute(text("SELECT name, kv_identity FROM instances")).one()) == ("d0", None)
            conn.execute(update(InstanceRow).values(kv_identity=ident))
            assert conn.execute(select(InstanceRow.kv_identity)).scalar() == ident
        downgrade(store_url, "0013")
        cols = {c["name"] for c in inspect(engine).get_columns("instances")}
        assert "kv_identity" not in cols and {"name", "restarted_at", "last_seen"} <= cols
        with engine.begin() as conn:
            assert conn.execute(text("SELECT restarted_at FROM instances")).scalar() == 5.0
    finally:
        engine.dispose()


def test_0015_adds_the_handoff_to_stored_records_and_takes_it_back(store_url: str) -> None:
    """Records stored before 0015 keep every value and have no handoff on record; a downgrade to 0014
    drops only that column."""
    from sqlalchemy import text

    upgrade(store_url, "0014")
    engine = make_engine(store_url)
    insert = text(
        "INSERT INTO request_records"
        " (request_id, status, retries, proxy_in, lease_expiry_suspect, attributes, route_path)"
        " VALUES ('old', 'ok', 0, 1.0, false, '{}', 'pd')"
    )
    try:
        with engine.begin() as conn:
            conn.execute(insert)
        upgrade(store_url, "0015")
        with engine.begin() as conn:
            assert tuple(conn.execute(text("SELECT request_id, handoff FROM request_records")).one()) == (
                "old",
                None,
            )
            conn.execute(text("UPDATE request_records SET handoff = 'push_early'"))
            assert conn.execute(text("SELECT handoff FROM request_records")).scalar() == "push_early"
        downgrade(store_url, "0014")
        cols = {c["name"] for c in inspect(engine).get_columns("request_records")}
        assert "handoff" not in cols and {"request_id", "route_path"} <= cols
        with engine.begin() as conn:
            assert conn.execute(text("SELECT route_path FROM request_records")).scalar() == "pd"
    finally:
        engine.dispose()
