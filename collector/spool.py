"""The collector's spool: every accepted span batch is kept here until the store has it.

A 2xx from ``POST /v1/traces`` means the spans are in the spool; the span writer takes them out
in order, oldest first, and gives them back (``ack``) only once the store has them. When the
store is down or locked, the writer retries the oldest batch and nothing is dropped: the spool
grows until its bound, and past the bound the receiver answers 503 with ``Retry-After`` so that
OTLP exporters retry (OTLP/HTTP says 503 is retryable). A span written twice (a batch replayed
after a crash between the store's commit and the ack) is counted once by the sink.

Two kinds, one class:

- **on disk** (``directory`` set): each batch is appended as one record to the active segment
  file ``seg-<n>.log`` before the answer: ``PDS1 | payload length (u32) | CRC-32 (u32) |
  payload`` where the payload is the JSON of ``{"t": accepted_at, "s": [spans]}``. fsync policy:
  ``always`` fsyncs the segment before the 2xx (a batch answered 2xx survives a host crash);
  ``never`` leaves it to the OS (it survives the collector's crash or kill, not the host's).
  The ack position goes to ``acked`` (written to a temporary file, then renamed); a segment
  wholly acked is deleted. A restart reads every record past ``acked`` back; a record whose
  magic, length or CRC is wrong ends its segment there: the rest of that segment is skipped
  and counted (``corrupt``), the file is cut at the last good record, and the collector
  starts. Up to ``max_memory_spans`` pending spans are also held decoded in memory, so the
  writer does not read them back; past that (a long outage) they are read from disk.
  One process per folder: ``open`` takes an exclusive ``flock`` on ``<dir>/lock``.
- **in memory** (``directory`` None): the same bounds and order, lost if the process stops.

Bounds, checked before a batch is accepted: ``max_bytes`` of pending records (on disk; in
memory, ``max_memory_spans`` spans) and ``max_age_s`` for the oldest pending batch (a store
that has been gone that long: refuse rather than grow without end). Disk use may exceed
``max_bytes`` by up to one segment (acked records wait for their segment to be deleted).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

from collector.otlp import SpanData, SpanEvent
from pdscope.jsonsafe import plain

log = logging.getLogger(__name__)

MAGIC = b"PDS1"
_HEADER = struct.Struct("<4sII")  # magic, payload length, CRC-32 of the payload
MAX_RECORD_BYTES = 512 * 2**20  # a length past this is a corrupt header, not a record
SEGMENT_PREFIX, SEGMENT_SUFFIX = "seg-", ".log"
ACKED_FILE, LOCK_FILE = "acked", "lock"
Fsync = Literal["always", "never"]


class SpoolFull(Exception):
    """No room for the batch now: ``reason`` is ``spool_full`` (bytes or spans) or ``spool_age``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class SpoolLocked(RuntimeError):
    """Another process holds the spool folder."""


@dataclass(frozen=True)
class SpoolConfig:
    directory: Path | None = None  # None: in memory only
    max_bytes: int = 1 * 2**30
    max_age_s: float = 3600.0
    max_memory_spans: int = 200_000
    segment_bytes: int = 64 * 2**20
    fsync: Fsync = "always"


@dataclass(frozen=True)
class _Loc:
    segment: int
    offset: int
    length: int  # the whole record, header included


@dataclass
class Entry:
    """One accepted batch, pending until the store has it."""

    accepted_at: float
    count: int
    nbytes: int
    spans: list[SpanData] | None  # None: on disk only (recovered at start, or past the memory bound)
    loc: _Loc | None = None
    attempts: int = 0  # failed writes so far
    recovered: bool = False  # read back from disk at start
    held: bool = False  # counted in the spool's spans held in memory


@dataclass
class Recovery:
    """What ``open`` found on disk."""

    batches: int = 0
    spans: int = 0
    corrupt: int = 0  # records (or segment tails) skipped
    notes: list[str] = field(default_factory=list)


def _row(s: SpanData) -> dict[str, Any]:
    return {
        "trace_id": s.trace_id,
        "span_id": s.span_id,
        "parent_span_id": s.parent_span_id,
        "name": s.name,
        "service": s.service,
        "kind": s.kind,
        "start_ts": s.start_ts,
        "end_ts": s.end_ts,
        "status_code": s.status_code,
        "attributes": s.attributes,
        "events": [[e.name, e.ts, e.attributes] for e in s.events],
        "sender": s.sender,
    }


