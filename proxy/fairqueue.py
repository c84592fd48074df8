"""The tenants' fair queue in front of the pools: who waits, who goes next, what each one is charged.

Pure policy (no I/O, no asyncio; the clock is passed in). :class:`proxy.admission.Admission` holds
the waiters' wake-ups and :class:`proxy.gate.Gate` asks this queue before every try at a pool.

**Virtual token counters, one per pool.** Each tenant ``t`` has two counters: ``p[t]``, the prefill
service it was given in P, and ``d[t]``, the service it was given in D, each over its weight. Admitting a
request of ``t`` (its :class:`Work`) adds ``P / w[t]`` to the first and ``(k x D + m x K) / w[t]`` to
the second: ``P`` the prompt tokens it makes P compute (after the cache hits the KV view predicted, else
all of them), ``D`` its decode steps (its ``max_tokens``; when it ends, the output tokens it had), ``K``
the KV it holds in D times the steps it holds it (token-steps: ``D x L + D (D + 1) / 2`` for ``L``
tokens of context), ``k`` ``tenants.cost_per_decode_token`` and ``m``
``tenants.cost_per_kv_token_step``. A request sent to D alone charges D for the prompt tokens D
computes. ``w[t]`` is the tenant's weight times its scale (:meth:`scale`: with several proxies, this
proxy's fraction of the tenant's demand, from the controller).

**Who goes first.** While nobody waits, a request tries the pools at once: a tenant alone can use all of
them (work-conserving). Once requests wait, they go in order of (class rank, the tenant's counter,
arrival): a higher class always first, then the least-served tenant; a tenant's own requests in arrival
order. The counter is the one of the pool the waiters wait for (the role of the pool that last refused
the first of them, :meth:`blocked`): P's while P is full, D's while D is, so each pool's capacity is
shared by weight, and a tenant heavy in one pool is not held back in the other by what it asked of the
first. Before any pool refused (and once nobody waits): the sum. A new arrival tries the pools only when
no waiter ranks before it; otherwise it waits too, so it never overtakes one.

**No banked credit.** A tenant that arrives idle (nothing waiting, nothing in flight, for more than
``IDLE_S``) has each counter lifted to the least of that counter among the busy tenants (waiting or
in flight); none busy: to the highest known. Idle time earns nothing to spend later. The
grace keeps a tenant whose clients send one request after another (in flight 0 for a moment
between them) from being lifted each time, which would undo its weight.

**Bounds.** Each tenant has its own queue (``max_queued``; default ``max_waiters`` split by
weight): a flooding tenant fills its own and gets its own 429s (``tenant_queue_full``). All waiters
together are bounded by ``max_waiters``: there, an arrival of a higher class sheds the lowest-class
waiter (the most served of them, the latest of its requests), which ends with a 429
(``shed_for_priority``); an arrival no waiter ranks below is refused (``queue_full``).

**Fairness.** Each tenant's service (its charges over its weight) is also kept as a rate decayed
over ``SERVICE_TAU_S``; :meth:`jain` is Jain's index of those rates over the tenants that waited
within that time (the backlogged ones): 1 is an even weighted share.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from pdscope.config.tenants import TenantSettings
from pdscope.routing import Role
from pdscope.tenantcost import Costs

REASON_TENANT_QUEUE_FULL = "tenant_queue_full"
REASON_SHED = "shed_for_priority"
REASON_QUEUE_FULL = "queue_full"  # the same reason as proxy.admission's
REASON_RESERVE = "tenant_reserve"  # waited out its deadline behind its reserve line (P's queues too deep)
SERVICE_TAU_S = 10.0  # the decay of the service rates Jain's index reads
IDLE_S = 1.0  # a tenant with nothing waiting or in flight for longer than this is idle
MIN_SCALE = 0.01  # a tenant's weight is never scaled below this fraction (it still gets some share)


@dataclass(frozen=True, slots=True)
class Work:
    """What one request asks of the pools, in tokens: what its tenant is charged for it."""

    p_prefill: int = 0  # prompt tokens P computes (after the cache hits predicted for its P)
    d_prefill: int = 0  # prompt tokens D computes itself (a request sent to D alone: what D does not hold)
    context: int = 0  # tokens D holds when it starts to decode (its whole prompt)
    decode: int = 0  # decode steps: its max_tokens, the output tokens it had once it ended

    def ended(self, used: int) -> Work:
        """The same request, charged for the ``used`` decode steps it had."""
        return Work(self.p_prefill, self.d_prefill, self.context, max(0, used))


@dataclass(eq=False, slots=True)
class Ticket:
    """One request's place in the fair queue, from its arrival until it is admitted or gives up.
    ``wake``: what the holder of the wait set (``proxy.admission``); this module never calls it."""

    tenant: str
    rank: int
    seq: int
    queued: bool = False
    shed: bool = False
    # kept out of every P by its tenant's reserve line at its last try: it waits for P's queues to drain,
    # not for a pool's room, so it does not hold back a waiter behind it that could go (``ahead``)
    held: bool = False
    wake: object = None


@dataclass(slots=True)
class _Rate:
    value: float = 0.0
    at: float = 0.0

    def read(self, now: float) -> float:
        return max(0.0, self.value * math.exp(-max(0.0, now - self.at) / SERVICE_TAU_S))

    def add(self, x: float, now: float) -> None:
        self.value, self.at = self.read(now) + x, now


@dataclass(slots=True)
class _Tenant:
    weight: float
    rank: int
    bound: int
    p: float = 0.0  # P's counter: prefill service over the weight
    d: float = 0.0  # D's counter: decode and KV-held service over the weight
    scale: float = 1.0
    queue: deque[Ticket] = field(default_factory=deque)
    service: _Rate = field(default_factory=_Rate)
    waited_at: float = -math.inf  # when it last had a waiter
    busy_at: float = -math.inf  # when it last had a waiter or a request in flight
    target_s: float = math.inf  # its TTFT target (its own, else the fleet's)


class FairQueue:
    def __init__(
        self, ts: TenantSettings, max_waiters: int, clock: Callable[[], float], fleet_ttft_s: float = math.inf
    ) -> None:
        self.clock = clock
        self.max_waiters = max_waiters
        self.costs = Costs.of(ts)
        self.reserve = ts.reserve
        total = sum(t.weight for t in ts.tenants.values())
        self.tenants = {
            name: _Tenant(
                t.weight,
                ts.rank(name),
                t.max_queued if t.max_queued is not None else max(1, int(max_waiters * t.weight / total)),
                target_s=t.slo.ttft_ms / 1000.0 if t.slo.ttft_ms is not None else fleet_ttft_s,
            )
            for name, t in ts.tenants.items()
        }
        self.inflight: Counter[str] = Counter()
        self.waiting = 0
        self.tight: Role | None = None  # the pool the waiters wait for; None: not known (the sum)
        self._seq = 0

    # -- arrival and order --------------------------------------------------------------

    def arrive(self, tenant: str) -> Ticket:
        """A request of ``tenant`` (a declared one) arrives: its ticket; an idle tenant is lifted."""
        t, now = self.tenants[tenant], self.clock()
        if not t.queue and not self.inflight[tenant] and now - t.busy_at > IDLE_S:
            busy = [o for n, o in self.tenants.items() if n != tenant and (o.queue or self.inflight[n])]
            known = busy or list(self.tenants.values())
            lift = min if busy else max
            t.p = max(t.p, lift(o.p for o in known))
            t.d = max(t.d, lift(o.d for o in known))
        self._seq += 1
        return Ticket(tenant, t.rank, self._seq)

    def counter(self, tenant: str) -> float:
        """``tenant``'s counter in the order: the one of the pool the waiters wait for, else the sum."""
        t = self.tenants[tenant]
        if self.tight == "prefill":
            return t.p
        if self.tight == "decode":
            return t.d
        return t.p + t.d

    def blocked(self, role: Role) -> None:
        """The first waiter was refused by a pool of ``role``: the waiters wait for that pool."""
        self.tight = role

    def _key(self, ticket: Ticket) -> tuple[int, float, int]:
        return ticket.rank, self.counter(ticket.tenant), ticket.seq

    def ahead(self, ticket: Ticket) -> bool:
        """Whether a waiter ranks before ``ticket``: then it must not try the pools yet. A waiter held by
        its own tenant's reserve line (``Ticket.held``) is passed: the room it waits for is its own."""
        if not self.waiting:  # the common case: nobody waits
            return False
        mine = self._key(ticket)
        for t in self.tenants.values():
            if t.queue:
                head = t.queue[0]
                if head is not ticket and not head.held and self._key(head) < mine:
                    return True
        return False

    def order(self) -> list[Ticket]:
        """Every waiter, the first to go first."""
        return sorted(self._waiters(), key=self._key)

    def _waiters(self) -> Iterator[Ticket]:
        for t in self.tenants.values():
            yield from t.queue

    # -- queueing -------------------------------------------------------------------------

    def enqueue(self, ticket: Ticket) -> tuple[str | None, Ticket | None]:
        """Queue ``ticket``: (why not, None), or (None, the waiter shed to make room for it, if any:
        its holder must be woken to end it)."""
        t = self.tenants[ticket.tenant]
        if len(t.queue) >= t.bound:
            return REASON_TENANT_QUEUE_FULL, None
        victim = None
        if self.waiting >= self.max_waiters:
            victim = self._victim(ticket.rank)
            if victim is None:
                return REASON_QUEUE_FULL, None
            self.leave(victim)
            victim.shed = True
        t.queue.append(ticket)
        ticket.queued = True
        self.waiting += 1
        t.waited_at = self.clock()
        return None, victim

    def _victim(self, rank: int) -> Ticket | None:
        """The waiter to shed for an arrival of class ``rank``: the lowest class below it, the most
        served tenant of that class, its latest request; None when no waiter is of a lower class."""
        worst = max(self._waiters(), key=lambda w: (w.rank, self.counter(w.tenant), w.seq), default=None)
        return worst if worst is not None and worst.rank > rank else None

    def leave(self, ticket: Ticket) -> None:
        """``ticket`` is no longer waiting (admitted, gave up, shed); nothing when it was not queued."""
        if ticket.queued:
            ticket.queued = False
            self.tenants[ticket.tenant].queue.remove(ticket)
            self.waiting -= 1
            if not self.waiting:
                self.tight = None
            t = self.tenants[ticket.tenant]
            t.waited_at = t.busy_at = self.clock()

    # -- service ----------------------------------------------------------------------------

    def weight(self, tenant: str) -> float:
        t = self.tenants[tenant]
        return t.weight * t.scale

    def cost(self, work: Work) -> tuple[float, float]:
        """``work``'s cost in P and in D, in tokens (before the weight)."""
        d = max(0, work.d_prefill) + self.costs.d(work.context, work.decode)
        return float(max(0, work.p_prefill)), d

    def admitted(self, tenant: str, work: Work) -> None:
        """A request of ``tenant`` admitted: ``work``'s cost charged, one more in flight."""
        self.inflight[tenant] += 1
        self.charge(tenant, *self.cost(work))

    def charge(self, tenant: str, p: float, d: float = 0.0) -> None:
        """Add ``p`` and ``d`` (in tokens; negative: a correction) to ``tenant``'s counters and service."""
        w = self.weight(tenant)
        t = self.tenants[tenant]
        t.p += p / w
        t.d += d / w
        t.service.add((p + d) / w, self.clock())

    def finished(self, tenant: str, charged: Work, decode_used: int | None) -> None:
        """An admitted request ended: one less in flight; its charge corrected to the decode steps it had."""
        self.inflight[tenant] -= 1
        self.tenants[tenant].busy_at = self.clock()
        if decode_used is not None and decode_used != charged.decode:
            _, was = self.cost(charged)
            _, now = self.cost(charged.ended(decode_used))
            self.charge(tenant, 0.0, now - was)

    def scale(self, scales: Mapping[str, float]) -> None:
        """Each tenant's weight scale (a declared tenant missing: 1), at least ``MIN_SCALE``."""
        for name, t in self.tenants.items():
            s = scales.get(name, 1.0)
            t.scale = min(1.0, max(MIN_SCALE, s)) if math.isfinite(s) else 1.0

    # -- the reserve ---------------------------------------------------------------------------

    def rank_of(self, tenant: str) -> int:
        """``tenant``'s class rank (0: the highest)."""
        return self.tenants[tenant].rank

    def target_of(self, tenant: str) -> float:
        """``tenant``'s own TTFT target (its ``slo.ttft_ms``, else the fleet's)."""
        return self.tenants[tenant].target_s

    def reserve_line(self, tenant: str) -> float | None:
        """How deep (predicted seconds to a first token, for a request sent now) ``tenant`` may fill P's
        queues, or None: no line. The reserve (``tenants.reserve``) is kept behind the line for those with
        the first claim on it: while a tenant of a higher class is busy, the line is (1 - reserve) of the
        tightest of their targets; while tenants of its own class are busy and it was served past its
        weight's share among them (:meth:`over_share`), (1 - reserve) of the tightest target among those
        of them within their share (the ones the reserve is kept for: a flood with a lax target must not
        fill P past what a peer with a tight one can wait). Alone, none. Busy: waiting, in flight, or
        either within ``SERVICE_TAU_S``."""
        if self.reserve <= 0:
            return None
        now, t = self.clock(), self.tenants[tenant]
        others = [o for n, o in self.tenants.items() if n != tenant and self._busy(n, o, now)]
        higher = [o.target_s for o in others if o.rank < t.rank]
        if higher:
            return min(higher) * (1.0 - self.reserve)
        claimants = self._claimants(t, [o for o in others if o.rank == t.rank], now)
        if claimants is None:
            return None
        target = min((o.target_s for o in claimants), default=t.target_s)
        return target * (1.0 - self.reserve) if math.isfinite(target) else None

    def over_share(self, tenant: str) -> bool:
        """Whether ``tenant`` was served past its weight's share among the busy tenants of its class
        (itself included): its service of the last ``SERVICE_TAU_S`` (the decayed rate, over its weight)
        above their weighted mean. Never alone in its class. The reserve line's test, and the priority a
        request carries into P (``proxy.priority``).

        Service, not P's backlog: the backlog is a moment. A tenant within its share that sends a few
        requests together holds most of what waits while a flood is held behind its line; judged by the
        backlog, it was held to a line in turn and waited in the proxy until it was late, and the flood,
        for that moment within its share of the backlog, had no line (a simulated flood beside two tenants
        at 3/4 of their share: about half of their remaining ``predicted_late`` 429s)."""
        now, t = self.clock(), self.tenants[tenant]
        peers = [
            o for n, o in self.tenants.items() if n != tenant and o.rank == t.rank and self._busy(n, o, now)
        ]
        return self._over(t, peers, now)

    @staticmethod
    def _over(t: _Tenant, peers: list[_Tenant], now: float) -> bool:
        return FairQueue._claimants(t, peers, now) is not None

    @staticmethod
    def _claimants(t: _Tenant, peers: list[_Tenant], now: float) -> list[_Tenant] | None:
        """Where ``t`` was served past its weight's share among ``peers`` and itself, those of the peers
        within theirs (their service over their weight at most the weighted mean); None where it was not."""
        if not peers:
            return None
        mine, w = t.service.read(now), t.weight * t.scale
        reads = [o.service.read(now) for o in peers]
        weights = w + sum(o.weight * o.scale for o in peers)
        served = w * mine + sum(o.weight * o.scale * r for o, r in zip(peers, reads, strict=True))
        if mine * weights <= served:
            return None
        return [o for o, r in zip(peers, reads, strict=True) if r * weights <= served]

    def _busy(self, name: str, t: _Tenant, now: float) -> bool:
        return bool(t.queue) or self.inflight[name] > 0 or now - t.busy_at <= SERVICE_TAU_S

    # -- what the metrics read ----------------------------------------------------------------

    def queued(self, tenant: str) -> int:
        return len(self.tenants[tenant].queue)

    def service_rates(self) -> dict[str, float]:
        """Each tenant's decayed service rate (tokens over its weight, per ``SERVICE_TAU_S``)."""
        now = self.clock()
        return {n: t.service.read(now) for n, t in self.tenants.items()}

    def jain(self) -> float | None:
        """Jain's index over the service rates of the tenants that waited within ``SERVICE_TAU_S``
        (1: even shares by weight; 1/n: one tenant served); None when none did."""
        now = self.clock()
        xs = [
            t.service.read(now)
            for t in self.tenants.values()
            if t.queue or now - t.waited_at <= SERVICE_TAU_S
        ]
        squares = sum(x * x for x in xs)
        if not xs or squares <= 0:
            return None
        return sum(xs) ** 2 / (len(xs) * squares)
