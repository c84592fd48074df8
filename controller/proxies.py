"""The live proxies and each one's part of the pools' limits (the ``proxies`` table).

Every routing poll that says who it is (:class:`pdscope.routing.ProxyReport`) is recorded
here, by whichever controller replica it reaches: the leader and the standbys write the same
table, so a proxy may poll any of them and the parts stay consistent. One transaction per
poll, and one poll at a time (a PostgreSQL advisory lock across replicas): the proxy's row is
read, its demand rates smoothed, the live peers read, the part granted within the room the
others leave (``controller.policy.shares``), and the row written back with it.

A poll under an id whose row holds another process (``boot``): a process started later
takes the id over (a restart); one started earlier while the later one is still live is a
duplicate and is refused (:class:`DuplicateProxy`, a 409): two processes under one id would
each get that id's part and together admit twice it.

Rows of proxies not seen for an hour are deleted, at most once a minute.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, select, text
from sqlalchemy.orm import Session, sessionmaker

from controller.policy.shares import apportion, prior_rate, smoothed_rate, split, within_room
from pdscope.config import Settings
from pdscope.routing import PoolShare, ProxyReport, ProxyShare, RoutingTable
from store.db import transaction
from store.models import ProxyMember

log = logging.getLogger(__name__)

FORGET_AFTER_S = 3600.0
PRUNE_EVERY_S = 60.0
OUTCOMES = (
    "ok",
    "new",
    "restarted",
    "bad_report",
    "unauthenticated",
    "duplicate_id",
    "over_limit",
    "store_error",
)


# pg_advisory_xact_lock(int4, int4): a class of its own (the collector's trace locks and the
# leader's one-bigint lock are other key spaces), key 0: every poll's transaction.
POLL_LOCK_CLASS = int.from_bytes(
    hashlib.blake2b(b"pdscope.controller.proxies", digest_size=4).digest(), "big", signed=True
)


def _serialise(session: Session) -> None:
    """PostgreSQL: hold the proxies' lock until this transaction ends (SQLite has one writer anyway)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:cls, 0)"), {"cls": POLL_LOCK_CLASS})


class DuplicateProxy(Exception):
    """Another, later-started process polls under this id and is live."""

    def __init__(self, proxy_id: str, other_started: float, other_seen_s: float) -> None:
        self.detail = (
            f"proxy id {proxy_id!r} is in use by another process (started at {other_started:.0f}, "
            f"last poll {other_seen_s:.1f} s ago): give every proxy process its own proxy.id"
        )
        super().__init__(self.detail)


@dataclass(frozen=True, slots=True)
class ProxyView:
    """One row of ``GET /v1/proxies``."""

    id: str
    live: bool
    last_poll: float
    age_s: float
    started: float
    first_seen: float
    served_by: str | None
    applied_version: int | None
    inflight: dict[str, int]
    demand_per_s: dict[str, float]
    pools: dict[str, dict[str, float]]
    duplicates: int


def pool_totals(table: RoutingTable, settings: Settings) -> dict[str, tuple[int, int]]:
    """Each pool's limits in force (requests, KV bytes): the table's, else the config's defaults."""
    adm = settings.proxy.admission
    out = {name: (adm.max_inflight_requests, adm.max_inflight_kv_bytes) for name in settings.pools}
    for p in table.pools:
        out[p.name] = (
            adm.max_inflight_requests if p.max_inflight_requests is None else p.max_inflight_requests,
            adm.max_inflight_kv_bytes if p.max_inflight_kv_bytes is None else p.max_inflight_kv_bytes,
        )
    return out


