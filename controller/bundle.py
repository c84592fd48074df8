"""Incident bundles: read a window from the store, pack it, write one archive atomically; and the
background writer that does so when an alert starts firing.

:func:`write_bundle` is the whole of one bundle: the window's tables (:func:`read_window`, bounded
by ``max_records``), the SLO-miss attribution (:func:`controller.attribution.window_attribution`),
the policy configs and the Settings in force, the report (:mod:`controller.bundlereport`), packed
under ``max_bytes`` (:mod:`controller.bundlepack`) and written as ``<dir>/<name>``: a temporary
file in the same folder, fsynced, then renamed over the name, so a reader sees the whole archive or
none; on any failure the temporary file is removed. Errors (the tree)::

    BundleError            a bundle cannot be written; retrying the same will fail the same way
    ├── NoData             nothing stored in the range (pdscope bundle refuses an empty bundle)
    └── BundleWriteError   the folder cannot be written (read-only, full): names the folder

``store.StoreError`` passes through (a retry may help).

:class:`BundleWriter` never holds the controller loop: :meth:`BundleWriter.alerts_changed` only
appends a job to a bounded queue (the oldest waiting job is dropped, and counted, when full) and
a daemon thread writes it, then deletes the oldest automatic bundles past ``keep``. A failed
bundle is counted and logged, never raised; the counters are in ``/metrics`` and ``/healthz``.
:meth:`BundleWriter.annotations` tells the alert webhook where an alert's bundle is.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import tarfile
import tempfile
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import IO, Any, Final

from sqlalchemy import ColumnElement, Table, and_, func, or_, select
from sqlalchemy.orm import Session, sessionmaker

from controller.attribution import DEFAULT_RECORDS, MAX_RECORDS, window_attribution
from controller.bundlepack import (
    BundleTooLarge,
    Contents,
    TableRead,
    Trigger,
    alert_bundle_name,
    is_bundle_name,
    pack,
    redact,
)
from controller.bundlereport import ReportInput, render
from controller.effects import Bundler
from controller.notify import take_next
from controller.policy.alerts import AlertState
from controller.replay import ReplayError, replay_window
from pdscope import __version__
from pdscope.config import BundleSettings, Settings
from store.db import transaction
from store.models import Alert, Decision, PolicyConfigRow, RequestRecord, Snapshot, WeightOverride

log = logging.getLogger(__name__)

Clock = Callable[[], float]
STALE_TEMP_S: Final = 3600.0  # a temporary file older than this was left by a crash: deleted
MAX_REFS: Final = 1024  # alerts whose bundle name is remembered for the webhook
REPLAY_TICKS: Final = 1_000  # a bundle checks the replay of at most this many ticks
ATTRIBUTION_MISSES: Final = 100  # the misses with the most excess in attribution.json


class BundleError(Exception):
    """A bundle cannot be written (a permanent problem: the same input fails the same way)."""


class NoData(BundleError):
    """Nothing is stored in the range."""


class BundleWriteError(BundleError):
    """The bundle folder cannot be written: ``folder`` names it."""

    def __init__(self, folder: Path, reason: str) -> None:
        super().__init__(f"cannot write a bundle in {folder}: {reason}")
        self.folder = folder
        self.reason = reason


@dataclass(frozen=True)
class Written:
    path: Path
    bytes: int
    manifest: Mapping[str, Any]


# -- reading the window ---------------------------------------------------------------------------


def _table(model: Any) -> Table:
    t = model.__table__
    assert isinstance(t, Table)
    return t


def _read(
    session: Session, name: str, model: Any, where: ColumnElement[bool], ts: Any, max_rows: int
) -> TableRead:
    """Rows of ``model`` matching ``where``, oldest first; past ``max_rows``, 1 in every k (by id)."""
    total = int(session.scalar(select(func.count()).select_from(model).where(where)) or 0)
    every = -(-total // max_rows) if total > max_rows else 1
    cond = where if every == 1 else and_(where, model.id % every == 0)
    stmt = select(*_table(model).columns).where(cond).order_by(ts, model.id).limit(max_rows)
    rows = [dict(m) for m in session.execute(stmt).mappings()]
    return TableRead(name, rows, total, every)


def read_window(session: Session, lo: float, hi: float, max_rows: int) -> dict[str, TableRead]:
    """The window's tables: what happened in ``lo..hi`` (alerts and overrides active in it)."""
    r, s, d, a, o = RequestRecord, Snapshot, Decision, Alert, WeightOverride
    return {
        "records": _read(
            session, "records", r, and_(r.proxy_in >= lo, r.proxy_in <= hi), r.proxy_in, max_rows
        ),
        "snapshots": _read(session, "snapshots", s, and_(s.ts >= lo, s.ts <= hi), s.ts, max_rows),
        "decisions": _read(session, "decisions", d, and_(d.ts >= lo, d.ts <= hi), d.ts, max_rows),
        "alerts": _read(
            session, "alerts", a, and_(a.active_since <= hi, a.last_eval >= lo), a.active_since, max_rows
        ),
        "overrides": _read(
            session,
            "overrides",
            o,
            and_(
                o.created <= hi,
                or_(o.cleared.is_(None), o.cleared >= lo),
                or_(o.expires.is_(None), o.expires >= lo),
            ),
            o.created,
            max_rows,
        ),
    }