def encode_spans(spans: Sequence[SpanData], accepted_at: float) -> bytes:
    """One record's payload. A value JSON has no exact form for is kept as near as it can be: an int
    past 64 bits as a float, a non-finite float as null, anything else as its text."""
    doc = {"t": accepted_at, "s": [_row(s) for s in spans]}
    try:
        return orjson.dumps(doc)
    except TypeError:
        return orjson.dumps(plain(doc))


def _span(d: dict[str, Any]) -> SpanData:
    events = tuple(SpanEvent(str(e[0]), float(e[1]), dict(e[2])) for e in d.get("events") or ())
    return SpanData(**{**d, "events": events})


def decode_spans(payload: bytes) -> tuple[float, list[SpanData]]:
    """(accepted_at, spans) of one record's payload; raises ValueError/TypeError/KeyError if it is not one."""
    doc = orjson.loads(payload)
    return float(doc["t"]), [_span(d) for d in doc["s"]]


def _record(payload: bytes) -> bytes:
    return _HEADER.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


def _segment_name(n: int) -> str:
    return f"{SEGMENT_PREFIX}{n:012d}{SEGMENT_SUFFIX}"


def _segments(directory: Path) -> list[int]:
    out = []
    for p in directory.iterdir():
        name = p.name
        if name.startswith(SEGMENT_PREFIX) and name.endswith(SEGMENT_SUFFIX):
            with contextlib.suppress(ValueError):
                out.append(int(name[len(SEGMENT_PREFIX) : -len(SEGMENT_SUFFIX)]))
    return sorted(out)


def read_segment(path: Path, start: int) -> tuple[list[tuple[int, int, bytes]], int, bool]:
    """The good records of a segment from ``start``: [(offset, length, payload)], the offset where
    good records end, and whether something bad (a torn or corrupt record) was found there."""
    data = path.read_bytes()
    out: list[tuple[int, int, bytes]] = []
    pos = start
    while pos < len(data):
        if len(data) - pos < _HEADER.size:
            return out, pos, True
        magic, n, crc = _HEADER.unpack_from(data, pos)
        end = pos + _HEADER.size + n
        if magic != MAGIC or n > MAX_RECORD_BYTES or end > len(data):
            return out, pos, True
        payload = data[pos + _HEADER.size : end]
        if zlib.crc32(payload) != crc:
            return out, pos, True
        out.append((pos, end - pos, payload))
        pos = end
    return out, pos, False


def _lock(d: Path) -> int:
    """Take ``d``'s lock file (made if missing) without waiting; its descriptor. A closing spool that
    leaves nothing deletes the file it holds, so a lock taken on a file that is no longer the one at
    the path is let go and taken again: two processes never hold two different files."""
    path = d / LOCK_FILE
    for _ in range(3):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SpoolLocked(f"spool folder {d} is in use by another collector process") from None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise SpoolLocked(f"spool folder {d} is being closed by another collector process")


