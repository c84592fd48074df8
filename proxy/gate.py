"""A request's way into the pools: the joint first pick, every retry pick, and what it holds.

Every pick goes through admission (``proxy.admission``): the first (one P pool and one D
pool together, waiting for room up to the queue bound) and each retry (another P, another
D, or the pair of a full retry). A retry is only admitted into a pool with room, or into the
pool the request already holds a slot in (moving within it takes nothing more); when no
pool with a candidate has room there is no retry, as when there is no candidate at all.

The request holds a request slot in its P pool until prefill is done and in its D pool
until it ends, and, from P's answer to D's first token, its handoff KV bytes in both.
:meth:`Gate.release` gives all of it back. A rejection names the pool(s) it counts against:
the pool that was full, or every pool of a role that had no routable instance.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Literal

from proxy.admission import REASON_NO_INSTANCES, REASON_QUEUE_FULL, Admission, Rejection
from proxy.request import FlowSettings, RequestState
from proxy.routing import RoutingState, RoutingView, Target
from proxy.selection import Selector

Role = Literal["prefill", "decode"]


class Gate:
    def __init__(
        self,
        fs: FlowSettings,
        routing: RoutingState,
        selector: Selector,
        admission: Admission,
        clock: Callable[[], float],
    ) -> None:
        self.fs, self.routing, self.selector, self.admission, self.clock = (
            fs,
            routing,
            selector,
            admission,
            clock,
        )
        pools = routing.settings.pools
        self._pools_of: dict[str, tuple[str, ...]] = {
            role: tuple(name for name, p in pools.items() if p.role == role) for role in ("prefill", "decode")
        }

    # -- the first pick ---------------------------------------------------------------

    async def admit(self, req: RequestState) -> Rejection | None:
        """Admit ``req`` into a P and a D pool, waiting for room within the queue bound; or why not."""
        rejection = await self._admit(req)
        self._count_demand(req, rejection)
        return rejection

    async def _admit(self, req: RequestState) -> Rejection | None:
        deadline = self.clock() + self.routing.view.queue_wait_s(self.fs.queue_timeout_s)
        while True:
            rejection = self._try_admit(req, self.routing.view, self.clock())
            if rejection is None or rejection.reason == REASON_NO_INSTANCES:
                return rejection
            remaining = deadline - self.clock()
            if remaining <= 0:
                return rejection
            if not self.admission.can_wait():
                return Rejection(REASON_QUEUE_FULL, rejection.pools, rejection.role)
            await self.admission.wait(remaining)

    def _count_demand(self, req: RequestState, rejection: Rejection | None) -> None:
        """One demand per role: the pool admitted into, else the pools the rejection names (or, for
        the role it did not get to, every pool of that role in the view)."""
        demand = self.admission.demand
        if rejection is None:
            assert req.p is not None and req.d is not None
            demand[req.p.pool] += 1
            demand[req.d.pool] += 1
            return
        view = self.routing.view
        for role, pools in (("prefill", view.prefill_pools), ("decode", view.decode_pools)):
            for pool in rejection.pools if rejection.role == role else pools:
                demand[pool] += 1

    def _try_admit(self, req: RequestState, view: RoutingView, now: float) -> Rejection | None:
        for role, targets in (("prefill", view.prefill), ("decode", view.decode)):
            if not targets:
                return Rejection(REASON_NO_INSTANCES, self._pools_of[role], role)
        p_pools, p_why = self._open_pools(view, "prefill")
        if not p_pools:
            return p_why
        d_pools, d_why = self._open_pools(view, "decode")
        if not d_pools:
            return d_why
        p = self.selector.pick("prefill", view.prefill, now, pools=p_pools)
        d = self.selector.pick("decode", view.decode, now, pools=d_pools)
        assert p is not None and d is not None
        req.p, req.d = p, d
        req.admitted = now
        self.admission.enter(p.pool)
        req.p_slot = p.pool
        self.admission.enter(d.pool)
        req.d_slot = d.pool
        return None

    def _open_pools(
        self, view: RoutingView, role: Role, held: str | None = None
    ) -> tuple[list[str], Rejection | None]:
        """The pools of ``role`` (in the view) with room for one more request, ``held`` always among them."""
        open_: list[str] = []
        why = None
        for pool in view.prefill_pools if role == "prefill" else view.decode_pools:
            reason = (
                None
                if pool == held
                else self.admission.blocked(pool, view.limits_for(pool, self.fs.default_limits))
            )
            if reason is None:
                open_.append(pool)
            elif why is None:
                why = Rejection(reason, (pool,), role)
        return open_, why

    # -- retries ----------------------------------------------------------------------

    def retry(
        self,
        req: RequestState,
        role: Role,
        exclude: Collection[str],
        spend: Callable[[], bool],
        or_same: bool = False,
    ) -> Target | None:
        """Move ``req`` to another target of ``role`` (not in ``exclude``) that admission lets in, when
        ``spend`` (the retry budget) allows it; None when there is none, or no budget. With ``or_same``
        the current target is the fallback when no other can be had (and its pool has room)."""
        view = self.routing.view
        held = req.p_slot if role == "prefill" else req.d_slot
        pools, _ = self._open_pools(view, role, held)
        current = req.p if role == "prefill" else req.d
        nxt = self.selector.pick(
            role,
            view.prefill if role == "prefill" else view.decode,
            self.clock(),
            exclude=exclude,
            pools=pools,
        )
        if nxt is None and or_same and current is not None and current.pool in pools:
            nxt = current
        if nxt is None or not spend():
            return None
        self._take(req, role, nxt)
        return nxt

    def _take(self, req: RequestState, role: Role, target: Target) -> None:
        if role == "prefill":
            req.p = target
            req.p_slot = self._move_slot(req.p_slot, target.pool)
            return
        req.d = target
        req.d_slot = self._move_slot(req.d_slot, target.pool)
        if req.kv_held is not None and req.kv_held[1] != target.pool:  # the handoff's bytes go with it
            p_pool, d_pool, n = req.kv_held
            self.admission.remove_bytes(d_pool, n)
            self.admission.add_bytes(target.pool, n)
            req.kv_held = (p_pool, target.pool, n)

    def _move_slot(self, old: str | None, new: str) -> str:
        if old != new:
            if old is not None:
                self.admission.leave(old)
            self.admission.enter(new)
        return new

    # -- what the request holds -------------------------------------------------------

    def hold_kv(self, req: RequestState, kv: int) -> None:
        """P has answered: its handoff bytes count in both pools, and the P slot is free again."""
        assert req.p is not None and req.d is not None
        self.drop_kv(req)
        self.admission.add_bytes(req.p.pool, kv)
        self.admission.add_bytes(req.d.pool, kv)
        req.kv_held = (req.p.pool, req.d.pool, kv)
        if req.p_slot is not None:
            self.admission.leave(req.p_slot)
            req.p_slot = None

    def drop_kv(self, req: RequestState) -> None:
        if req.kv_held is not None:
            p_pool, d_pool, n = req.kv_held
            req.kv_held = None
            self.admission.remove_bytes(p_pool, n)
            self.admission.remove_bytes(d_pool, n)

    def release(self, req: RequestState) -> None:
        self.drop_kv(req)
        if req.p_slot is not None:
            self.admission.leave(req.p_slot)
            req.p_slot = None
        if req.d_slot is not None:
            self.admission.leave(req.d_slot)
            req.d_slot = None
