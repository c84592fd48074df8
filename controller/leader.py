"""Who leads the controller: the leadership locks and the leader epoch, the store's fencing token.

One controller decides at a time (the leader); any other is a standby that serves what the
leader stored (``controller.loop.Reconciler``). The lock says who may lead; the epoch says whose
writes the store takes:

* :class:`PgAdvisoryLock` (PostgreSQL): ``pg_try_advisory_lock`` held on a dedicated connection
  (its own engine without a pool, never a session's), with ``idle_session_timeout`` set to the
  lease. The leader pings that connection every interval (:meth:`PgAdvisoryLock.held`); one that
  stops (killed, paused, cut off) loses its session, and the lock with it, within the lease.
* :class:`FileLock` (a SQLite file): an OS lock (``flock``) on a lock file beside the database,
  named by the database file's identity (device and inode, :func:`lock_path_for`), not by the path
  it was given: a symlink, a hard link or ``./x/../s.db`` to the same file finds the same lock. The
  lock file names the holder's pid. SQLite takes exactly one controller: a second one refuses to
  start (:class:`AlreadyRunning`). The OS drops the lock when the process ends, however it ends.
* :class:`SoleLeader`: always leads (in-memory SQLite, where each process has a store of its own
  that no other process can share; tests).

The epoch is one row of ``controller_leader`` (:class:`store.models.ControllerLeader`).
:func:`claim`, on each takeover, bumps it under the row's write lock, so it waits for an
in-flight tick of the previous leader to commit first. :func:`fence`, first in every tick's
transaction, reads it under a share lock (``FOR SHARE``) and raises :class:`Deposed` when it is
not the caller's, so a deposed leader's tick writes nothing; the share lock keeps a takeover
from landing between the check and the commit.

Errors: :class:`NotLeader` (a write asked of a standby; the API answers 409 naming the leader),
:class:`Deposed` (a ``NotLeader`` found by the fence: the tick is abandoned and the controller
becomes a standby), :class:`AlreadyRunning` (refuse to start; it helps to retry only once the
holder has stopped). Lock I/O failures are not raised: ``acquire`` and ``held`` answer False.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from sqlalchemy import Connection, select, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from store.db import make_engine, normalize_url
from store.models import ControllerLeader

log = logging.getLogger(__name__)

LEADER_ROW = 1
# The session advisory lock's key (per database): one per store, whatever the controller's config.
LOCK_KEY = int.from_bytes(
    hashlib.blake2b(b"pdscope.controller.leader", digest_size=8).digest(), "big", signed=True
)


def lease_for(interval_s: float) -> float:
    """How long a leader that stopped keeps the lock (and a stuck tick its row lock): max(10 s, 5 intervals),
    the same age at which ``/healthz`` calls a controller degraded."""
    return max(10.0, 5.0 * interval_s)


def default_holder(port: int, url: str | None = None) -> str:
    """This process's name as a leader: ``host:port (pid N)``, with `` at <url>`` where the other
    replicas reach its API (:func:`leader_url` reads it back)."""
    name = f"{socket.gethostname()}:{port} (pid {os.getpid()})"
    return name if url is None else f"{name}{_AT}{url}"


_AT = " at "


def leader_url(holder: str) -> str | None:
    """The API address a leader's holder name carries (``... at http://...``), or None."""
    _, at, url = holder.rpartition(_AT)
    return url if at and url.startswith(("http://", "https://")) and " " not in url else None


def advertise_url(host: str, port: int, configured: str | None) -> str:
    """Where the other replicas reach this controller: the configured URL, else ``http://<address>:<port>``
    (``host`` unless it is a wildcard, then the host name's address; loopback when that fails)."""
    if configured:
        return configured.rstrip("/")
    addr = host
    if host in ("0.0.0.0", "::", ""):
        try:
            addr = socket.gethostbyname(socket.gethostname())
        except OSError:
            addr = "127.0.0.1"
    return f"http://[{addr}]:{port}" if ":" in addr else f"http://{addr}:{port}"


@dataclass(frozen=True, slots=True)
class LeaderInfo:
    """The store's leader: the epoch, who took it and when (Unix seconds), and the mode it took over in
    (``advisory``/``enforce``; None: not stored, a leader from before the column). The mode is not part
    of the leader's identity (equality)."""

    epoch: int
    holder: str
    since: float
    mode: str | None = field(default=None, compare=False)

    def as_dict(self) -> dict[str, object]:
        return {"holder": self.holder, "epoch": self.epoch, "since": self.since}


def mode_warning(role: str, configured: str, leader: LeaderInfo | None) -> str | None:
    """What a standby configured in ``configured`` mode says while its leader leads in another (it
    serves the leader's); None when the modes agree, the leader's is not stored, or on the leader."""
    if role != "standby" or leader is None or leader.mode is None or leader.mode == configured:
        return None
    return (
        f"configured mode {configured} differs from the leader's ({leader.mode}, epoch {leader.epoch}): "
        f"serving the leader's mode"
    )


