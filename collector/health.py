"""Liveness of the collector's background tasks, and logs that do not flood.

Each background task (the span writer, the scraper, the snapshot writer, maintenance)
is registered in ``TaskHealth`` with a bound: it calls ``beat(name)`` on every turn of
its loop, and ``/healthz`` answers 503 when a task has not beaten within its bound
(stuck: a store call that never returns) or has ended while the collector runs (dead).
A failing turn is caught by the task itself, counted and logged through
``RateLimitedLog``: the first of a kind at once, then at most one line per period with
how many were left out. ``Tally`` aggregates routine refusals (one line per period with
counts by reason; each one at DEBUG).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

LOG_PERIOD_S = 60.0


@dataclass
class _Task:
    stall_after_s: float
    last_beat: float
    dead: str | None = None
    errors: int = 0
    last_error: str | None = None


class TaskHealth:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._tasks: dict[str, _Task] = {}
        self._store_error: tuple[float, str] | None = None  # since when writes fail, and the last why

    def store(self, ok: bool, why: str = "") -> None:
        """A write to the store succeeded, or failed (``why``): ``/healthz`` says the store is down
        while writes fail (200 still: restarting the collector would not bring the store back)."""
        if ok:
            self._store_error = None
        elif self._store_error is None:
            self._store_error = (self.clock(), why[:300])
        else:
            self._store_error = (self._store_error[0], why[:300])

    def store_report(self) -> dict[str, Any]:
        if self._store_error is None:
            return {"state": "ok"}
        since, why = self._store_error
        return {"state": "failing", "for_s": round(self.clock() - since, 3), "last_error": why}

    def register(self, name: str, stall_after_s: float) -> None:
        self._tasks[name] = _Task(stall_after_s, self.clock())

    def beat(self, name: str) -> None:
        task = self._tasks.get(name)
        if task is not None:
            task.last_beat = self.clock()

    def error(self, name: str, exc: BaseException) -> None:
        task = self._tasks.get(name)
        if task is not None:
            task.errors += 1
            task.last_error = f"{type(exc).__name__}: {exc}"[:300]

    def died(self, name: str, why: str) -> None:
        task = self._tasks.get(name)
        if task is not None:
            task.dead = why[:300]

    def report(self) -> tuple[bool, dict[str, Any]]:
        """(all healthy, per task: state, seconds since its last beat, errors, last error)."""
        now = self.clock()
        ok = True
        out: dict[str, Any] = {}
        for name, t in self._tasks.items():
            age = now - t.last_beat
            if t.dead is not None:
                state = "dead"
            elif age > t.stall_after_s:
                state = "stuck"
            else:
                state = "ok"
            ok = ok and state == "ok"
            entry: dict[str, Any] = {"state": state, "since_beat_s": round(age, 3), "errors": t.errors}
            if t.dead is not None:
                entry["died"] = t.dead
            if t.last_error is not None:
                entry["last_error"] = t.last_error
            out[name] = entry
        return ok, out


class RateLimitedLog:
    """Warnings by key: the first at once, then one per ``period_s`` saying how many were skipped."""

    def __init__(
        self,
        logger: logging.Logger,
        period_s: float = LOG_PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.period_s = period_s
        self.clock = clock
        self._last: dict[str, float] = {}
        self._skipped: Counter[str] = Counter()
        self._lock = threading.Lock()

    def warning(self, key: str, msg: str, *args: object, exc_info: BaseException | None = None) -> bool:
        """Log unless ``key`` was logged within the period; True when it was logged."""
        now = self.clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.period_s:
                self._skipped[key] += 1
                return False
            self._last[key] = now
            skipped = self._skipped.pop(key, 0)
        if skipped:
            msg += " (%d more like it in the last %gs)"
            args = (*args, skipped, self.period_s)
        self.logger.warning(msg, *args, exc_info=exc_info)
        return True


class Tally:
    """Counts of routine events by reason, logged as one INFO line per period; each at DEBUG."""

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        period_s: float = LOG_PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.what = what
        self.period_s = period_s
        self.clock = clock
        self._counts: Counter[str] = Counter()
        self._since = clock()
        self._lock = threading.Lock()

    def note(self, reason: str, detail: str = "", n: int = 1) -> None:
        if detail:
            self.logger.debug("%s (%s): %s", self.what, reason, detail)
        with self._lock:
            self._counts[reason] += n
        self.flush()

    def flush(self, force: bool = False) -> None:
        now = self.clock()
        with self._lock:
            if not self._counts or (not force and now - self._since < self.period_s):
                return
            counts, self._counts = self._counts, Counter()
            elapsed, self._since = now - self._since, now
        summary = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
        self.logger.info("%s in the last %.0fs: %s", self.what, elapsed, summary)
