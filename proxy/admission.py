"""Per-pool backpressure: in-flight requests and in-flight handoff KV bytes.

A request is admitted into one P pool and one D pool together (the pair is picked
jointly). It holds a request slot in both until it ends (the P slot is given up when
prefill is done). Once P has answered, its handoff KV bytes (prompt tokens x
``kv_bytes_per_token``) are charged to both pools -- pinned on P, incoming on D --
until D's first token (or failure). A pool has room when both counts are under the
limits of the current routing view (the controller's, or the config's defaults) and,
when it is on, under the pool's adaptive limit (``proxy.concurrency``), which is never
above the view's.

When no pool of a role has room, the request waits for any release (bounded by
``queue_timeout_s``, or the shorter ``max_queue_wait_s`` the controller sets from the
TTFT budget left, or, with admission by prediction, the time it can still wait and make its
target), then is rejected with a reason. Waiters are woken in deadline order. The number of
waiters is bounded too. With tenants (``proxy.fairqueue``) the waiters are the fair queue's
tickets instead, woken in its order (class, then the least-served tenant).
One event loop, no locks; :meth:`Admission.wait` is the only thing that blocks.
"""

from __future__ import annotations

import asyncio
import bisect
import math
from collections import Counter
from dataclasses import dataclass

from pdscope.routing import Role
from proxy.concurrency import AdaptiveLimits
from proxy.fairqueue import FairQueue, Ticket
from proxy.routing import PoolLimits

REASON_REQUESTS = "inflight_requests"
REASON_KV_BYTES = "inflight_kv_bytes"
REASON_QUEUE_FULL = "queue_full"
REASON_NO_INSTANCES = "no_instances"
REASON_ADAPTIVE = "adaptive_limit"
REASON_PREDICTED_LATE = "predicted_late"  # every P's predicted TTFT is over the request's target
REASONS = (
    REASON_REQUESTS,
    REASON_KV_BYTES,
    REASON_QUEUE_FULL,
    REASON_NO_INSTANCES,
    REASON_ADAPTIVE,
    REASON_PREDICTED_LATE,
)


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a request was not admitted, and the pools it counts against: the one without room, or
    (``no_instances``) every pool of ``role``, none of which had a routable instance."""

    reason: str
    pools: tuple[str, ...]
    role: Role
    retry_after_s: float | None = None  # predicted_late: when a request like it would make it again


class Admission:
    def __init__(
        self, max_waiters: int = 1024, adaptive: AdaptiveLimits | None = None, fair: FairQueue | None = None
    ) -> None:
        self.adaptive = adaptive
        self.fair = fair  # tenants on: the waiters are its tickets
        self.requests: Counter[str] = Counter()
        self.kv_bytes: Counter[str] = Counter()
        # requests that sought admission into each pool since start, admitted or not: the demand the
        # controller splits the pools' limits among proxies by (``pdscope.routing.ProxyReport``)
        self.demand: Counter[str] = Counter()
        self.max_waiters = max_waiters
        # (deadline, arrival, future): woken in deadline order, so the most urgent waiter takes a slot first
        self._waiters: list[tuple[float, int, asyncio.Future[None]]] = []
        self._arrivals = 0

    def blocked(self, pool: str, limits: PoolLimits) -> str | None:
        """Why ``pool`` cannot take one more request now, or None when it can."""
        n = self.requests[pool]
        if n >= limits.max_inflight_requests:
            return REASON_REQUESTS
        if self.adaptive is not None:
            reduced = self.adaptive.reduced.get(pool)  # only pools held below their ceiling
            if reduced is not None and n >= reduced:
                return REASON_ADAPTIVE
        if self.kv_bytes[pool] >= limits.max_inflight_kv_bytes:
            return REASON_KV_BYTES
        return None

    # -- holding ----------------------------------------------------------------------

    def enter(self, pool: str) -> None:
        self.requests[pool] += 1

    def leave(self, pool: str) -> None:
        self.requests[pool] -= 1
        self._notify()

    def add_bytes(self, pool: str, n: int) -> None:
        self.kv_bytes[pool] += n

    def remove_bytes(self, pool: str, n: int) -> None:
        self.kv_bytes[pool] -= n
        self._notify()

    # -- waiting ----------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self._waiters) + (0 if self.fair is None else self.fair.waiting)

    def can_wait(self) -> bool:
        return len(self._waiters) < self.max_waiters

    async def wait(self, within_s: float, deadline: float = math.inf) -> bool:
        """Wait until something is released or ``within_s`` passes; True if woken. Waiters are woken
        in the order of their ``deadline`` (the time by which the request must be on its way)."""
        if within_s <= 0:
            return False
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._arrivals += 1
        entry = (deadline, self._arrivals, fut)
        bisect.insort(self._waiters, entry, key=lambda w: (w[0], w[1]))
        try:
            return await _woken(fut, within_s)
        finally:
            try:
                self._waiters.remove(entry)
            except ValueError:
                pass

    async def wait_ticket(self, ticket: Ticket, within_s: float) -> bool:
        """A queued ticket of the fair queue waits until something is released, it is shed, or
        ``within_s`` passes; True if woken."""
        if within_s <= 0:
            return False
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ticket.wake = fut
        try:
            return await _woken(fut, within_s)
        finally:
            ticket.wake = None

    def wake(self, tickets: list[Ticket]) -> None:
        """Wake ``tickets``' waits, in this order (the first runs first)."""
        for ticket in tickets:
            fut = ticket.wake
            if isinstance(fut, asyncio.Future) and not fut.done():
                fut.set_result(None)

    def notify(self) -> None:
        """Wake the waiters (something other than a slot or bytes was given back)."""
        self._notify()

    def _notify(self) -> None:
        if self.fair is not None and self.fair.waiting:
            self.wake(self.fair.order())
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            for _, _, fut in waiters:  # deadline order: the earliest runs first and takes the slot
                if not fut.done():
                    fut.set_result(None)


async def _woken(fut: asyncio.Future[None], within_s: float) -> bool:
    """Whether ``fut`` is done within ``within_s`` (a wake-up), not the timeout."""
    try:
        await asyncio.wait_for(fut, within_s)
        return True
    except TimeoutError:
        return False