def read_policy_configs(session: Session, hi: float, fingerprints: Iterable[str]) -> list[dict[str, Any]]:
    """The stored policy configs named by the window's decisions, and the newest one stored by ``hi``."""
    p = PolicyConfigRow
    wanted = sorted({f for f in fingerprints if f})
    newest = session.scalars(
        select(p.fingerprint).where(p.first_seen <= hi).order_by(p.first_seen.desc()).limit(1)
    ).first()
    if newest is not None and newest not in wanted:
        wanted.append(newest)
    if not wanted:
        return []
    stmt = select(*_table(p).columns).where(p.fingerprint.in_(wanted)).order_by(p.first_seen)
    return [dict(m) for m in session.execute(stmt).mappings()]


def contents(
    factory: sessionmaker[Session],
    settings: Settings,
    lo: float,
    hi: float,
    *,
    name: str,
    created_at: float,
    trigger: Trigger | None = None,
    limits: BundleSettings | None = None,
    require_data: bool = False,
) -> Contents:
    """Everything the bundle of ``lo..hi`` holds, read now. Raises :class:`NoData` when
    ``require_data`` and the range holds no record, snapshot, decision or alert."""
    lim = limits or settings.controller.bundles
    with transaction(factory) as session:
        tables = read_window(session, lo, hi, lim.max_records)
        policies = read_policy_configs(
            session, hi, (str(x.get("policy") or "") for x in tables["decisions"].rows)
        )
    if require_data and not any(tables[t].total for t in ("records", "snapshots", "decisions", "alerts")):
        raise NoData("no request record, snapshot, decision or alert is stored in the range")
    limit = min(max(lim.max_records, DEFAULT_RECORDS), MAX_RECORDS)
    attribution = window_attribution(factory, settings, lo, hi, limit=limit)
    attr = attribution.as_dict(max_misses=ATTRIBUTION_MISSES)
    notes = []
    used = sorted({str(x.get("policy")) for x in tables["decisions"].rows if x.get("policy")})
    if len(used) > 1:
        notes.append(f"the policy config changed in the window: decisions ran under {', '.join(used)}")
    if attribution.truncated:
        notes.append(f"attribution: only the newest {attribution.limit} request records were attributed")
    notes.append(replay_note(factory, lo, hi))

    def report(cut: Sequence[str]) -> str:
        return render(
            ReportInput(
                name=name,
                lo=lo,
                hi=hi,
                created_at=created_at,
                attribution=attr,
                records=tables["records"].rows,
                decisions=tables["decisions"].rows,
                alerts=tables["alerts"].rows,
                ttft_target_s=settings.slo.ttft.target_ms / 1000.0,
                trigger=None if trigger is None else trigger.as_dict(),
                notes=cut,
            )
        )

    return Contents(
        name=name,
        lo=lo,
        hi=hi,
        created_at=created_at,
        trigger=trigger,
        tables=[tables[t] for t in ("alerts", "decisions", "overrides", "records", "snapshots")],
        report=report,
        attribution=attr,
        settings=redact(settings.model_dump(mode="json")),
        policy_configs=policies,
        max_records=lim.max_records,
        max_bytes=lim.max_bytes,
        notes=notes,
        version=__version__,
    )


