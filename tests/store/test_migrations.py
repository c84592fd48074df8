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
