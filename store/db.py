"""One engine and session factory for every pdscope service.

SQLite is opened in WAL mode with a busy timeout, so one writer (the collector or the
controller) and several readers (the dashboard, the controller) work at once without
"database is locked". PostgreSQL URLs get the psycopg 3 driver.

Errors from the database driver are translated to :class:`StoreError` at this
boundary, with the URL's password hidden.
"""

from __future__ import annotations

import functools
import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

SQLITE_BUSY_TIMEOUT_MS = 10_000

# PostgreSQL's json type rejects NaN and Infinity; refuse them on SQLite too, so a bad
# value fails the same way on both stores instead of only in production.
_json_dumps = functools.partial(json.dumps, allow_nan=False, separators=(",", ":"))


class StoreError(Exception):
    """The store cannot be opened or used. A retry may help if the database was busy or down."""


def normalize_url(url: str) -> str:
    """Pick pdscope's drivers: psycopg 3 for PostgreSQL."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def _sqlite_pragmas(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def make_engine(url: str, **kwargs: Any) -> Engine:
    """Create an engine for ``url`` (``sqlite:///file.db`` or ``postgresql://...``)."""
    try:
        parsed = make_url(normalize_url(url))
    except ArgumentError as exc:
        raise StoreError(f"invalid store URL {url!r}: {exc}") from exc
    kwargs.setdefault("json_serializer", _json_dumps)
    if parsed.get_backend_name() == "sqlite":
        connect_args = {"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000, "check_same_thread": False}
        engine = create_engine(parsed, connect_args=connect_args, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    try:
        return create_engine(parsed, **kwargs)
    except (SQLAlchemyError, ImportError) as exc:
        raise StoreError(f"cannot open store {parsed.render_as_string(hide_password=True)}: {exc}") from exc


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def opened(url: str) -> Iterator[sessionmaker[Session]]:
    """Sessions on an engine of their own for ``url``, disposed of on the way out (a command's store)."""
    engine = make_engine(url)
    try:
        yield session_factory(engine)
    finally:
        engine.dispose()


@contextmanager
def transaction(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session that commits on success and rolls back on error (translated to StoreError)."""
    session = factory()
    try:
        yield session
        session.commit()
    except SQLAlchemyError as exc:
        session.rollback()
        raise StoreError(str(exc).splitlines()[0]) from exc
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