def replay_note(factory: sessionmaker[Session], lo: float, hi: float) -> str:
    """Whether the stored config reproduces the window's decisions (``pdscope replay``), in one line."""
    try:
        with transaction(factory) as session:
            r = replay_window(session, lo, hi, max_ticks=REPLAY_TICKS)
    except ReplayError as exc:
        return f"replay: not checked: {exc}"
    if r.reproduced:
        return f"replay: the stored config reproduces the window's {r.ticks} ticks exactly (pdscope replay)"
    return f"replay: the stored config does NOT reproduce the window: {r.mismatch_count} mismatch(es)"


# -- writing the archive --------------------------------------------------------------------------


def _write_tar(fileobj: IO[bytes], members: Sequence[tuple[str, bytes]], mtime: float) -> None:
    with tarfile.open(fileobj=fileobj, mode="w:gz") as tar:
        for path, data in members:
            info = tarfile.TarInfo(path)
            info.size = len(data)
            info.mtime = int(mtime)
            info.mode = 0o644
            tar.addfile(info, BytesIO(data))


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform without directory fds: the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _reason(exc: OSError) -> str:
    if exc.errno == errno.ENOSPC:
        return "no space left on the device"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "it is read-only or not writable by this user"
    return exc.strerror or str(exc)


def write_archive(folder: Path, name: str, members: Sequence[tuple[str, bytes]], mtime: float) -> Path:
    """``folder/name``, written atomically (temporary file in ``folder``, fsync, rename); nothing is
    left behind on failure. Raises :class:`BundleWriteError` naming the folder."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise BundleWriteError(folder, _reason(exc)) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            _write_tar(f, members, mtime)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / name)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            raise BundleWriteError(folder, _reason(exc)) from exc
        raise
    _fsync_dir(folder)
    return folder / name


def write_bundle(
    factory: sessionmaker[Session],
    settings: Settings,
    lo: float,
    hi: float,
    folder: Path,
    *,
    name: str,
    trigger: Trigger | None = None,
    limits: BundleSettings | None = None,
    clock: Clock = time.time,
    require_data: bool = False,
) -> Written:
    """Read, pack and write the bundle of ``lo..hi`` as ``folder/name``. Blocks (store reads, disk).
    Raises :class:`BundleError` (:class:`NoData`, :class:`BundleWriteError`) or ``StoreError``."""
    now = clock()
    c = contents(
        factory,
        settings,
        lo,
        hi,
        name=name,
        created_at=now,
        trigger=trigger,
        limits=limits,
        require_data=require_data,
    )
    try:
        members = pack(c)
    except BundleTooLarge as exc:
        raise BundleError(str(exc)) from exc
    path = write_archive(folder, name, members, now)
    man = json.loads(members[0][1])
    return Written(path, path.stat().st_size, man)


# -- the folder -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class BundleFile:
    name: str
    bytes: int
    mtime: float


def list_bundles(folder: Path) -> list[BundleFile]:
    """The bundles in ``folder``, newest first (none when it does not exist)."""
    out = []
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return []
    for e in entries:
        if is_bundle_name(e.name) and e.is_file(follow_symlinks=False):
            st = e.stat(follow_symlinks=False)
            out.append(BundleFile(e.name, st.st_size, st.st_mtime))
    return sorted(out, key=lambda b: (b.mtime, b.name), reverse=True)


class BundleRefused(Exception):
    """A bundle that is not served: ``reason`` is ``bad_name``, ``symlink``, ``not_a_file`` or ``missing``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def open_bundle(folder: Path, name: str) -> tuple[IO[bytes], int]:
    """Open bundle ``name`` for reading: (file, size). Only a regular file directly in ``folder`` is
    opened: a name this module would not make (a path, ``..``, absolute), a symlink (even one to a
    file inside), a FIFO or folder raise :class:`BundleRefused`. The name is opened relative to the
    folder without following a link (``O_NOFOLLOW``), and what was opened is checked, so a file
    swapped for a link between a check and the open is never served. Blocks on the disk only."""
    if not is_bundle_name(name) or "/" in name or os.sep in name:
        raise BundleRefused("bad_name")
    try:
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        raise BundleRefused("missing") from None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError as exc:
        raise BundleRefused("symlink" if exc.errno == errno.ELOOP else "missing") from None
    finally:
        os.close(dir_fd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise BundleRefused("not_a_file")
    return os.fdopen(fd, "rb"), st.st_size


def prune(folder: Path, keep: int, now: float) -> list[str]:
    """Delete the oldest automatic bundles past the newest ``keep`` (a range bundle, written on demand,
    is left alone), and temporary files a crash left. The names deleted."""
    auto = [b for b in list_bundles(folder) if not b.name.startswith("pdscope-range-")]
    gone = []
    for b in auto[keep:]:
        try:
            (folder / b.name).unlink()
            gone.append(b.name)
        except FileNotFoundError:
            pass
    for e in os.scandir(folder):
        if e.name.startswith(".pdscope-") and e.name.endswith(".tmp"):
            try:
                if now - e.stat(follow_symlinks=False).st_mtime > STALE_TEMP_S:
                    os.unlink(e.path)
            except FileNotFoundError:
                pass
    return gone


# -- the background writer ------------------------------------------------------------------------


@dataclass(frozen=True)
class BundleJob:
    name: str
    lo: float
    hi: float
    trigger: Trigger


class NullBundler:
    """Bundles are off (``controller.bundles.enabled`` false)."""

    folder: Path | None = None

    def __init__(self) -> None:
        self.written = self.failed = self.dropped = 0
        self.last_error: str | None = None

    def alerts_changed(self, alerts: Sequence[AlertState]) -> None:
        return None

    def annotations(self, alert: AlertState) -> dict[str, str]:
        return {}

    @property
    def pending(self) -> int:
        return 0

    def close(self, timeout: float = 5.0) -> None:
        return None


def trigger_of(st: AlertState) -> Trigger:
    fired = st.fired_at if st.fired_at is not None else st.last_eval
    return Trigger(
        st.rule,
        st.fingerprint,
        dict(st.labels),
        st.severity,
        st.description,
        st.value,
        st.active_since,
        fired,
    )


class BundleWriter:
    """Writes a bundle from a daemon thread when one of ``cfg.rules`` starts firing."""

    def __init__(
        self,
        settings: Settings,
        factory: sessionmaker[Session],
        *,
        cfg: BundleSettings | None = None,
        clock: Clock = time.time,
        url_base: str | None = None,
    ) -> None:
        self.settings = settings
        self.factory = factory
        self.cfg = cfg or settings.controller.bundles
        self.folder: Path | None = Path(self.cfg.dir).resolve()
        self.clock = clock
        self.url_base = url_base.rstrip("/") if url_base else None
        self.written = self.failed = self.dropped = 0
        self.last_error: str | None = None
        self.last_written: str | None = None
        self._rules = frozenset(self.cfg.rules)
        self._queue: deque[BundleJob] = deque()
        self._refs: OrderedDict[str, tuple[str, str]] = OrderedDict()  # fingerprint -> (name, status)
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pdscope-bundles", daemon=True)
        self._thread.start()

    def alerts_changed(self, alerts: Sequence[AlertState]) -> None:
        """Queue a bundle for each of ``alerts`` that just started firing. Never blocks, never raises."""
        try:
            for st in alerts:
                if st.state == "firing" and st.rule in self._rules:
                    self._enqueue(st)
        except Exception:  # the loop must never fail on a bundle
            log.exception("bundle: cannot queue a bundle")

    def _enqueue(self, st: AlertState) -> None:
        t = trigger_of(st)
        job = BundleJob(
            alert_bundle_name(t.rule, t.labels, t.fired_at), t.fired_at - self.cfg.window_s, t.fired_at, t
        )
        with self._cond:
            if self._closed:
                self.dropped += 1
                return
            if len(self._queue) >= self.cfg.queue_max:
                old = self._queue.popleft()
                self.dropped += 1
                self._mark(old.trigger.fingerprint, old.name, "dropped")
                log.warning("bundle: queue full, dropped %s", old.name)
            self._queue.append(job)
            self._mark(st.fingerprint, job.name, "queued")
            self._cond.notify()

    def _mark(self, fingerprint: str, name: str, status: str) -> None:
        ref = self._refs.get(fingerprint)
        if status != "queued" and ref is not None and ref[0] != name:
            return  # a newer bundle for the same alert is already named
        self._refs[fingerprint] = (name, status)
        self._refs.move_to_end(fingerprint)
        while len(self._refs) > MAX_REFS:
            self._refs.popitem(last=False)

    def annotations(self, alert: AlertState) -> dict[str, str]:
        """The webhook annotations saying where ``alert``'s bundle is (or that it failed); {} for none."""
        with self._cond:
            ref = self._refs.get(alert.fingerprint)
        if ref is None or self.folder is None:
            return {}
        name, status = ref
        if status in ("failed", "dropped"):
            return {"bundle_error": f"the bundle {name} was {status}: see the controller's log"}
        out = {"bundle": str(self.folder / name), "bundle_name": name}
        if self.url_base:
            out["bundle_url"] = f"{self.url_base}/{name}"
        return out

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + (1 if self._busy else 0)

    def _run(self) -> None:
        while True:
            with self._cond:
                job = take_next(self._cond, self._queue, lambda: self._closed)
                if job is None:
                    return
                self._busy = True
            try:
                self._write(job)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, job: BundleJob) -> None:
        assert self.folder is not None
        try:
            w = write_bundle(
                self.factory,
                self.settings,
                job.lo,
                job.hi,
                self.folder,
                name=job.name,
                trigger=job.trigger,
                limits=self.cfg,
                clock=self.clock,
            )
        except Exception as exc:
            with self._cond:
                self.failed += 1
                self.last_error = f"{job.name}: {type(exc).__name__}: {exc}"
                self._mark(job.trigger.fingerprint, job.name, "failed")
            log.warning("bundle %s failed: %s", job.name, exc)
            return
        with self._cond:
            self.written += 1
            self.last_written = job.name
            self.last_error = None
            self._mark(job.trigger.fingerprint, job.name, "written")
        try:
            gone = prune(self.folder, self.cfg.keep, time.time())
        except OSError as exc:  # the bundle is whole; only the old ones stay a while longer
            gone = []
            log.warning("bundle: cannot delete old bundles in %s: %s", self.folder, exc)
        log.info(
            "bundle %s written (%s bytes%s)", w.path, w.bytes, f", {len(gone)} old deleted" if gone else ""
        )

    def wait_idle(self, timeout: float) -> bool:
        """True once nothing is queued or being written (for shutdown and tests)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (up to ``timeout``) and stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)


def make_bundler(
    settings: Settings,
    factory: sessionmaker[Session],
    *,
    clock: Clock = time.time,
    url_base: str | None = None,
) -> Bundler:
    """A :class:`BundleWriter` when ``controller.bundles.enabled``, else a :class:`NullBundler`."""
    if not settings.controller.bundles.enabled:
        return NullBundler()
    return BundleWriter(settings, factory, clock=clock, url_base=url_base)
