"""The collectors sharing one store, and this collector's share of the scrape targets.

On PostgreSQL several collectors may run against one store; they split the instances of the
config between them. Each keeps a row in the ``collectors`` table (``store.models.
CollectorMember``): at the start of every scrape round it upserts its heartbeat and reads the
ids heard from within the liveness window, ``LIVE_INTERVALS`` scrape intervals
(``collector.scrape_interval_s``); the instances it scrapes that round are the ones
``collector.shards`` gives it among those ids. So, with every collector's clock right (NTP)
and the same ``scrape_interval_s``:

- in steady state every instance is scraped by exactly one collector;
- a collector that dies is dropped by the others at their first round at least
  ``LIVE_INTERVALS`` intervals after its last heartbeat: its instances miss at most that many
  rounds; one that stops cleanly deletes its row (``leave``) and is replaced at once;
- a collector that joins while others are live (or comes back after standing down, below)
  scrapes nothing in its first round, so that every peer has seen it (and given up its share)
  before it starts: no round is scraped twice.

When the store does not answer (``StoreError``, or no answer within the scrape timeout) the
collector keeps its last assignment for as long as its peers still count it live (the window
since its last stored heartbeat), then stands down (scrapes nothing: its peers have taken its
instances over) until a heartbeat is stored again. Each failure is counted
(``pdscope_collector_membership_errors_total{reason}``) and logged, rate-limited; so is an id
that two live processes use (``reason="duplicate_id"``: they would scrape the same share).

On SQLite there is one collector: it owns every instance and the table is not used.

``Membership`` is the table (blocking, raises ``StoreError``; ``Heartbeats`` is its seam);
``Shard`` is the service's view (async, never raises). Neither scrapes nor writes snapshots.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from collector import shards
from collector.health import RateLimitedLog
from collector.selfmetrics import CollectorMetrics
from collector.targets import ScrapeTarget
from store.db import StoreError, transaction
from store.models import CollectorMember

log = logging.getLogger(__name__)

LIVE_INTERVALS = 3
# rows of collectors gone this long are deleted (pod names come and go)
PRUNE_AFTER_S = 86_400.0


def shared_store(factory: sessionmaker[Session]) -> bool:
    """True when the store can be shared by several collectors (anything but SQLite)."""
    bind = factory.kw.get("bind")
    return bind is not None and bind.dialect.name != "sqlite"


@dataclass(frozen=True)
class Beat:
    live: tuple[str, ...]  # ids heard from within the window, sorted; this collector's included
    duplicate: bool  # another process wrote this collector's id since its previous beat


class Heartbeats(Protocol):
    """What ``Shard`` needs of the membership (``Membership``, or a test's fake). Both block and
    raise ``StoreError``."""

    def beat(self, now: float) -> Beat: ...

    def leave(self) -> None: ...


class Membership:
    """This collector's row in ``collectors``. Every method blocks and raises ``StoreError``."""

    def __init__(self, factory: sessionmaker[Session], me: str, *, window_s: float) -> None:
        self.factory = factory
        self.me = me
        self.window_s = window_s
        self.incarnation = secrets.token_hex(16)
        self._beaten = False

    def beat(self, now: float) -> Beat:
        """Store this collector's heartbeat at ``now`` and read who is live."""
        with transaction(self.factory) as session:
            row = session.get(CollectorMember, self.me, with_for_update=True)
            duplicate = False
            if row is None:
                session.add(
                    CollectorMember(id=self.me, incarnation=self.incarnation, started=now, heartbeat=now)
                )
            else:
                # someone else wrote our row since our previous beat (a row left by an earlier
                # process under this id, before our first beat, is not a duplicate)
                duplicate = self._beaten and row.incarnation != self.incarnation
                if row.incarnation != self.incarnation and not duplicate:
                    row.started = now
                row.incarnation, row.heartbeat = self.incarnation, now
            session.flush()
            live = session.scalars(
                select(CollectorMember.id).where(CollectorMember.heartbeat > now - self.window_s)
            ).all()
            session.execute(delete(CollectorMember).where(CollectorMember.heartbeat < now - PRUNE_AFTER_S))
        self._beaten = True
        return Beat(tuple(sorted(set(live) | {self.me})), duplicate)

    def leave(self) -> None:
        """Delete this collector's row (a clean stop: the others take its share at their next round)."""
        with transaction(self.factory) as session:
            session.execute(
                delete(CollectorMember).where(
                    CollectorMember.id == self.me, CollectorMember.incarnation == self.incarnation
                )
            )


OK, SOLO, JOINING, HOLDING, STANDING_DOWN, STARTING = (
    "ok",
    "solo",
    "joining",
    "holding",
    "standing_down",
    "starting",
)


class Shard:
    """Which targets this collector scrapes, refreshed once per round by ``refresh``.

    ``membership`` None: alone (SQLite), every target. ``clock`` is wall-clock seconds (the
    heartbeats of different hosts are compared). ``timeout_s`` bounds one membership call;
    a call still running is never started twice.
    """

    def __init__(
        self,
        targets: Sequence[ScrapeTarget],
        me: str,
        *,
        membership: Heartbeats | None,
        interval_s: float,
        timeout_s: float,
        metrics: CollectorMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.targets = list(targets)
        self.me = me
        self.membership = membership
        self.interval_s = interval_s
        self.window_s = LIVE_INTERVALS * interval_s
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.clock = clock
        self.state = SOLO if membership is None else STARTING
        self.live: tuple[str, ...] = (me,) if membership is None else ()
        self.owned: list[ScrapeTarget] = list(self.targets) if membership is None else []
        self.last_ok: float | None = None
        self.last_error: str | None = None
        self._pending: asyncio.Future[Beat] | None = None
        self._warn = RateLimitedLog(log)
        self.metrics.owned_targets.set(len(self.owned))
        self.metrics.live_collectors.set(len(self.live))

    async def refresh(self) -> list[ScrapeTarget]:
        """This round's targets. Never raises."""
        if self.membership is None:
            return self.owned
        now = self.clock()
        # not counted live by the peers before this beat: they may still scrape our share
        rejoining = self.state in (STARTING, STANDING_DOWN)
        beat = await self._beat(now)
        if beat is not None:
            self.last_ok, self.last_error = now, None
            self.live = beat.live
            if beat.duplicate:
                self.metrics.membership_errors.labels("duplicate_id").inc()
                self._warn.warning(
                    "duplicate_id",
                    "collector id %r is used by another live process: both scrape the same share "
                    "(set collector.id to a unique value)",
                    self.me,
                )
            # (re)joining a live fleet: let every peer see us before we scrape anything
            self.state = JOINING if rejoining and len(beat.live) > 1 else OK
        elif self.last_ok is not None and now - self.last_ok < self.window_s:
            self.state = HOLDING
        else:
            self.state = STANDING_DOWN if self.last_ok is not None else STARTING
        members = self.live if self.state in (OK, HOLDING) else ()
        self._set_owned(members)
        return self.owned

    async def _beat(self, now: float) -> Beat | None:
        """The membership call, bounded by ``timeout_s``; None (counted, logged) when it failed."""
        assert self.membership is not None
        if self.waiting:
            self._failed("timeout", "the previous heartbeat is still waiting for the store")
            return None
        self._pending = pending = asyncio.ensure_future(asyncio.to_thread(self.membership.beat, now))
        pending.add_done_callback(_consume)
        done, _ = await asyncio.wait({pending}, timeout=self.timeout_s)
        if not done:
            self._failed("timeout", f"no answer from the store within {self.timeout_s:g}s")
            return None
        exc = pending.exception()
        if exc is not None:
            self._failed("store" if isinstance(exc, StoreError) else "error", str(exc) or repr(exc))
            return None
        return pending.result()

    def _failed(self, reason: str, detail: str) -> None:
        self.metrics.membership_errors.labels(reason).inc()
        self.last_error = f"{reason}: {detail}"[:300]
        if self.last_ok is not None and self.clock() - self.last_ok < self.window_s:
            then = "keeping the last assignment until the peers count this collector dead"
        else:
            then = "scraping nothing until a heartbeat is stored"
        self._warn.warning("membership", "collector %s: heartbeat not stored (%s); %s", self.me, detail, then)

    def _set_owned(self, members: Sequence[str]) -> None:
        names = set(shards.owned_by(self.me, [t.name for t in self.targets], members)) if members else set()
        owned = [t for t in self.targets if t.name in names]
        moved = shards.change((t.name for t in self.owned), names)
        if moved:
            self.metrics.forget([t for t in self.owned if t.name in moved.lost])
            log.info(
                "collector %s (%s) now scrapes %d of %d instances (live collectors: %s); took %s, gave up %s",
                self.me,
                self.state,
                len(owned),
                len(self.targets),
                ", ".join(members) or "none",
                list(moved.gained[:10]),
                list(moved.lost[:10]),
            )
        self.owned = owned
        self.metrics.owned_targets.set(len(owned))
        self.metrics.live_collectors.set(len(members))

    @property
    def waiting(self) -> bool:
        """True while a membership call is still running (a hung store)."""
        return self._pending is not None and not self._pending.done()

    def runs_maintenance(self) -> bool:
        """True on the one collector that runs forensics and retention: the smallest live id."""
        return self.state == SOLO or (self.state == OK and bool(self.live) and self.live[0] == self.me)

    def leave(self) -> None:
        """Delete this collector's row. Blocking; raises StoreError."""
        if self.membership is not None and self.last_ok is not None:
            self.membership.leave()

    def report(self) -> dict[str, Any]:
        """For /healthz: this collector's id, state, the live collectors and each one's share."""
        names = [t.name for t in self.targets]
        shares = {m: 0 for m in self.live}
        for who in shards.assign(names, self.live).values():
            shares[who] += 1
        out: dict[str, Any] = {
            "id": self.me,
            "state": self.state,
            "live": list(self.live),
            "shares": shares,
            "owned_targets": len(self.owned),
            "targets": len(self.targets),
            "window_s": round(self.window_s, 3),
        }
        if self.last_ok is not None:
            out["heartbeat_age_s"] = round(self.clock() - self.last_ok, 3)
        if self.last_error is not None:
            out["last_error"] = self.last_error
        return out


def _consume(fut: asyncio.Future[Beat]) -> None:
    """Retrieve a late or failed call's outcome so asyncio never reports it as lost."""
    if not fut.cancelled():
        fut.exception()
