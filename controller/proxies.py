"""The live proxies and each one's part of the pools' limits (the ``proxies`` table).

Every routing poll that says who it is (:class:`pdscope.routing.ProxyReport`) is recorded
here, by whichever controller replica it reaches: the leader and the standbys write the same
table, so a proxy may poll any of them and the parts stay consistent. One transaction per
poll, and one poll at a time (a PostgreSQL advisory lock across replicas): the proxy's row is
read, its claims bounded (``controller.proxy_claims``), its demand rates smoothed, the live
peers read, the part granted within the room the others leave (``controller.policy.shares``),
and the row written back with it.

Who may claim: the endpoint checks the poll's credentials for the id first
(``controller.proxy_auth``). Which ids count: at most ``controller.max_proxies`` live ones, and
with no proxy credentials configured at most ``proxy.expected_replicas`` (anyone who reaches the
controller could make ids up); a new id past the seats gets the table without a part
(``over_limit``), so made-up ids never dilute the parts of the proxies already counted.

One id, two processes (``boot``): the one that holds the row keeps it while it polls; the other
gets the table (weights, drains) but no part, and a flag saying why (``duplicate_id``), until the
holder has been silent for ``controller.proxy_ttl_s`` -- then it takes the id over (a restart).
A poll is never refused its table for this: a process that squats an id cannot freeze the real
one on an old table, nor take its part; two live processes never get one id's part twice.

Refusals are counted by outcome and logged once per episode. Rows of proxies not seen for an
hour are deleted, at most once a minute.

Tenants (``tenants.enabled``): a report also counts each tenant's requests (``ProxyReport.tenants``).
Only declared tenants are kept (the others dropped and counted as clipped ``tenant`` claims), each
bounded as a pool's demand is and smoothed into a rate the same way; they ride in the row's
``demand`` and ``rates`` under ``t:<tenant>`` (a pool's name holds no ``:``). The answer's
``ProxyShare.tenants`` gives, per tenant, this proxy's fraction of the tenant's demand rate over the
live proxies, and the proxy scales the tenant's weight by it. Why that holds a tenant's share
fleet-wide: each proxy's part of a pool follows its demand, which is the sum of its tenants'; a
tenant whose requests reach one proxy only keeps its full weight there, one spread over three
proxies a third of it on each, so that what it is given on each proxy, added up, is its weight's
share of the whole pool, as if one proxy admitted for all.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, select, text
from sqlalchemy.orm import Session, sessionmaker

from controller.policy.shares import apportion, prior_rate, smoothed_rate, split, within_room
from controller.proxy_auth import EpisodeLog, ProxyCredentials, Refusal
from controller.proxy_claims import clip_demand, clip_inflight, inflight_cap, unshared_part
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
    "wrong_id",
    "duplicate_id",
    "over_limit",
    "store_error",
)
CLAIMS = ("inflight", "demand", "tenant")  # what a report's claims may be clipped (tenant: or dropped) in
TENANT_KEY = "t:"  # a tenant's demand and rate in a row's demand and rates (a pool's name has no ':')


# pg_advisory_xact_lock(int4, int4): a class of its own (the collector's trace locks and the
# leader's one-bigint lock are other key spaces), key 0: every poll's transaction.
POLL_LOCK_CLASS = int.from_bytes(
    hashlib.blake2b(b"pdscope.controller.proxies", digest_size=4).digest(), "big", signed=True
)


def _serialise(session: Session) -> None:
    """PostgreSQL: hold the proxies' lock until this transaction ends (SQLite has one writer anyway)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:cls, 0)"), {"cls": POLL_LOCK_CLASS})


@dataclass(frozen=True, slots=True)
class PollAnswer:
    """What a report earns: its part, or why it gets none (``withheld``, sent to the proxy).
    Both None: a poll the store could not answer (the endpoint's concern)."""

    share: ProxyShare | None
    withheld: str | None = None


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
    tenant_demand_per_s: dict[str, float]
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