class LeadershipError(Exception):
    """This controller cannot lead or write; ``detail`` says why."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class NotLeader(LeadershipError):
    """A write asked of a standby. ``leader`` is the store's leader as known (None: none yet)."""

    def __init__(self, leader: LeaderInfo | None, detail: str | None = None) -> None:
        if detail is None:
            who = (
                "no leader has taken over yet"
                if leader is None or not leader.holder
                else (f"the leader is {leader.holder} (epoch {leader.epoch})")
            )
            detail = f"this controller is a standby: {who}; send changes to the leader"
        super().__init__(detail)
        self.leader = leader


class Deposed(NotLeader):
    """The fence found another epoch than ``mine`` in the store: this controller is no longer the leader."""

    def __init__(self, mine: int | None, leader: LeaderInfo | None) -> None:
        who = "no leader row" if leader is None else f"{leader.holder or 'nobody'} at epoch {leader.epoch}"
        super().__init__(leader, f"deposed: the store's leader is {who}, not this controller (epoch {mine})")
        self.mine = mine


class AlreadyRunning(LeadershipError):
    """Another controller holds this store's lock (SQLite takes exactly one)."""


# -- the epoch in the store -------------------------------------------------------------------


def _timeouts(session: Session, lease_s: float, *names: str) -> None:
    """PostgreSQL: ``SET LOCAL`` each of ``names`` to the lease for this transaction (nothing on SQLite)."""
    if session.get_bind().dialect.name == "postgresql":
        for name in names:  # a GUC takes no bind parameter; the value is an int we made
            session.execute(text(f"SET LOCAL {name} = {int(lease_s * 1000)}"))


def read_leader(session: Session, *, share: bool = False) -> LeaderInfo | None:
    """The store's leader row (``share``: under a share lock until the transaction ends); None if absent."""
    stmt = select(ControllerLeader).where(ControllerLeader.id == LEADER_ROW)
    if share:
        stmt = stmt.with_for_update(read=True)  # FOR SHARE on PostgreSQL; SQLite has one writer anyway
    row = session.scalars(stmt).one_or_none()
    return None if row is None else LeaderInfo(row.epoch, row.holder, row.since, row.mode)


def claim(
    session: Session, holder: str, now: float, lease_s: float, mode: str | None = None
) -> tuple[LeaderInfo | None, LeaderInfo]:
    """Take the next epoch for ``holder``, leading in ``mode`` (which standbys serve): ``(the previous
    leader, the new one)``. Call it first in the transaction; the caller must hold the leadership lock.
    The update's row lock waits for a tick that holds the row's share lock to commit (at most the lease
    on PostgreSQL, then a ``StoreError``)."""
    _timeouts(session, lease_s, "lock_timeout")
    before = read_leader(session)
    stmt = (
        update(ControllerLeader)
        .where(ControllerLeader.id == LEADER_ROW)
        .values(epoch=ControllerLeader.epoch + 1, holder=holder, since=now, mode=mode)
        .returning(ControllerLeader.epoch)
        .execution_options(synchronize_session=False)
    )
    epoch = session.scalars(stmt).one_or_none()
    if epoch is None:  # a store built without the migration's row
        session.add(ControllerLeader(id=LEADER_ROW, epoch=1, holder=holder, since=now, mode=mode))
        session.flush()
        epoch = 1
    return before, LeaderInfo(int(epoch), holder, now, mode)


def fence(session: Session, mine: int, lease_s: float) -> LeaderInfo:
    """Check, first in a write transaction, that the store's epoch is ``mine``; raises :class:`Deposed`.

    The row stays share-locked until the transaction ends, so no takeover commits in between. On
    PostgreSQL a transaction left idle past the lease (a paused process) is ended by the server, which
    frees the row for the next leader."""
    _timeouts(session, lease_s, "idle_in_transaction_session_timeout", "lock_timeout")
    current = read_leader(session, share=True)
    if current is None or current.epoch != mine:
        raise Deposed(mine, current)
    return current


# -- the locks --------------------------------------------------------------------------------


class Leadership(Protocol):
    """The right to lead. Neither method raises or blocks for long."""

    holder: str

    def acquire(self) -> bool:
        """Try to take the lock now; True when it is held (already, or from now)."""
        ...

    def held(self) -> bool:
        """Is the lock still held? (PostgreSQL: pings its connection; False once lost.)"""
        ...

    def release(self) -> None:
        """Let go of it (idempotent)."""
        ...


class SoleLeader:
    """Always the leader: a store no other process can share (in-memory SQLite), or a test."""

    def __init__(self, holder: str = "sole controller") -> None:
        self.holder = holder

    def acquire(self) -> bool:
        return True

    def held(self) -> bool:
        return True

    def release(self) -> None:
        return None


