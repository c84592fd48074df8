"""Failed authentications by client address: counted, logged once per address and window, throttled.

One home for the control API's tokens and the collector's OTLP tokens. A service asks
:meth:`AuthThrottle.blocked` before it compares a token: an address that sent more than
``max_failures`` wrong tokens within one window of ``window_s`` is answered 429 with
``Retry-After`` for ``block_s``, its token never compared. :meth:`AuthThrottle.failed` records a
refusal: every one is counted by reason (``missing``: no bearer token; ``invalid``: a wrong one;
``throttled``: refused unread), only ``invalid`` ones move an address towards a block (a missing
token is no guess), and one WARNING line per address and window says so (the rest of the window
is counted, not logged). At most ``max_sources`` addresses are remembered; the least recently
seen is forgotten first, so memory is bounded whoever connects.

Pure: the clock is injected, no I/O but the log line. Thread-safe (a FastAPI endpoint may run
in a worker thread). :class:`AuthFailureCollector` exposes the counts on a Prometheus registry.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from pdscope.config import AuthThrottleSettings

log = logging.getLogger(__name__)

MISSING, INVALID, THROTTLED = "missing", "invalid", "throttled"
REASONS = (MISSING, INVALID, THROTTLED)


@dataclass
class _Source:
    window_start: float
    failures: int = 0
    logged: bool = False
    blocked_until: float | None = None


class AuthThrottle:
    def __init__(
        self,
        what: str,
        *,
        max_failures: int = 20,
        window_s: float = 60.0,
        block_s: float = 300.0,
        max_sources: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_failures < 1 or window_s <= 0 or block_s <= 0 or max_sources < 1:
            raise ValueError("max_failures, window_s, block_s and max_sources must be positive")
        self.what = what
        self.max_failures, self.window_s, self.block_s = max_failures, window_s, block_s
        self.max_sources = max_sources
        self.clock = clock
        self._sources: OrderedDict[str, _Source] = OrderedDict()
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    @classmethod
    def from_settings(
        cls, what: str, s: AuthThrottleSettings, clock: Callable[[], float] = time.monotonic
    ) -> AuthThrottle:
        return cls(
            what,
            max_failures=s.max_failures,
            window_s=s.window_s,
            block_s=s.block_s,
            max_sources=s.max_sources,
            clock=clock,
        )

    def blocked(self, source: str) -> int | None:
        """Seconds ``source`` must wait (for ``Retry-After``, at least 1), or None when it may try.

        A refusal here is counted as ``throttled``. Never blocks, never raises."""
        now = self.clock()
        with self._lock:
            entry = self._sources.get(source)
            if entry is None or entry.blocked_until is None:
                return None
            if now >= entry.blocked_until:  # served its time: a fresh window
                self._sources[source] = _Source(window_start=now)
                return None
            self._sources.move_to_end(source)
            self._counts[THROTTLED] += 1
            return max(1, math.ceil(entry.blocked_until - now))

    def failed(self, source: str, reason: str) -> None:
        """Record a refused token from ``source`` (``reason``: ``missing`` or ``invalid``)."""
        now = self.clock()
        with self._lock:
            self._counts[reason] += 1
            entry = self._entry(source, now)
            starts_block = False
            if reason == INVALID:
                entry.failures += 1
                if entry.failures > self.max_failures and entry.blocked_until is None:
                    entry.blocked_until = now + self.block_s
                    starts_block = True
            first, entry.logged = not entry.logged, True
        if first:
            log.warning(
                "%s: refused a request from %s (%s token); more from it in the next %gs are counted, "
                "not logged",
                self.what,
                source,
                reason,
                self.window_s,
            )
        if starts_block:
            log.warning(
                "%s: %s sent more than %d wrong tokens in %gs: refused unread (429) for %gs",
                self.what,
                source,
                self.max_failures,
                self.window_s,
                self.block_s,
            )

    def _entry(self, source: str, now: float) -> _Source:
        entry = self._sources.get(source)
        if entry is None or (entry.blocked_until is None and now - entry.window_start >= self.window_s):
            entry = _Source(window_start=now)
            self._sources[source] = entry
            while len(self._sources) > self.max_sources:
                self._sources.popitem(last=False)  # the least recently seen
        self._sources.move_to_end(source)
        return entry

    def counts(self) -> dict[str, int]:
        """Refusals so far by reason (every reason present, zero included)."""
        with self._lock:
            return {r: self._counts[r] for r in REASONS}

    def __len__(self) -> int:
        with self._lock:
            return len(self._sources)


def bearer_failure(authorization: str | None) -> str:
    """Why a refused ``Authorization`` header failed: ``invalid`` (a bearer token, a wrong one) or
    ``missing`` (none, empty, or another scheme)."""
    scheme, _, given = (authorization or "").strip().partition(" ")
    return INVALID if scheme.lower() == "bearer" and given.strip() else MISSING


class AuthFailureCollector(Collector):
    """``<name>_total{reason}`` from an :class:`AuthThrottle`, read at scrape time."""

    def __init__(self, throttle: AuthThrottle, name: str) -> None:
        self.throttle = throttle
        self.name = name

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            self.name,
            "Refused bearer tokens by reason (missing, invalid; throttled: refused unread, 429)",
            labels=["reason"],
        )
        for reason, n in self.throttle.counts().items():
            family.add_metric([reason], n)
        yield family