def _tenant_rates(row: ProxyMember) -> dict[str, float]:
    return {k[len(TENANT_KEY) :]: v for k, v in _rates(row).items() if k.startswith(TENANT_KEY)}


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
        secret: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.factory = factory
        cs = settings.controller
        # token -> name; secret: the fleet's proxy secret. Neither: reports are not authenticated
        self.credentials = ProxyCredentials(
            tokens, secret, tokens_env=cs.proxy_tokens_env, secret_env=cs.proxy_secret_env
        )
        self.settings = settings
        self.me = me[:256]
        self.clock = clock
        self.ttl_s, self.floor, self.window_s = cs.proxy_ttl_s, cs.proxy_share_floor, cs.proxy_share_window_s
        self.expected = settings.proxy.expected_replicas
        # the seats: with credentials, ids are bound to their holders; without, anyone can make one up
        self.max_proxies = cs.max_proxies if self.credentials.required else min(cs.max_proxies, self.expected)
        self.polls: Counter[str] = Counter()
        self.clipped: Counter[str] = Counter()  # report claims clipped, by kind (CLAIMS)
        self.live = 0  # live proxies at the last poll this replica answered
        self.departed = 0  # proxies that left the live set (no poll within the ttl), seen here
        self._live_ids: set[str] = set()
        self._episodes = EpisodeLog(log, self.ttl_s, clock)
        self._poll_lock = threading.Lock()  # one poll at a time in this process (SQLite, and fewer waits)
        self._lock = threading.Lock()
        self._pruned = 0.0

    def count(self, outcome: str) -> None:
        with self._lock:
            self.polls[outcome] += 1

    # -- a poll -------------------------------------------------------------------------

    def authenticate(self, authorization: str | None, proxy_id: str) -> Refusal | None:
        """Why a report under ``proxy_id`` is refused for its credentials (counted, logged once per
        episode), or None when they pass (or none are required)."""
        refusal = self.credentials.check(authorization, proxy_id)
        if refusal is not None:
            self.count(refusal.outcome)
            self._episodes.note(
                refusal.outcome,
                logging.WARNING,
                "routing report of proxy %s refused (%s, HTTP %d): %s (logged once while it goes on; "
                "counted as %s)",
                proxy_id,
                refusal.outcome,
                refusal.status,
                refusal.detail,
                refusal.outcome,
            )
        return refusal

    def poll(self, report: ProxyReport, table: RoutingTable) -> PollAnswer:
        """Record ``report`` and return the proxy's part, or why it gets none: a new id past the
        seats (not recorded), or an id another live process holds (that one's row untouched).
        Raises StoreError."""
        now = self.clock()
        pools = pool_totals(table, self.settings)
        answer: PollAnswer | None = None
        live_ids: dict[str, float] = {}
        with self._poll_lock, transaction(self.factory) as session:
            _serialise(session)  # the parts are granted one poll at a time, on every replica
            row = session.scalars(
                select(ProxyMember).where(ProxyMember.id == report.id).with_for_update()
            ).one_or_none()
            outcome = self._check_identity(row, report, now)
            if row is not None and outcome == "duplicate_id":
                row.duplicates += 1  # committed: GET /v1/proxies shows the refusals
                answer = self._withhold(row, report, now)
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
                    answer = self._over_limit(report.id)
                else:
                    answer = PollAnswer(self._record(session, row, report, peers, now, pools, outcome))
                    live_ids = {p.id: p.last_seen for p in peers}
        self.count(outcome)
        if answer.share is not None:
            self._note_live({report.id, *live_ids}, now)
            if outcome != "ok":
                log.info("proxy %s: %s (%d live)", report.id, outcome, answer.share.live)
        return answer

    def _withhold(self, row: ProxyMember, report: ProxyReport, now: float) -> PollAnswer:
        """Another live process holds ``report.id``: the table, no part, and why."""
        detail = (
            f"proxy id {report.id!r} is held by another live process (boot {row.boot}, started at "
            f"{row.started:.0f}, last poll {now - row.last_seen:.1f} s ago): this process gets the table "
            f"but no part until that one has been silent for {self.ttl_s:g} s "
            "(give every proxy process its own proxy.id)"
        )
        self._episodes.note(
            f"duplicate_id:{report.id}",
            logging.WARNING,
            "proxy id %r polled by two processes (holder boot %s; boot %s started %.0f gets no part; "
            "logged once while it goes on, counted as duplicate_id)",
            report.id,
            row.boot,
            report.boot,
            report.started,
        )
        return PollAnswer(None, detail)

    def _over_limit(self, pid: str) -> PollAnswer:
        self._episodes.note(
            "over_limit",
            logging.WARNING,
            "proxy %s is a new proxy past the %d seat(s) (controller.max_proxies%s): it gets no part and "
            "admits limit / proxy.expected_replicas (logged once while it goes on; counted as over_limit)",
            pid,
            self.max_proxies,
            "" if self.credentials.required else ", and proxy.expected_replicas without proxy credentials",
        )
        return PollAnswer(
            None,
            f"no seat for a new proxy id: {self.max_proxies} live proxies are counted already "
            "(controller.max_proxies; without proxy credentials, proxy.expected_replicas)",
        )

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
        inflight, demand = self._claims(row, report, now, pools)
        demand.update(self._tenant_claims(row, report, now, pools))
        rates = self._smooth(row, report, demand, peers, now, [*pools, *self._tenant_keys])
        live_rates = {p.id: _rates(p) for p in peers}
        live_rates[report.id] = rates
        share = self._share(report.id, live_rates, pools, peers)
        claims = (inflight, demand)
        self._write(session, row, report, now, rates, share, claims, restarted=outcome == "restarted")
        if now - self._pruned > PRUNE_EVERY_S:
            self._pruned = now
            session.execute(delete(ProxyMember).where(ProxyMember.last_seen < now - FORGET_AFTER_S))
        return share

    def _claims(
        self, row: ProxyMember | None, report: ProxyReport, now: float, pools: Mapping[str, tuple[int, int]]
    ) -> tuple[dict[str, int], dict[str, int]]:
        """The report's in-flight and demand figures within what the controller can check."""
        served = {} if row is None else _pools(row.served)
        held = {} if row is None else _ints(row.inflight)
        caps = {}
        for pool, (max_req, _) in pools.items():
            part = served.get(pool)
            last = _int(part.get("max_inflight_requests")) if isinstance(part, dict) else None
            caps[pool] = inflight_cap(last, held.get(pool, 0), unshared_part(max_req, self.expected))
        inflight, n_inflight = clip_inflight(report.inflight, caps)
        same = row is not None and row.boot == report.boot
        totals = _ints(row.demand) if row is not None and same else {}
        dt = 0.0 if row is None else now - row.last_seen
        demand = {
            pool: clip_demand(n, totals.get(pool), dt, pools[pool][0])
            for pool, n in report.demand.items()
            if pool in pools
        }
        n_demand = sum(demand[p] < report.demand[p] for p in demand)
        if n_inflight or n_demand:
            with self._lock:
                self.clipped["inflight"] += n_inflight
                self.clipped["demand"] += n_demand
            self._episodes.note(
                f"clipped:{report.id}",
                logging.WARNING,
                "proxy %s reported more than the controller can grant it (in flight %s, demand %s): "
                "clipped to %s and %s (logged once while it goes on)",
                report.id,
                dict(report.inflight),
                dict(report.demand),
                inflight,
                demand,
            )
        return inflight, demand

    @property
    def _tenant_keys(self) -> list[str]:
        ts = self.settings.tenants
        return [TENANT_KEY + t for t in ts.tenants] if ts.enabled else []

    def _tenant_claims(
        self, row: ProxyMember | None, report: ProxyReport, now: float, pools: Mapping[str, tuple[int, int]]
    ) -> dict[str, int]:
        """The report's demand per declared tenant (keyed ``t:<tenant>``), bounded as a pool's is (by the
        largest pool's limit); undeclared tenants dropped. Both counted as clipped ``tenant`` claims."""
        keys = set(self._tenant_keys)
        totals = _ints(row.demand) if row is not None and row.boot == report.boot else {}
        dt = 0.0 if row is None else now - row.last_seen
        limit = max((max_req for max_req, _ in pools.values()), default=1)
        out: dict[str, int] = {}
        clipped = 0
        for tenant, n in report.tenants.items():
            key = TENANT_KEY + tenant
            if key not in keys:
                clipped += 1
                continue
            out[key] = clip_demand(n, totals.get(key), dt, limit)
            clipped += out[key] < n
        if clipped:
            with self._lock:
                self.clipped["tenant"] += clipped
        return out

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
        """new, ok (the holder), duplicate_id (another process while the holder is live) or
        restarted (the holder has been silent for the ttl: this process takes the id over)."""
        if row is None:
            return "new"
        if row.boot == report.boot:
            return "ok"
        if now - row.last_seen < self.ttl_s:
            return "duplicate_id"
        return "restarted"

    def _smooth(
        self,
        row: ProxyMember | None,
        report: ProxyReport,
        demand: Mapping[str, int],
        peers: list[ProxyMember],
        now: float,
        pools: Iterable[str],
    ) -> dict[str, float]:
        """The smoothed demand rate of each of ``pools`` (and tenants' ``t:`` keys) from the report."""
        old = {} if row is None else _rates(row)
        totals = {} if row is None or row.boot != report.boot else _ints(row.demand)
        out: dict[str, float] = {}
        for pool in pools:
            prev = old.get(pool)
            if prev is None:
                prev = prior_rate([r for p in peers if (r := _rates(p).get(pool)) is not None])
            total = demand.get(pool, 0)
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
        return ProxyShare(id=me, live=len(live_rates), pools=parts, tenants=self._fractions(me, live_rates))

    def _fractions(self, me: str, live_rates: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
        """Tenants on: each tenant's fraction of its demand rate over the live proxies that is ``me``'s
        (a tenant nobody asks for now: left out, the proxy's scale 1). Rounded to 0.01: the part is in
        the table's ETag, and a fraction that moves in its sixth digit would answer no poll with 304."""
        out: dict[str, float] = {}
        for key in self._tenant_keys:
            total = sum(max(0.0, r.get(key, 0.0)) for r in live_rates.values())
            if total > 0:
                out[key[len(TENANT_KEY) :]] = round(max(0.0, live_rates[me].get(key, 0.0)) / total, 2)
        return out

    def _write(
        self,
        session: Session,
        row: ProxyMember | None,
        report: ProxyReport,
        now: float,
        rates: dict[str, float],
        share: ProxyShare,
        claims: tuple[dict[str, int], dict[str, int]],
        *,
        restarted: bool,
    ) -> None:
        if row is None:
            row = ProxyMember(id=report.id, first_seen=now, duplicates=0)
            session.add(row)
        row.boot, row.started, row.last_seen, row.served_by = report.boot, report.started, now, self.me
        row.applied_version = report.applied
        row.inflight, row.demand = claims  # as clipped: what the next poll's bounds start from
        row.rates = {k: round(v, 6) for k, v in rates.items()}
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
                demand_per_s={k: v for k, v in _rates(r).items() if not k.startswith(TENANT_KEY)},
                tenant_demand_per_s=_tenant_rates(r),
                pools=r.served if isinstance(r.served, dict) else {},
                duplicates=r.duplicates,
            )
            for r in rows
        ]
        return sorted(out, key=lambda v: (not v.live, v.id))