def lock_path_for(database: Path) -> Path:
    """The controller lock of a SQLite database file: ``.pdscope-controller-<device>-<inode>.lock`` in
    the directory of the file ``database`` resolves to (symlinks followed), created empty first when
    it does not exist (SQLite takes an empty file as an empty database). Every path to one file, hard
    links in that directory included, gives one lock. Raises :class:`LeadershipError` when the file
    cannot be created or read."""
    real = database.resolve()
    try:
        os.close(os.open(real, os.O_RDWR | os.O_CREAT, 0o644))
        st = os.stat(real)
    except OSError as exc:
        raise LeadershipError(f"cannot open the store file {real}: {exc.strerror}") from exc
    return real.with_name(f".pdscope-controller-{st.st_dev}-{st.st_ino}.lock")


class FileLock:
    """SQLite's one controller: an exclusive ``flock`` on the database file's lock
    (:func:`lock_path_for`), taken at construction, or :class:`AlreadyRunning` naming the pid that
    holds it."""

    def __init__(self, database: Path, holder: str) -> None:
        self.holder = holder
        self.database = database
        self.path = lock_path_for(database)
        self._fh: IO[str] | None = None
        self._lock()

    def _lock(self) -> None:
        try:
            fh = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 - held open while it leads
        except OSError as exc:
            raise LeadershipError(f"cannot open the controller lock {self.path}: {exc.strerror}") from exc
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            fh.seek(0)
            who = fh.read().strip() or "pid unknown"
            fh.close()
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise LeadershipError(f"cannot lock {self.path}: {exc.strerror}") from exc
            raise AlreadyRunning(
                f"another controller already runs on {self.database} ({who}; lock {self.path}): a SQLite "
                f"store takes exactly one controller. Stop that one, or use PostgreSQL to run two (one "
                f"leads, one stands by)"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()}, {self.holder}, on {self.database}\n")
        fh.flush()
        self._fh = fh

    def acquire(self) -> bool:
        if self._fh is None:
            try:
                self._lock()
            except LeadershipError:
                return False
        return True

    def held(self) -> bool:
        return self._fh is not None

    def release(self) -> None:
        # The file stays: removing it could race with a starting controller locking it.
        if self._fh is not None:
            fcntl.flock(self._fh.fileno(), fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None


class PgAdvisoryLock:
    """PostgreSQL's leadership: a session advisory lock on a dedicated connection, lost within
    ``lease_s`` of the holder going quiet (``idle_session_timeout``, PostgreSQL 14 and later)."""

    def __init__(self, url: str, holder: str, lease_s: float, *, key: int = LOCK_KEY) -> None:
        self.holder = holder
        self.lease_s = lease_s
        self.key = key
        self._engine = make_engine(url, poolclass=NullPool)  # its connection is never a pooled one
        self._conn: Connection | None = None
        self.backend_pid: int | None = None  # the lock connection's server process (for operators, tests)

    def acquire(self) -> bool:
        if self._conn is not None:
            return self.held()
        conn: Connection | None = None
        try:
            conn = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            self._set_lease(conn)
            got = bool(conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": self.key}).scalar())
            if not got:
                conn.close()
                return False
            self.backend_pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        except SQLAlchemyError as exc:
            log.warning("leadership: cannot try the lock: %s", str(exc).splitlines()[0])
            if conn is not None:
                conn.invalidate()
            return False
        self._conn = conn
        log.info("leadership: lock taken (server pid %s, lease %.0f s)", self.backend_pid, self.lease_s)
        return True

    def _set_lease(self, conn: Connection) -> None:
        try:
            conn.execute(text(f"SET idle_session_timeout = {int(self.lease_s * 1000)}"))
        except SQLAlchemyError as exc:  # PostgreSQL 13: held until the connection drops
            log.warning("leadership: no idle_session_timeout (%s): a paused leader keeps the lock", exc)

    def held(self) -> bool:
        if self._conn is None:
            return False
        try:
            self._conn.execute(text("SELECT 1"))
            return True
        except SQLAlchemyError as exc:
            log.warning("leadership: lock connection lost: %s", str(exc).splitlines()[0])
            self._conn.invalidate()
            self._conn = None
            self.backend_pid = None
            return False

    def release(self) -> None:
        conn, self._conn, self.backend_pid = self._conn, None, None
        if conn is None:
            return
        try:
            conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": self.key})
            conn.close()
        except SQLAlchemyError:
            conn.invalidate()  # the session is gone, and the lock with it

    def close(self) -> None:
        self.release()
        self._engine.dispose()


def open_leadership(url: str, holder: str, lease_s: float) -> Leadership:
    """The leadership for the store at ``url``; raises :class:`AlreadyRunning` (SQLite, held elsewhere)
    or :class:`LeadershipError`."""
    try:
        parsed = make_url(normalize_url(url))
    except ArgumentError as exc:
        raise LeadershipError(f"invalid store URL {url!r}: {exc}") from exc
    backend = parsed.get_backend_name()
    if backend == "postgresql":
        return PgAdvisoryLock(url, holder, lease_s)
    database = parsed.database or ""
    in_memory = (
        database in ("", ":memory:")
        or database.startswith("file::memory:")
        or parsed.query.get("mode") == "memory"
    )
    if backend == "sqlite" and not in_memory:
        return FileLock(Path(database), holder)
    return SoleLeader(holder)
