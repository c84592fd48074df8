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

KV-aware routing (``proxy.kv_aware.mode`` not off, or a view the app was given): the flow
asks :meth:`Gate.key_prompt` once per request, before admission (CPU work bounded by the
view's size cap, never a wait); a request the view keyed is admitted by the cost model
(``proxy.kvaware``) over the same open pools and eligible instances the load-only pick would
use, and may be admitted into a D pool alone (the decode-only path: no P slot, no handoff).
Admitted, the view is told where it went (``routed``). A request the view cannot key, or a
view that fails, is routed load-only (reason ``no_prompt`` / ``view_error``; failures counted in
``pdscope_proxy_kv_view_errors_total``). Retries are always load-only picks
(:meth:`proxy.selection.Selector.pick`): the first choice already spent the prefix's credit,
and a retry's target is one the cost model did not prefer, so load is what is left to go by.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from pdscope import semconv as sc
from pdscope.routing import Role
from proxy.admission import (
    REASON_NO_INSTANCES,
    REASON_PREDICTED_LATE,
    REASON_QUEUE_FULL,
    REASON_REQUESTS,
    Admission,
    Rejection,
)
from proxy.fairqueue import REASON_RESERVE, REASON_SHED, Ticket, Work
from proxy.kvaware import (
    REASON_KEYING_BUSY,
    REASON_NO_PROMPT,
    REASON_VIEW_ERROR,
    Candidate,
    CostModel,
    Decision,
    choose,
)
from proxy.metrics import ProxyMetrics
from proxy.pairs import PairProbes
from proxy.predict import Outlook, Predictor, late_decodes, outlook
from proxy.prefixview import CacheView, Prompt
from proxy.priority import request_priority
from proxy.request import FlowSettings, RequestState
from proxy.routing import RoutingState, RoutingView, Target
from proxy.selection import Selector

log = logging.getLogger(__name__)


OFFLOAD_BYTES = 32 * 1024  # a body this large is keyed off the event loop (when the view allows it)
OFFLOAD_MAX = 32  # long prompts being keyed at once; past it a request routes load-only (keying_busy)


class KvRouting:
    """A cache view and the cost model, as the gate uses them: every call to the view is caught
    (counted, logged at debug) so that a failing view costs only the KV-aware part of a request.
    ``backlog``: per P, the uncached prefill tokens sent to it and not yet answered.

    With ``offload`` (the precise view: its tokenizer runs in Rust without the GIL), a body of
    ``OFFLOAD_BYTES`` or more is keyed on a worker thread, so a long prompt (up to the tokenizer's
    size cap, a second of tokenizing or more) never stalls the event loop and every other request
    on it; at most ``OFFLOAD_MAX`` at once, and past that the request routes load-only.

    P's backlog (uncached prefill tokens sent and not yet answered) is the predictor's
    (:attr:`proxy.predict.Predictor.backlog`), for every request, keyed or not."""

    def __init__(
        self,
        view: CacheView,
        model: CostModel,
        metrics: ProxyMetrics,
        rng: random.Random | None = None,
        offload: bool = False,
    ) -> None:
        self.view, self.model, self.metrics = view, model, metrics
        self.rng = rng or random.Random()
        self.offload = offload
        self.offloaded = 0  # keyings on the worker threads now
        self._pool: ThreadPoolExecutor | None = None

    async def prompt_of(
        self, endpoint: str, body: Mapping[str, Any], size: int
    ) -> tuple[Prompt | None, str | None]:
        """:meth:`prompt`, on a worker thread when the body is long and the view allows it."""
        if not self.offload or size < OFFLOAD_BYTES:
            return self.prompt(endpoint, body)
        if self.offloaded >= OFFLOAD_MAX:
            return None, REASON_KEYING_BUSY
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-keying")
        self.offloaded += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self.prompt, endpoint, body)
        finally:
            self.offloaded -= 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def prompt(self, endpoint: str, body: Mapping[str, Any]) -> tuple[Prompt | None, str | None]:
        """The request's prompt, or (None, why it routes load-only)."""
        try:
            prompt = self.view.prompt(endpoint, body)
        except Exception as exc:  # a view's bug must not fail the request
            self._failed("prompt", exc)
            return None, REASON_VIEW_ERROR
        if prompt is None:
            return None, REASON_NO_PROMPT
        return prompt, None

    def cached(self, prompt: Prompt, instances: Sequence[str]) -> dict[str, int] | None:
        try:
            return self.view.cached(prompt, instances)
        except Exception as exc:
            self._failed("cached", exc)
            return None

    def routed(self, prompt: Prompt, instances: Sequence[str], now: float) -> None:
        try:
            self.view.routed(prompt, instances, now)
        except Exception as exc:
            self._failed("routed", exc)

    def settled(self, req: RequestState) -> None:
        """A finished request's credited prediction against the cached tokens vLLM reported, for a
        view that checks them (the precise view: ``proxy.kvtrust``); only the instance the cost model
        chose and the request kept (no retry): P on the P/D path, D alone on the decode-only path
        (on the P/D path D's count includes the KV it pulled from P)."""
        verify = getattr(self.view, "verify", None)
        route = req.route
        if verify is None or route is None:
            return
        try:  # the prompt's length as the view estimated it and as vLLM counted it
            if route.p is not None and req.p is route.p and req.prefill is not None:
                counted = (route.prompt_tokens, req.prefill.prompt_tokens)
                verify(route.p.name, route.p_cached, req.prefill.cached_tokens, counted)
            elif route.p is None and req.d is route.d:
                counted = (route.prompt_tokens, req.d_prompt_tokens or 0)
                verify(route.d.name, route.d_cached, req.d_cached_tokens, counted)
        except Exception as exc:
            self._failed("verify", exc)

    def _failed(self, call: str, exc: Exception) -> None:
        self.metrics.kv_view_errors.labels(call).inc()
        log.debug("kv view: %s failed", call, exc_info=exc)

    def count(self, req: RequestState) -> None:
        """An admitted request's route, in ``pdscope_proxy_routes_total`` and the predictions' counters."""
        m, route = self.metrics, req.route
        if route is None:
            m.routes.labels(sc.ROUTE_PD, req.route_reason or REASON_NO_PROMPT).inc()
            return
        m.routes.labels(sc.ROUTE_PD if route.p is not None else sc.ROUTE_DECODE_ONLY, route.reason).inc()
        m.prompt_tokens_routed.inc(route.prompt_tokens)
        if route.p is not None:
            m.predicted_cached.labels("prefill").inc(route.p_cached)
        m.predicted_cached.labels("decode").inc(route.d_cached)