def _rates(row: ProxyMember) -> dict[str, float]:
    raw = row.rates if isinstance(row.rates, dict) else {}
    return {k: float(v) for k, v in raw.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def _pools(raw: Any) -> dict[str, Any]:
    return raw if isinstance(raw, dict) else {}


def _int(v: Any) -> int:
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 else 0


def _ints(raw: Any) -> dict[str, int]:
    d = raw if isinstance(raw, dict) else {}
    return {k: int(v) for k, v in d.items() if isinstance(v, int) and not isinstance(v, bool)}


class ProxyRegistry:
    def __init__(
        self,
        factory: sessionmaker[Session],
        settings: Settings,
        *,
        me: str,
        tokens: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.factory = factory
        self.tokens = dict(tokens or {})  # token -> identity; empty: reports are not authenticated
        self.settings = settings
        self.me = me[:256]
        self.clock = clock
        cs = settings.controller
        self.ttl_s, self.floor, self.window_s = cs.proxy_ttl_s, cs.proxy_share_floor, cs.proxy_share_window_s
        self.max_proxies = cs.max_proxies
        self.tokens_env = cs.proxy_tokens_env
        self.polls: Counter[str] = Counter()
        self.live = 0  # live proxies at the last poll this replica answered
        self.departed = 0  # proxies that left the live set (no poll within the ttl), seen here
        self._live_ids: set[str] = set()
        self._over_limit_warned = False
        self._poll_lock = threading.Lock()  # one poll at a time in this process (SQLite, and fewer waits)
        self._lock = threading.Lock()
        self._pruned = 0.0

    def count(self, outcome: str) -> None:
        with self._lock:
            self.polls[outcome] += 1

    # -- a poll -------------------------------------------------------------------------

    def authenticate(self, authorization: str | None) -> str | None:
        """Why a report's credentials are refused, or None when they pass (or none are required)."""
        if not self.tokens:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() == "bearer" and token:
            for known in self.tokens:
                if hmac.compare_digest(known.encode(), token.strip().encode()):
                    return None
        self.count("unauthenticated")
        return (
            f"a routing poll that reports a proxy needs Authorization: Bearer <a token of "
            f"${self.tokens_env}> (set proxy.controller_token_env's variable on the proxy)"
        )

    def poll(self, report: ProxyReport, table: RoutingTable) -> ProxyShare | None:
        """Record ``report`` and return the proxy's part (None: a new id past ``max_proxies``, not
        recorded). Raises DuplicateProxy, StoreError."""
        now = self.clock()
        pools = pool_totals(table, self.settings)
        share: ProxyShare | None = None
        live_ids: dict[str, float] = {}
        with self._poll_lock, transaction(self.factory) as session:
            _serialise(session)  # the parts are granted one poll at a time, on every replica
            row = session.scalars(
                select(ProxyMember).where(ProxyMember.id == report.id).with_for_update()
            ).one_or_none()
            outcome = self._check_identity(row, report, now)
            if row is not None and outcome == "duplicate_id":
                row.duplicates += 1  # committed: GET /v1/proxies shows the refusals
                refused = DuplicateProxy(report.id, row.started, now - row.last_seen)
                other = (row.boot, row.started)
            else:
                peers = [
                    p
                    for p in session.scalars(
                        select(ProxyMember).where(ProxyMember.last_seen >= now - self.ttl_s)
                    )
                    if p.id != report.id
                ]
                if row is None and len(peers) >= self.max_proxies:
                    outcome = "over_limit"
                else:
                    share = self._record(session, row, report, peers, now, pools, outcome)
                    live_ids = {p.id: p.last_seen for p in peers}
        self.count(outcome)
        if outcome == "over_limit":
            self._warn_over_limit(report.id)
            return None
        if share is None:
            log.warning(
                "proxy id %r polled by two processes (boot %s started %.0f, and boot %s started %.0f): "
                "refusing the earlier one",
                report.id,
                report.boot,
                report.started,
                *other,
            )
            raise refused
        self._note_live({report.id, *live_ids}, now)
        if outcome != "ok":
            log.info("proxy %s: %s (%d live)", report.id, outcome, share.live)
        return share

    def _record(
        self,
        session: Session,
        row: ProxyMember | None,
        report: ProxyReport,
        peers: list[ProxyMember],
        now: float,
        pools: Mapping[str, tuple[int, int]],
        outcome: str,
    ) -> ProxyShare:
        rates = self._smooth(row, report, peers, now, pools)
        live_rates = {p.id: _rates(p) for p in peers}
        live_rates[report.id] = rates
        share = self._share(report.id, live_rates, pools, peers)
        self._write(session, row, report, now, rates, share, restarted=outcome == "restarted")
        if now - self._pruned > PRUNE_EVERY_S:
            self._pruned = now
            session.execute(delete(ProxyMember).where(ProxyMember.last_seen < now - FORGET_AFTER_S))
        return share

    def _warn_over_limit(self, pid: str) -> None:
        with self._lock:
            first = not self._over_limit_warned
            self._over_limit_warned = True
        if first:
            log.warning(
                "proxy %s is a new proxy past controller.max_proxies (%d live): it gets no part and "
                "admits limit / proxy.expected_replicas (logged once; counted as over_limit)",
                pid,
                self.max_proxies,
            )

    def _note_live(self, live: set[str], now: float) -> None:
        """Log and count the proxies that left the live set since this replica's last poll."""
        with self._lock:
            gone = self._live_ids - live
            self._live_ids = live
            self.live = len(live)
            self.departed += len(gone)
        for pid in sorted(gone):
            log.warning(
                "proxy %s has not polled for %.0f s (controller.proxy_ttl_s): its part of the limits goes "
                "to the %d live one(s)",
                pid,
                self.ttl_s,
                len(live),
            )

    def _check_identity(self, row: ProxyMember | None, report: ProxyReport, now: float) -> str:
        if row is None:
            return "new"
        if row.boot == report.boot:
            return "ok"
        if report.started < row.started and now - row.last_seen < self.ttl_s:
            return "duplicate_id"
        return "restarted"

    def _smooth(
        self,
        row: ProxyMember | None,
        report: ProxyReport,
        peers: list[ProxyMember],
        now: float,
        pools: Mapping[str, tuple[int, int]],
    ) -> dict[str, float]:
        old = {} if row is None else _rates(row)
        totals = {} if row is None or row.boot != report.boot else _ints(row.demand)
        out: dict[str, float] = {}
        for pool in pools:
            prev = old.get(pool)
            if prev is None:
                prev = prior_rate([r for p in peers if (r := _rates(p).get(pool)) is not None])
            total = report.demand.get(pool, 0)
            out[pool] = smoothed_rate(
                prev, totals.get(pool), None if row is None else row.last_seen, total, now, self.window_s
            )
        return out

    def _share(
        self,
        me: str,
        live_rates: Mapping[str, Mapping[str, float]],
        pools: Mapping[str, tuple[int, int]],
        peers: list[ProxyMember],
    ) -> ProxyShare:
        parts: dict[str, PoolShare] = {}
        for pool, (max_req, max_kv) in pools.items():
            fractions = split({p: r.get(pool, 0.0) for p, r in live_rates.items()}, self.floor)
            held_req = held_kv = 0
            for p in peers:  # what the other live proxies hold now: their part, or more in flight
                last = _pools(p.served).get(pool)
                part = last if isinstance(last, dict) else {}
                held_req += max(_int(part.get("max_inflight_requests")), _ints(p.inflight).get(pool, 0))
                held_kv += _int(part.get("max_inflight_kv_bytes"))
            req = within_room(apportion(max_req, fractions)[me], max_req, held_req)
            kv = within_room(apportion(max_kv, fractions)[me], max_kv, held_kv)
            parts[pool] = PoolShare(
                share=round(min(1.0, req / max_req if max_req > 0 else 0.0), 6),
                max_inflight_requests=req,
                max_inflight_kv_bytes=kv,
            )
        return ProxyShare(id=me, live=len(live_rates), pools=parts)

    def _write(
        self,
        session: Session,
        row: ProxyMember | None,
        report: ProxyReport,
        now: float,
        rates: dict[str, float],
        share: ProxyShare,
        *,
        restarted: bool,
    ) -> None:
        if row is None:
            row = ProxyMember(id=report.id, first_seen=now, duplicates=0)
            session.add(row)
        row.boot, row.started, row.last_seen, row.served_by = report.boot, report.started, now, self.me
        row.applied_version = report.applied
        row.demand = dict(report.demand)
        row.rates = {k: round(v, 6) for k, v in rates.items()}
        row.inflight = dict(report.inflight)
        row.served = {k: v.model_dump() for k, v in share.pools.items()}
        if restarted:
            row.first_seen = now

    # -- reads --------------------------------------------------------------------------

    def listing(self) -> list[ProxyView]:
        """Every proxy heard from in the last hour, live ones first, then by id."""
        now = self.clock()
        with transaction(self.factory) as session:
            rows = list(session.scalars(select(ProxyMember).order_by(ProxyMember.id)))
        out = [
            ProxyView(
                id=r.id,
                live=now - r.last_seen <= self.ttl_s,
                last_poll=r.last_seen,
                age_s=round(max(0.0, now - r.last_seen), 3),
                started=r.started,
                first_seen=r.first_seen,
                served_by=r.served_by,
                applied_version=r.applied_version,
                inflight=_ints(r.inflight),
                demand_per_s=_rates(r),
                pools=r.served if isinstance(r.served, dict) else {},
                duplicates=r.duplicates,
            )
            for r in rows
        ]
        return sorted(out, key=lambda v: (not v.live, v.id))