class Spool:
    """Pending span batches, oldest first. Thread-safe: appends run in worker threads."""

    def __init__(self, config: SpoolConfig | None = None, clock: Callable[[], float] = time.time) -> None:
        self.cfg = config or SpoolConfig()
        self.clock = clock
        self._entries: deque[Entry] = deque()
        self._lock = threading.Lock()
        self.pending_bytes = 0
        self.pending_spans = 0
        self.memory_spans = 0
        self.corrupt = 0
        self.refusing = False  # the last export was refused (cleared by the next one kept, or an ack)
        self.ready: Any = None  # the writer's asyncio.Event: the receiver sets it, on the loop, after append
        self._active: int | None = None  # the segment appended to
        self._fd: int | None = None
        self._active_size = 0
        self._lock_fd: int | None = None
        self._acked: tuple[int, int] = (0, 0)

    @classmethod
    def memory(cls, max_spans: int, clock: Callable[[], float] = time.time) -> Spool:
        return cls(SpoolConfig(max_memory_spans=max_spans), clock)

    @property
    def durable(self) -> bool:
        return self.cfg.directory is not None

    def __len__(self) -> int:
        return self.pending_spans

    @property
    def batches(self) -> int:
        return len(self._entries)

    def oldest_age_s(self) -> float:
        with self._lock:
            first = self._entries[0] if self._entries else None
        return max(0.0, self.clock() - first.accepted_at) if first else 0.0

    # --- opening and closing (on disk) -----------------------------------------------------

    def open(self) -> Recovery:
        """Take the folder's lock and read back what a previous process left. Raises SpoolLocked
        or OSError (the folder cannot be made or read)."""
        rec = Recovery()
        d = self.cfg.directory
        if d is None:
            return rec
        d.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock(d)
        self._acked = self._read_acked(d, rec)
        for n in _segments(d):
            self._recover_segment(d, n, rec)
        self.corrupt += rec.corrupt
        last = max(_segments(d), default=self._acked[0])
        self._start_segment(last + 1)
        return rec

    @staticmethod
    def _read_acked(d: Path, rec: Recovery) -> tuple[int, int]:
        try:
            doc = orjson.loads((d / ACKED_FILE).read_bytes())
            return int(doc["segment"]), int(doc["offset"])
        except FileNotFoundError:
            return 0, 0
        except (OSError, ValueError, TypeError, KeyError) as exc:
            rec.notes.append(f"ack position unreadable ({exc}): replaying every segment")
            return 0, 0

    def _recover_segment(self, d: Path, n: int, rec: Recovery) -> None:
        path = d / _segment_name(n)
        seg, off = self._acked
        if n < seg:
            path.unlink(missing_ok=True)
            return
        start = off if n == seg else 0
        records, good_end, bad = read_segment(path, start)
        for offset, length, payload in records:
            try:
                accepted_at, spans = decode_spans(payload)
            except (ValueError, TypeError, KeyError):
                rec.corrupt += 1
                continue
            self._push(Entry(accepted_at, len(spans), length, None, _Loc(n, offset, length), recovered=True))
            rec.batches += 1
            rec.spans += len(spans)
        if bad:
            rec.corrupt += 1
            rec.notes.append(f"{path.name}: a torn or corrupt record at byte {good_end}; the rest skipped")
            with open(path, "r+b") as f:
                f.truncate(good_end)

    def _start_segment(self, n: int) -> None:
        d = self.cfg.directory
        assert d is not None
        if self._fd is not None:
            os.close(self._fd)
        self._fd = os.open(d / _segment_name(n), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._active, self._active_size = n, os.fstat(self._fd).st_size
        if self.cfg.fsync == "always":
            dfd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def close(self) -> None:
        """Close the files and release the folder. A folder with nothing pending is emptied."""
        d = self.cfg.directory
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if d is not None and self._lock_fd is not None:
            if not self._entries:
                for n in _segments(d):
                    (d / _segment_name(n)).unlink(missing_ok=True)
                (d / ACKED_FILE).unlink(missing_ok=True)
                (d / LOCK_FILE).unlink(missing_ok=True)  # held still: an empty folder can go (_lock)
            os.close(self._lock_fd)
            self._lock_fd = None

    # --- accepting -------------------------------------------------------------------------

    def refusal(self, spans: int, nbytes: int = 0) -> SpoolFull | None:
        """Why a batch of ``spans`` spans (about ``nbytes`` bytes) would be refused now, or None."""
        with self._lock:
            return self._refusal(spans, nbytes)

    def _refusal(self, spans: int, nbytes: int) -> SpoolFull | None:
        cfg = self.cfg
        if not self._entries:
            return None  # an empty spool takes any one batch
        age = self.clock() - self._entries[0].accepted_at
        if age > cfg.max_age_s:
            return SpoolFull("spool_age", f"spool's oldest batch waits {age:.0f} s > {cfg.max_age_s:g} s")
        if self.durable and self.pending_bytes + nbytes > cfg.max_bytes:
            return SpoolFull("spool_full", f"spool holds {self.pending_bytes} bytes (max {cfg.max_bytes})")
        if not self.durable and self.pending_spans + spans > cfg.max_memory_spans:
            return SpoolFull(
                "spool_full", f"spool holds {self.pending_spans} spans (max {cfg.max_memory_spans})"
            )
        return None

    def append(self, spans: list[SpanData]) -> None:
        """Keep one accepted batch (on disk: written, and fsynced per policy, before this returns).
        Raises SpoolFull past the bounds, OSError when the disk refuses (nothing is kept then)."""
        if not spans:
            return
        now = self.clock()
        payload = encode_spans(spans, now) if self.durable else b""
        with self._lock:
            refused = self._refusal(len(spans), len(payload))
            if refused is not None:
                self.refusing = True
                raise refused
            self.refusing = False
            loc = self._write(payload) if self.durable else None
            keep = self.memory_spans + len(spans) <= self.cfg.max_memory_spans or not self.durable
            nbytes = loc.length if loc else 0
            self._push(Entry(now, len(spans), nbytes, spans if keep else None, loc))

    def _write(self, payload: bytes) -> _Loc:
        assert self._fd is not None and self._active is not None
        if self._active_size >= self.cfg.segment_bytes:
            self._start_segment(self._active + 1)
        record = _record(payload)
        offset = self._active_size
        written = os.write(self._fd, record)
        if written != len(record):  # a short write (disk full): cut it off, keep nothing
            os.ftruncate(self._fd, offset)
            raise OSError(f"short write to the spool ({written} of {len(record)} bytes)")
        self._active_size += len(record)
        if self.cfg.fsync == "always":
            os.fsync(self._fd)
        return _Loc(self._active, offset, len(record))

    def _push(self, e: Entry) -> None:
        self._entries.append(e)
        self.pending_bytes += e.nbytes
        self.pending_spans += e.count
        if e.spans is not None:
            e.held = True
            self.memory_spans += e.count

    # --- draining --------------------------------------------------------------------------

    def peek(self, max_spans: int) -> list[Entry]:
        """The oldest pending batches, at least one, together at most ``max_spans`` spans (a larger
        first batch comes alone), their spans loaded. A record no longer readable comes with no
        spans and is counted (``corrupt``). Blocking when batches are on disk only."""
        with self._lock:
            head: list[Entry] = []
            total = 0
            for e in self._entries:
                if head and total + e.count > max_spans:
                    break
                head.append(e)
                total += e.count
        for e in head:
            if e.spans is None:
                self._load(e)
        return head

    def _load(self, e: Entry) -> None:
        """Read a batch back from disk; an unreadable one is counted and becomes empty (its ack
        then skips it)."""
        assert e.loc is not None and self.cfg.directory is not None
        path = self.cfg.directory / _segment_name(e.loc.segment)
        try:
            with open(path, "rb") as f:
                f.seek(e.loc.offset)
                raw = f.read(e.loc.length)
            magic, n, crc = _HEADER.unpack_from(raw, 0)
            payload = raw[_HEADER.size :]
            if magic != MAGIC or len(payload) != n or zlib.crc32(payload) != crc:
                raise ValueError("bad record")
            _, spans = decode_spans(payload)
        except (OSError, ValueError, TypeError, KeyError, struct.error) as exc:
            log.error("spool record at %s:%d unreadable, skipped: %r", path.name, e.loc.offset, exc)
            self.corrupt += 1
            e.spans = []
            return
        e.spans = spans

    def ack(self, done: Sequence[Entry]) -> None:
        """The store has these batches (the oldest pending ones, in order): forget them."""
        if not done:
            return
        with self._lock:
            self.refusing = False
            ids = {id(e) for e in done}
            last: _Loc | None = None
            while self._entries and id(self._entries[0]) in ids:
                e = self._entries.popleft()
                self.pending_bytes -= e.nbytes
                self.pending_spans -= e.count
                if e.held:
                    self.memory_spans -= e.count
                e.spans = None
                last = e.loc or last
        if last is not None:
            self._save_acked(last.segment, last.offset + last.length)

    def _save_acked(self, segment: int, offset: int) -> None:
        d = self.cfg.directory
        assert d is not None
        tmp = d / (ACKED_FILE + ".tmp")
        tmp.write_bytes(orjson.dumps({"segment": segment, "offset": offset}))
        os.replace(tmp, d / ACKED_FILE)
        moved_on = segment > self._acked[0]
        self._acked = (segment, offset)
        if moved_on:  # the folder is listed only when the ack enters a newer segment
            for n in _segments(d):
                if n < segment and n != self._active:
                    (d / _segment_name(n)).unlink(missing_ok=True)

    def report(self) -> dict[str, Any]:
        return {
            "kind": "disk" if self.durable else "memory",
            "directory": str(self.cfg.directory) if self.cfg.directory else None,
            "batches": self.batches,
            "spans": self.pending_spans,
            "bytes": self.pending_bytes,
            "oldest_age_s": round(self.oldest_age_s(), 3),
            "max_bytes": self.cfg.max_bytes if self.durable else None,
            "max_age_s": self.cfg.max_age_s,
            "corrupt_records": self.corrupt,
        }