class Gate:
    def __init__(
        self,
        fs: FlowSettings,
        routing: RoutingState,
        selector: Selector,
        admission: Admission,
        clock: Callable[[], float],
        kv: KvRouting | None = None,
        metrics: ProxyMetrics | None = None,
    ) -> None:
        self.fs, self.routing, self.selector, self.admission, self.clock = (
            fs,
            routing,
            selector,
            admission,
            clock,
        )
        self.kv = kv
        self.metrics = metrics
        self.predictor = Predictor(fs.predict, fs.prefill_tokens_per_s, clock)
        self.predictor.by_priority = fs.priority_ps
        # admission by prediction: the weighted proxy only (round-robin stays the toy proxy's baseline)
        self.by_prediction = fs.predict.admit and selector.policy == "weighted"
        self.pairs = PairProbes(fs.pair_probe_s)
        self._table: object = None
        pools = routing.settings.pools
        self._pools_of: dict[str, tuple[str, ...]] = {
            role: tuple(name for name, p in pools.items() if p.role == role) for role in ("prefill", "decode")
        }

    # -- the first pick ---------------------------------------------------------------

    async def key_prompt(self, req: RequestState, body: Mapping[str, Any], size: int) -> None:
        """With KV-aware routing: ``req``'s prompt as the view keys it (or why it routes load-only);
        ``size``: the body's length in bytes (a long one may be keyed off the event loop)."""
        if self.kv is not None:
            req.prompt, req.route_reason = await self.kv.prompt_of(req.endpoint, body, size)

    async def admit(self, req: RequestState) -> Rejection | None:
        """Admit ``req`` into a P and a D pool (or, decode-only, a D pool alone), waiting for room
        within the queue bound; or why not."""
        rejection = await self._admit(req)
        self._count_demand(req, rejection)
        if rejection is None and self.kv is not None:
            self._routed(self.kv, req)
        return rejection

    def _routed(self, kv: KvRouting, req: RequestState) -> None:
        kv.count(req)
        if req.prompt is not None and req.route is not None:
            assert req.d is not None
            names = [req.d.name] if req.p is None else [req.p.name, req.d.name]
            kv.routed(req.prompt, names, self.clock())

    async def _admit(self, req: RequestState) -> Rejection | None:
        """Admit ``req`` now, or wait for a pool's room while it can still make its target (with
        admission by prediction) and the queue bound allows; or why not. With tenants, through the
        fair queue (``proxy.fairqueue``): it waits while a waiter ranks before it."""
        deadline = self.clock() + self.routing.view.queue_wait_s(self.fs.queue_timeout_s)
        self._sync_table()
        fair = self.admission.fair
        if fair is None:
            return await self._admit_loop(req, deadline, None)
        ticket = fair.arrive(req.tenant)
        try:
            return await self._admit_loop(req, deadline, ticket)
        finally:
            if ticket.queued:
                fair.leave(ticket)
                self.admission.wake(fair.order()[:1])  # the next one may try (there may be room)

    async def _admit_loop(
        self, req: RequestState, deadline: float, ticket: Ticket | None
    ) -> Rejection | None:
        last: Rejection | None = None
        while True:
            now, view = self.clock(), self.routing.view
            if ticket is not None and ticket.shed:
                return Rejection(REASON_SHED, view.prefill_pools or self._pools_of["prefill"], "prefill")
            self._prioritize(req)
            names = self._predicted_over(view, now)
            look = self._outlook(req, names, now)
            if look is not None and look.hopeless:
                return self._late(req, view, look)
            late = (look.late if look is not None else frozenset()) | self._reserved(req, names)
            blocked = self._blocked_by_waiter(ticket, last, view)
            kept_out = None if blocked else self._kept_out(late, view)
            if ticket is not None:
                ticket.held = kept_out is not None  # by its own line (behind a waiter: that one holds)
            rejection = blocked or kept_out or self._try_admit(req, view, now, late)
            if rejection is None:
                self._predicted(req, now)
                self._charge(req)
                return None
            if rejection.reason == REASON_NO_INSTANCES:
                return rejection
            last = rejection
            until = deadline if look is None else min(deadline, now + look.slack_s)
            if until - now <= 0:
                return rejection
            refused = self._queue(ticket, rejection, tried=blocked is None)
            if refused is not None:
                return refused
            if ticket is None:
                await self.admission.wait(until - now, until)
            else:
                await self.admission.wait_ticket(ticket, until - now)

    def _prioritize(self, req: RequestState) -> None:
        """With tenants and priority-scheduled instances: the priority its legs carry there now (its class,
        and whether its tenant is past its share: ``proxy.priority``)."""
        fair = self.admission.fair
        if fair is not None and self.fs.priority_ps:
            req.priority = request_priority(fair.rank_of(req.tenant), fair.over_share(req.tenant))

    def _kept_out(self, late: frozenset[str], view: RoutingView) -> Rejection | None:
        """Every P is late for it or behind its tenant's reserve line (the line, then: the late alone are
        hopeless and answered before): it waits for P's queues to drain, as for a pool's room."""
        if late and all(t.name in late for t in view.prefill):
            return Rejection(REASON_RESERVE, view.prefill_pools or self._pools_of["prefill"], "prefill")
        return None

    def _blocked_by_waiter(
        self, ticket: Ticket | None, last: Rejection | None, view: RoutingView
    ) -> Rejection | None:
        """With tenants: a waiter ranks before ``ticket``, so it may not try the pools (it waits, and a
        timeout says why the queue formed: the last pool that was full); None: it may try."""
        fair = self.admission.fair
        if ticket is None or fair is None or not fair.ahead(ticket):
            return None
        return last or Rejection(REASON_REQUESTS, view.prefill_pools or self._pools_of["prefill"], "prefill")

    def _queue(self, ticket: Ticket | None, rejection: Rejection, tried: bool) -> Rejection | None:
        """Take a place among the waiters (kept across its waits), or why there is none. With tenants
        a higher class may shed a lower waiter to get one: that waiter is woken to end; and a refusal by
        the pools (``tried``) tells the fair queue which pool the waiters wait for."""
        fair = self.admission.fair
        if ticket is not None and fair is not None and tried:
            fair.blocked(rejection.role)
        if ticket is None or fair is None:
            if self.admission.can_wait():
                return None
            return Rejection(REASON_QUEUE_FULL, rejection.pools, rejection.role)
        if ticket.queued:
            return None
        why, victim = fair.enqueue(ticket)
        if victim is not None:
            self.admission.wake([victim])
        return None if why is None else Rejection(why, rejection.pools, rejection.role)

    def _charge(self, req: RequestState) -> None:
        """With tenants: the admitted request's work charged to its tenant (``proxy.fairqueue.Work``: the
        prompt tokens P computes after the predicted cache hits, or D alone what it does not hold; the KV
        D holds; its decode steps at ``max_tokens``, corrected when it ends)."""
        fair = self.admission.fair
        if fair is None:
            return
        route = req.route
        if route is None:
            work = Work(p_prefill=req.tokens, context=req.tokens, decode=req.decode_tokens)
        elif route.p is not None:
            work = Work(p_prefill=route.p_uncached, context=route.prompt_tokens, decode=req.decode_tokens)
        else:  # D alone computes what it does not hold
            uncached = route.prompt_tokens - route.d_cached
            work = Work(d_prefill=uncached, context=route.prompt_tokens, decode=req.decode_tokens)
        fair.admitted(req.tenant, work)
        req.charged = work

    # -- the predictor ----------------------------------------------------------------

    def _sync_table(self) -> None:
        """A new routing table: its rates are the predictor's prior, this proxy's share its scale."""
        table = self.routing.table
        if table is self._table:
            return
        self._table = table
        share = self.routing.share
        parts = (
            []
            if share is None
            else [share.pools[p].share for p in self._pools_of["prefill"] if p in share.pools]
        )
        self.predictor.use_table(
            table.rates if table is not None else None, sum(parts) / len(parts) if parts else None
        )

    def _predicted_over(self, view: RoutingView, now: float) -> tuple[list[str], list[str]] | None:
        """With admission by prediction, the Ps and Ds a pick may weigh (by name); else None."""
        if not self.by_prediction or not view.prefill:
            return None
        ps = [t.name for t, _ in self.selector.weighed(view.prefill, now)]
        return ps, [t.name for t, _ in self.selector.weighed(view.decode, now)]

    def _outlook(
        self, req: RequestState, names: tuple[list[str], list[str]] | None, now: float
    ) -> Outlook | None:
        """Which Ps (of ``names``: :meth:`_predicted_over`) the request would be late through; None
        without admission by prediction."""
        if names is None:
            return None
        ps, ds = names
        pred, elapsed = self.predictor, now - req.started
        look = outlook(
            pred, dict.fromkeys(ps, req.tokens), ps, ds, elapsed, req.target_s, req.tokens, req.priority
        )
        if look.hopeless and req.prompt is not None and self.kv is not None:
            cached = self.kv.cached(req.prompt, ps) or {}  # a P holding the prefix computes less
            own = {p: req.tokens - min(max(int(cached.get(p, 0)), 0), req.tokens) for p in ps}
            look = outlook(pred, own, ps, ds, elapsed, req.target_s, req.tokens, req.priority)
        return look

    def _reserved(self, req: RequestState, names: tuple[list[str], list[str]] | None) -> frozenset[str]:
        """With tenants and admission by prediction: the Ps (of ``names``) ``req`` may not go to now,
        because the queue it would leave there (its own prefill included, not its wait so far) is past the
        line its tenant must keep the reserve behind (``FairQueue.reserve_line``); none when no line
        applies."""
        fair = self.admission.fair
        if fair is None or names is None:
            return frozenset()
        line = fair.reserve_line(req.tenant)
        if line is None:
            return frozenset()
        ps, ds = names
        own = dict.fromkeys(ps, req.tokens)
        return outlook(self.predictor, own, ps, ds, 0.0, line, req.tokens, req.priority).late

    def _late(self, req: RequestState, view: RoutingView, look: Outlook) -> Rejection:
        """Every P is predicted late: rejected now, with when a request like it would make it."""
        req.predicted = look.best_s
        return Rejection(
            REASON_PREDICTED_LATE,
            view.prefill_pools or self._pools_of["prefill"],
            "prefill",
            retry_after_s=look.best_s - look.budget_s,
        )

    def _predicted(self, req: RequestState, now: float) -> None:
        """Admitted: the predicted TTFT of the chosen P and D, and its tokens join P's backlog."""
        p, d = req.p, req.d
        if p is None or d is None:  # D alone computes the prompt: no P part to predict with
            return
        pred = self.predictor
        own = req.route.p_uncached if req.route is not None else req.tokens
        est = pred.prefill(p.name, own, req.priority)
        req.handoff_x = pred.handoff_x(p.name, d.name, req.tokens)
        req.handoff_s = pred.handoff(p.name, d.name, req.handoff_x)
        req.predicted = now - req.started + est.seconds + req.handoff_s
        req.tokens_ahead, req.predicted_x, req.predicted_source = est.ahead, est.ahead + own, est.source
        req.predicted_sure = est.confident
        req.backlog = (p.name, pred.sent_to_p(p.name, own, est.seconds, req.priority, est.ahead), own)
        if req.tokens > 0:
            pred.sent_to_d(p.name, d.name, req.tokens)
            req.d_backlog = (p.name, d.name, req.tokens)

    def first_token(self, req: RequestState, now: float) -> None:
        """D's first token: the handoff's time teaches the pair, the TTFT the predictor's error. A
        non-streamed answer arrives whole: what the proxy sees first is the end of its decode, which is
        neither a handoff nor the TTFT predicted, so it teaches neither (one such answer of a few
        seconds once counted as a handoff of that D)."""
        pred = self.predictor
        self._drop_d_backlog(req, arrived=True)
        if not req.stream:
            return
        if (
            req.p is not None
            and req.d is not None
            and req.retries == 0
            and req.p_done_ns
            and req.first_token_ns
        ):
            handoff_s = (req.first_token_ns - req.p_done_ns) / 1e9
            pred.observe_handoff(req.p.name, req.d.name, req.handoff_x, handoff_s)
        if req.predicted is not None and req.p is not None:
            # a retry's TTFT holds a failure: it measures the fault, not the model (kept out of P's error)
            sure = req.predicted_sure and req.retries == 0
            ratio = pred.observe_ttft(req.p.name, req.predicted, now - req.started, sure)
            if ratio is not None and self.metrics is not None:
                self.metrics.ttft_prediction_ratio.labels(req.p.pool).observe(ratio)

    def _count_demand(self, req: RequestState, rejection: Rejection | None) -> None:
        """One demand per role: the pool admitted into, else the pools the rejection names (or, for
        the role it did not get to, every pool of that role in the view)."""
        demand = self.admission.demand
        if rejection is None:
            assert req.d is not None
            if req.p is not None:  # None: decode-only, it sought no P
                demand[req.p.pool] += 1
            demand[req.d.pool] += 1
            return
        view = self.routing.view
        for role, pools in (("prefill", view.prefill_pools), ("decode", view.decode_pools)):
            for pool in rejection.pools if rejection.role == role else pools:
                demand[pool] += 1

    def _try_admit(
        self, req: RequestState, view: RoutingView, now: float, late: frozenset[str] = frozenset()
    ) -> Rejection | None:
        """Into the open pools, never through a P in ``late`` (predicted to miss the target)."""
        if req.prompt is not None and self.kv is not None:
            return self._try_admit_kv(self.kv, req.prompt, req, view, now, late)
        by_role: tuple[tuple[Role, tuple[Target, ...]], ...] = (
            ("prefill", view.prefill),
            ("decode", view.decode),
        )
        for role, targets in by_role:
            if not targets:
                return Rejection(REASON_NO_INSTANCES, self._pools_of[role], role)
        p_pools, p_why = self._open_pools(view, "prefill")
        if not p_pools:
            return p_why
        d_pools, d_why = self._open_pools(view, "decode")
        if not d_pools:
            return d_why
        p = self.selector.pick("prefill", view.prefill, now, exclude=late, pools=p_pools)
        if p is None:  # the open pools' Ps are all late; one in time is in a full pool
            return p_why or Rejection(REASON_REQUESTS, tuple(p_pools), "prefill")
        late_ds = self._late_ds(req, p, view, now) | view.never.get(p.name, frozenset())
        skip = self._avoided_ds(view, p.name, d_pools, late_ds, now)
        d = self.selector.pick(
            "decode", view.decode, now, exclude=late_ds | skip if skip else late_ds, pools=d_pools
        )
        if d is None:  # every D P may be paired with is in a full pool (or late)
            return d_why or Rejection(REASON_REQUESTS, tuple(d_pools), "decode")
        if view.avoid:
            self.pairs.picked(view.avoid, p.name, d.name, now)
        req.p, req.d = p, d
        req.admitted = now
        self.admission.enter(p.pool)
        req.p_slot = p.pool
        self.admission.enter(d.pool)
        req.d_slot = d.pool
        return None

    def _try_admit_kv(
        self,
        kv: KvRouting,
        prompt: Prompt,
        req: RequestState,
        view: RoutingView,
        now: float,
        late: frozenset[str] = frozenset(),
    ) -> Rejection | None:
        """The cost model's pick over the open pools' eligible instances; D alone when it says so
        (then P's pools need no room). Rejections as the load-only path's, P's first."""
        p_why: Rejection | None = None
        p_cands: list[Candidate] = []
        if not view.prefill:
            p_why = Rejection(REASON_NO_INSTANCES, self._pools_of["prefill"], "prefill")
        else:
            p_pools, p_why = self._open_pools(view, "prefill")
            if p_pools:
                p_why = None
                p_cands = [
                    c for c in self._candidates(view.prefill, now, p_pools, True) if c.target.name not in late
                ]
                if not p_cands:  # the open pools' Ps are all late; one in time is in a full pool
                    p_why = Rejection(REASON_REQUESTS, tuple(p_pools), "prefill")
        if not view.decode:
            return p_why or Rejection(REASON_NO_INSTANCES, self._pools_of["decode"], "decode")
        d_pools, d_why = self._open_pools(view, "decode")
        if not d_pools:
            return p_why or d_why
        d_cands = self._candidates(view.decode, now, d_pools, False)
        cached = kv.cached(prompt, [c.target.name for c in (*p_cands, *d_cands)])
        if cached is None:  # the view failed: this request goes load-only
            req.prompt, req.route_reason = None, REASON_VIEW_ERROR
            return self._try_admit(req, view, now, late)
        decision = choose(prompt, cached, p_cands, d_cands, kv.model, kv.rng)
        if decision is None:  # no P with room (or none routable), and not one for D alone; or no D
            if not d_cands:
                return Rejection(REASON_NO_INSTANCES, self._pools_of["decode"], "decode")
            return p_why or Rejection(REASON_NO_INSTANCES, self._pools_of["prefill"], "prefill")
        moved = self._off_avoided(decision, view, d_pools, now)
        if moved is None:  # its P may be paired with no D of the open pools
            return Rejection(REASON_REQUESTS, tuple(d_pools), "decode")
        self._enter(req, moved, kv, now)
        return None

    def _off_avoided(
        self, decision: Decision, view: RoutingView, d_pools: Collection[str], now: float
    ) -> Decision | None:
        """The cost model's choice, its D moved off a pair the table says to leave out (not due a probe) or
        never to pair (incompatible); None when the only Ds left are never to pair with its P."""
        p = decision.p
        if p is None or not (view.avoid or view.never):
            return decision
        never = view.never.get(p.name, frozenset())
        skip = self._avoided_ds(view, p.name, d_pools, never, now) | never
        if decision.d.name in skip:
            d = self.selector.pick("decode", view.decode, now, exclude=skip, pools=d_pools)
            if d is None and decision.d.name in never:
                return None
            if d is not None:
                decision = replace(decision, d=d, d_cached=0)
        self.pairs.picked(view.avoid, p.name, decision.d.name, now)
        return decision

    def _avoided_ds(
        self, view: RoutingView, p: str, d_pools: Collection[str], late: Collection[str], now: float
    ) -> frozenset[str]:
        """The Ds a pick with ``p`` leaves out for the table's ``avoid_pairs`` (``proxy.pairs``), among those
        of ``d_pools`` not ``late``; nothing to do (the common case) while the table avoids no pair of it."""
        if p not in view.avoid:
            return frozenset()
        ds = [t.name for t in view.decode if t.pool in d_pools and t.name not in late]
        return self.pairs.left_out(view.avoid, p, ds, now)

    def _candidates(
        self, targets: Sequence[Target], now: float, pools: Collection[str], p: bool
    ) -> list[Candidate]:
        """The cost model's candidates; a P's with its backlog and the predictor's rate for it."""
        load, pred = self.selector.inflight, self.predictor
        if not p:
            return [
                Candidate(t, w, load.get(t.name, 0)) for t, w in self.selector.weighed(targets, now, pools)
            ]
        return [
            Candidate(t, w, load.get(t.name, 0), pred.tokens_ahead(t.name), pred.rate(t.name))
            for t, w in self.selector.weighed(targets, now, pools)
        ]

    def _late_ds(self, req: RequestState, p: Target, view: RoutingView, now: float) -> set[str]:
        """The Ds through which ``p`` would be late (none when admission is not by prediction)."""
        if not self.by_prediction:
            return set()
        est = self.predictor.prefill(p.name, req.tokens, req.priority)
        ds = [t.name for t in view.decode]
        elapsed = now - req.started
        return late_decodes(self.predictor, p.name, est, ds, elapsed, req.target_s, req.tokens)

    def _enter(self, req: RequestState, decision: Decision, kv: KvRouting, now: float) -> None:
        req.route = decision
        if decision.p is not None:
            req.p = decision.p
            self.admission.enter(decision.p.pool)
            req.p_slot = decision.p.pool
        req.d = decision.d
        req.admitted = now
        self.admission.enter(decision.d.pool)
        req.d_slot = decision.d.pool

    def _drop_backlog(self, req: RequestState) -> None:
        """``req``'s prefill is answered (or moved, or over): its tokens leave its P's backlog."""
        if req.backlog is not None:
            name, ticket, n = req.backlog
            req.backlog = None
            self.predictor.left_p(name, ticket, n)
            if self.admission.fair is not None:
                self.admission.notify()  # a waiter kept behind its reserve line may fit now

    def _drop_d_backlog(self, req: RequestState, arrived: bool = False) -> None:
        """``req`` has its first token (``arrived``), or moved to another D, or is over: it leaves its
        D's backlog."""
        if req.handoff_flying is not None:
            p, d, ticket = req.handoff_flying
            req.handoff_flying = None
            self.predictor.handoff_ended(p, d, ticket, arrived)
        if req.d_backlog is not None:
            p, d, n = req.d_backlog
            req.d_backlog = None
            self.predictor.left_d(p, d, n)

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
            exclude=self._never_with(view, req, role, exclude),
            pools=pools,
        )
        if nxt is None and or_same and current is not None and current.pool in pools:
            nxt = current
        if nxt is None or not spend():
            return None
        self._take(req, role, nxt)
        return nxt

    @staticmethod
    def _never_with(
        view: RoutingView, req: RequestState, role: Role, exclude: Collection[str]
    ) -> Collection[str]:
        """``exclude``, and the targets of ``role`` never to pair with the request's other side."""
        if not view.never:
            return exclude
        if role == "decode":
            never = view.never.get(req.p.name, frozenset()) if req.p is not None else frozenset()
        else:
            d = req.d.name if req.d is not None else None
            never = frozenset(p for p, ds in view.never.items() if d in ds)
        return frozenset(exclude) | never if never else exclude

    def _take(self, req: RequestState, role: Role, target: Target) -> None:
        if role == "prefill":
            if req.backlog is not None:
                self._drop_backlog(req)
            req.p = target
            req.p_slot = self._move_slot(req.p_slot, target.pool)
            return
        req.d = target
        self._drop_d_backlog(req)
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
        if req.backlog is not None and self.predictor.ranked.passed(req.backlog[1]):
            req.predicted_sure = False  # passed in P's queue: neither P's rate nor the model's noise
        elif req.retries == 0 and req.predicted is not None and req.p_sent_ns and req.p_done_ns:
            self.predictor.observe_prefill(req.p.name, req.predicted_x, (req.p_done_ns - req.p_sent_ns) / 1e9)
        if req.backlog is not None:
            self._drop_backlog(req)
        self._handoff_began(req)
        if req.p_slot is not None:
            self.admission.leave(req.p_slot)
            req.p_slot = None

    def _handoff_began(self, req: RequestState) -> None:
        """A streamed request's handoff is in flight from P's answer to its first token, on the pair it
        was predicted for (a retry's or a moved request's is not that prediction's). A non-streamed
        answer shows no first token before its whole decode, which no handoff prediction covers."""
        if (
            req.stream
            and req.retries == 0
            and req.handoff_s is not None
            and req.handoff_flying is None
            and req.d_backlog is not None
        ):
            p, d, _ = req.d_backlog
            req.handoff_flying = (p, d, self.predictor.handoff_began(p, d, req.handoff_s))

    def drop_kv(self, req: RequestState) -> None:
        if req.kv_held is not None:
            p_pool, d_pool, n = req.kv_held
            req.kv_held = None
            self.admission.remove_bytes(p_pool, n)
            self.admission.remove_bytes(d_pool, n)

    def release(self, req: RequestState) -> None:
        fair = self.admission.fair
        if fair is not None and req.charged is not None:
            fair.finished(req.tenant, req.charged, req.completion_tokens)
            req.charged = None
        self.drop_kv(req)
        self._drop_backlog(req)
        self._drop_d_backlog(req)
        if req.p_slot is not None:
            self.admission.leave(req.p_slot)
            req.p_slot = None
        if req.d_slot is not None:
            self.admission.leave(req.d_slot)
            req.d_slot = None
