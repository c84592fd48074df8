"""One simulated vLLM engine: continuous batching, KV blocks, NIXL pulls and P-side leases.

The engine is a state machine driven from outside with an explicit clock: ``submit``,
``advance(now)`` (finished transfers, expired leases, heartbeats), ``begin_step(now) ->
duration`` and ``end_step(now)``. It does no I/O and never reads a clock, so unit tests
drive it with a virtual clock (see ``drive``) and the asyncio runner (``runner.py``)
drives it in real time. It talks to other engines only through the ``KVFabric`` seam and
reports what happened only through the ``EngineObserver`` seam (metrics); it must not
know about HTTP, Prometheus or asyncio.

Model, following vLLM V1's scheduler: a waiting queue in arrival order (``scheduling_policy: fcfs``)
or in order of (priority, arrival) (``priority``, vLLM's ``--scheduling-policy priority``); a step
schedules running requests first (1 token per decoding sequence, prefill chunks within a token budget)
then admits waiting requests while KV blocks are free. A request that reaches the end of
its prompt samples a token in that step. Step time = overhead + prefill tokens / rate +
per-sequence cost * batch, times the latency scale and any "slow" fault. A decode (D)
request that carries valid ``kv_transfer_params`` allocates its blocks, pulls the KV
from P through the fabric (stage in_progress), then recomputes one token. P keeps the
blocks of a ``do_remote_decode`` request under a lease until D's pull completes or the
lease expires; D heartbeats every ``heartbeat_s`` while it waits, extending the lease.

Prefix caching (``prefix_caching``, on by default, as in vLLM V1) lives in the block pool
(``prefixcache.py``): a request that carries its prompt's token ids reuses the longest cached
run of its full blocks at admission (at least one token is left to compute) and prefills only
the rest, and every prompt block it fills is cached for later requests. D matches its own
cache first and pulls from P only the blocks it lacks, then caches them (as vLLM does after
``finished_recving``). The pool's cache events are handed to ``on_events`` once per step
(``flush_events``); ``cached_prefix_tokens`` tells what a request would hit now, without
changing anything.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdscope.kvevents import Event
from pdscope.simconfig import SimulatorConfig
from simulator.model import (
    PUSH_REGISTRATION,
    EngineObserver,
    FaultView,
    KVFabric,
    NoFaults,
    NullObserver,
    SimRequest,
    Transfer,
)
from simulator.prefixcache import BlockPool, block_hashes

logger = logging.getLogger(__name__)


@dataclass
class _Lease:
    blocks: list[int]
    expiry: float


class Engine:
    """A simulated vLLM engine. Not thread-safe; one event loop (or one test) drives it."""

    def __init__(
        self,
        name: str,
        role: str,
        cfg: SimulatorConfig,
        *,
        engine_id: str,
        kv_bytes_per_token: int,
        fabric: KVFabric | None = None,
        faults: FaultView | None = None,
        observer: EngineObserver | None = None,
    ) -> None:
        self.name = name
        self.role = role
        self.cfg = cfg
        self.engine_id = engine_id
        self.kv_bytes_per_token = kv_bytes_per_token
        self.fabric = fabric
        self.faults: FaultView = faults or NoFaults()
        self.observer: EngineObserver = observer or NullObserver()
        self.waiting: deque[SimRequest] = deque()
        self.ready: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.loading: dict[str, SimRequest] = {}
        self._transfers: list[tuple[float, int, SimRequest, Transfer]] = []
        self._pending_remote: dict[str, SimRequest] = {}
        self._next_heartbeat: float | None = None
        self.leases: dict[str, _Lease] = {}
        self._lease_heap: list[tuple[float, str]] = []
        self.pool = BlockPool(cfg.kv_capacity_blocks, cfg.block_size, caching=cfg.prefix_caching)
        self._seq = itertools.count()
        self._plan: list[tuple[SimRequest, int]] = []
        self.steps = 0
        self.on_free: Callable[[], None] | None = None
        self.on_events: Callable[[list[Event]], None] | None = None  # the KV events publisher

    # -- capacity ------------------------------------------------------------------

    @property
    def capacity_blocks(self) -> int:
        return max(
            0,
            min(self.cfg.kv_capacity_blocks, self.faults.kv_capacity(self.name, self.cfg.kv_capacity_blocks)),
        )

    @property
    def used_blocks(self) -> int:
        """Blocks requests and leases hold (cached blocks no one holds are free, as in vLLM's usage)."""
        return self.pool.active

    @property
    def kv_cache_usage(self) -> float:
        cap = self.capacity_blocks
        return min(1.0, self.used_blocks / cap) if cap else 1.0

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(max(0, tokens) / self.cfg.block_size)

    def _allocate(self, n: int) -> list[int] | None:
        return self.pool.allocate(n, self.capacity_blocks)

    def _release(self, blocks: list[int]) -> None:
        self.pool.free(blocks)
        blocks.clear()
        if self.on_free is not None and self.waiting:
            self.on_free()  # a blocked admission may fit now (e.g. D's pull freed a P lease)

    # -- prefix cache --------------------------------------------------------------

    def _hashes(self, req: SimRequest) -> list[int]:
        if req.block_hashes is None:
            ids = req.token_ids
            caching = ids is not None and self.cfg.prefix_caching
            req.block_hashes = block_hashes(ids, self.cfg.block_size, req.lora) if caching and ids else []
        return req.block_hashes

    def _hit(self, req: SimRequest, num_tokens: int) -> tuple[list[int], int]:
        """(cached blocks a fresh admission of ``req`` reuses, blocks it takes from the free queue)."""
        hit = self.pool.match(self._hashes(req), num_tokens) if not req.blocks else []
        return hit, self.blocks_for(num_tokens) - len(hit) - len(req.blocks) + self.pool.revived(hit)

    def _take(self, req: SimRequest, hit: list[int], n_new: int) -> list[int]:
        """Reuse ``hit`` and allocate ``n_new`` fresh blocks for ``req`` (the caller checked they fit)."""
        self.pool.touch(hit)
        fresh = self._allocate(n_new) or []
        req.blocks.extend(hit)
        req.blocks.extend(fresh)
        req.stored_blocks = len(hit)
        return fresh

    def _store_full(self, req: SimRequest) -> None:
        """Cache the prompt blocks ``req`` has filled since the last call (vLLM caches full blocks)."""
        ids = req.token_ids
        hashes = self._hashes(req)
        if ids is None or not hashes:
            return
        full = min(req.computed // self.cfg.block_size, len(hashes), len(req.blocks))
        if full > req.stored_blocks:
            self.pool.cache(req.blocks, hashes, ids, req.stored_blocks, full)
            req.stored_blocks = full

    def cached_prefix_tokens(self, token_ids: Sequence[int], lora: str | None = None) -> int:
        """Prompt tokens a new request with ``token_ids`` would find cached here now (capped as an
        admission is: at least one token left to compute). Pure: the cache does not change."""
        if not self.cfg.prefix_caching or not token_ids:
            return 0
        hashes = block_hashes(token_ids, self.cfg.block_size, lora)
        return len(self.pool.match(hashes, len(token_ids))) * self.cfg.block_size

    def flush_events(self) -> None:
        """Hand the KV cache events since the last flush to ``on_events`` (the runner flushes once per
        step, so one step's events make one message, as vLLM publishes them); dropped without a sink."""
        events = self.pool.take_events()
        if events and self.on_events is not None:
            self.on_events(events)

    # -- requests ------------------------------------------------------------------

    def submit(self, req: SimRequest, now: float) -> None:
        req.queued_ts = now
        if req.remote is not None:
            req.kv_stage = "waiting_to_start"
            self._pending_remote[req.internal_id] = req
            if self._next_heartbeat is None:
                self._next_heartbeat = now  # heartbeats start as soon as D has the request
        self._wait(req)

    def _wait(self, req: SimRequest, preempted: bool = False) -> None:
        """Into the waiting queue: fcfs, at its end (a preempted request at its head); priority, after every
        waiter of a lower or equal (priority, arrival), as vLLM's heap orders them (a preempted request
        too: its arrival is its first)."""
        if self.cfg.scheduling_policy == "priority":
            at = bisect.bisect_right(self.waiting, _order(req), key=_order)
            self.waiting.insert(at, req)
        elif preempted:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def abort(self, req: SimRequest, now: float) -> None:
        """Client went away: drop the request wherever it is and free its blocks."""
        if req.finished:
            return
        self._finish(req, "abort", now)

    def crash(self, now: float) -> None:
        """The instance died: every request ends (no metrics: the process is gone)."""
        for req in [*self.waiting, *self.ready, *self.running, *self.loading.values()]:
            if not req.finished:
                req.finish_reason = "abort"
                req.finished_ts = now
                if req.notify is not None:
                    req.notify(req)
        self.waiting.clear()
        self.ready.clear()
        self.running.clear()
        self.loading.clear()
        self.pool.clear()  # the process is gone and its cache with it: AllBlocksCleared

    # -- timers --------------------------------------------------------------------

    def advance(self, now: float) -> None:
        """Apply everything due by ``now``: finished pulls, expired leases, heartbeats."""
        while self._transfers and self._transfers[0][0] <= now:
            _, _, req, t = heapq.heappop(self._transfers)
            if t is req.transfer:  # else superseded (push: the registration's timeout by P's write)
                self._transfer_finished(req, now)
        stalled = self.faults.leases_stalled(self.name)  # a reaper behind: expired leases keep their blocks
        while not stalled and self._lease_heap and self._lease_heap[0][0] <= now:
            _, rid = heapq.heappop(self._lease_heap)
            lease = self.leases.get(rid)
            if lease is None:
                continue
            if lease.expiry > now:
                heapq.heappush(self._lease_heap, (lease.expiry, rid))
                continue
            del self.leases[rid]
            if self.fabric is not None and self.cfg.transfer_mode == "push":
                self.fabric.push_forget(self, rid)
            logger.warning(
                "Releasing expired KV blocks for request %s which were retrieved by %d remote worker(s) "
                "before lease expired.",
                rid,
                0,
            )
            self._release(lease.blocks)
            self.observer.kv_expired()
        if self._next_heartbeat is not None and now >= self._next_heartbeat:
            if not self._pending_remote:
                self._next_heartbeat = None
            else:
                if self.fabric is not None and not self.faults.stops_pulling(self.name):
                    self.fabric.heartbeat([r.remote for r in self._pending_remote.values() if r.remote], now)
                self._next_heartbeat = now + self.cfg.heartbeat_s

    def next_timer(self) -> float | None:
        times = []
        if self._transfers:
            times.append(self._transfers[0][0])
        if self._lease_heap and not self.faults.leases_stalled(self.name):  # the fault's end wakes the runner
            times.append(self._lease_heap[0][0])
        if self._next_heartbeat is not None:
            times.append(self._next_heartbeat)
        return min(times) if times else None

    def _start_transfer(self, req: SimRequest, n_blocks: int, now: float) -> Transfer:
        """Pull: D's READ of P's blocks. Push: D's registration with P; until P writes, a pending
        transfer that fails at the registration timeout."""
        assert self.fabric is not None and req.remote is not None
        if req.remote.mode != "push":
            return self.fabric.start_pull(self.name, req.remote, n_blocks, now)
        t = self.fabric.register_push(self, req, n_blocks, now)
        if t is None:
            wait = self.cfg.push_registration_timeout_s
            t = Transfer(False, now + wait, 0.0, 0.0, 0, 0, PUSH_REGISTRATION + "_timeout")
        return t

    def _post(self, req: SimRequest, t: Transfer) -> None:
        req.transfer = t
        heapq.heappush(self._transfers, (t.done_at, next(self._seq), req, t))

    def push_started(self, req: SimRequest, t: Transfer) -> None:
        """Push mode: P started writing ``req``'s KV into this D's blocks (it lands at ``t.done_at``)."""
        if req.internal_id in self.loading:
            self._post(req, t)
            if self.on_free is not None:
                self.on_free()  # the runner may sleep until a later timer

    def _transfer_finished(self, req: SimRequest, now: float) -> None:
        self.loading.pop(req.internal_id, None)
        self._pending_remote.pop(req.internal_id, None)
        t = req.transfer
        if req.finished or t is None or req.remote is None:
            return
        push = req.remote.mode == "push"
        written = push and not t.reason.startswith(PUSH_REGISTRATION)  # P wrote (or failed to)
        if written and self.fabric is not None:  # P records its write, done or failed
            self.fabric.push_written(req.remote, t, now)
        if not t.ok:
            logger.error(
                "NIXL transfer failure: %s | Context: request_id=%s remote_engine_id=%s remote_request_id=%s",
                t.reason or "transfer_failed",
                req.internal_id,
                req.remote.engine_id,
                req.remote.request_id,
            )
            if not written:  # D's own failure (pull, or a push registration's)
                self.observer.transfer_failed()
            self._finish(req, "error", now)
            return
        if not push:
            self.observer.transfer_done(t)
        if self.fabric is not None and not push:
            self.fabric.finish_pull(req.remote, now)
        req.external_tokens = req.prompt_tokens - req.local_cached_tokens  # D pulled what it lacked
        req.computed = max(req.local_cached_tokens, req.prompt_tokens - 1)  # the last token is recomputed
        self._store_full(req)  # vLLM caches the received blocks after finished_recving
        req.kv_stage = "completed_waiting"
        self.ready.append(req)

    # -- P side: leases ------------------------------------------------------------

    def lease_heartbeat(self, internal_id: str, now: float) -> None:
        lease = self.leases.get(internal_id)
        if lease is not None:
            lease.expiry = max(lease.expiry, now + self.cfg.heartbeat_extend_s)

    def lease_release(self, internal_id: str, now: float) -> None:
        lease = self.leases.pop(internal_id, None)
        if lease is None:
            logger.error(
                "Potentially invalid KV blocks for unrecognized request %s were retrieved by a "
                "decode worker. They may have expired.",
                internal_id,
            )
            self.observer.notification_after_expiry()
            return
        self._release(lease.blocks)

    # -- stepping ------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.running or self.ready or self._admissible_head())

    def _admissible_head(self) -> bool:
        if not self.waiting:
            return False
        head = self.waiting[0]
        if (
            head.remote is not None
            and head.kv_stage == "waiting_to_start"
            and self.faults.stops_pulling(self.name)
        ):
            return False
        _, need = self._hit(head, head.prompt_tokens if head.remote is not None else head.target)
        return self.used_blocks + need <= self.capacity_blocks and len(self.running) < self.cfg.max_num_seqs

    def begin_step(self, now: float) -> float | None:
        """Schedule one step at ``now``; returns its duration, or None when nothing can run."""
        cfg = self.cfg
        self.pool.shrink_to(self.capacity_blocks)  # a KV capacity cut evicts cached blocks first
        while self.ready and len(self.running) < cfg.max_num_seqs:
            req = self.ready.popleft()
            req.kv_stage = None
            if req.scheduled_ts is None:
                req.scheduled_ts = now
            self.running.append(req)
        budget = cfg.max_num_batched_tokens
        plan: list[tuple[SimRequest, int]] = []
        prefill_tokens = 0
        preempted: set[int] = set()
        for req in list(self.running):
            if id(req) in preempted:
                continue
            if req.computed >= req.target:  # decoding: one token, maybe one more block
                if budget <= 0:
                    break
                if self.blocks_for(req.computed + 1) > len(req.blocks) and not self._grow(req, preempted):
                    continue
                plan.append((req, 1))
                budget -= 1
        for req in self.running:
            if req.computed < req.target and budget > 0:
                chunk = min(req.target - req.computed, budget)
                plan.append((req, chunk))
                budget -= chunk
                prefill_tokens += chunk
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            if req.remote is not None and req.kv_stage == "waiting_to_start":
                if self.faults.stops_pulling(self.name) or self.fabric is None:
                    break
                hit, need = self._hit(req, req.prompt_tokens)
                if self.used_blocks + need > self.capacity_blocks:
                    break
                self.waiting.popleft()
                fresh = self._take(req, hit, self.blocks_for(req.prompt_tokens) - len(hit))
                req.local_cached_tokens = len(hit) * cfg.block_size
                self.observer.admitted(req)
                # D pulls from P only the blocks it lacks (P's block ids cover the whole prompt)
                n_blocks = len(fresh)
                if req.remote.block_ids:
                    n_blocks = min(n_blocks, max(0, len(req.remote.block_ids) - len(hit)))
                req.kv_stage = "in_progress"
                self.loading[req.internal_id] = req
                self._post(req, self._start_transfer(req, n_blocks, now))
                continue
            hit, need = self._hit(req, req.target)
            if self.used_blocks + need > self.capacity_blocks:
                break
            self.waiting.popleft()
            self._take(req, hit, self.blocks_for(req.target) - len(hit) - len(req.blocks))
            req.computed = max(req.computed, len(hit) * cfg.block_size)
            if req.scheduled_ts is None:
                req.scheduled_ts = now
                req.local_cached_tokens = len(hit) * cfg.block_size
                self.observer.admitted(req)
            self.running.append(req)
            chunk = min(req.target - req.computed, budget)
            plan.append((req, chunk))
            budget -= chunk
            prefill_tokens += chunk
        if preempted:
            plan = [(r, n) for r, n in plan if id(r) not in preempted]
        if not plan:
            self._plan = []
            return None
        self._plan = plan
        n_seqs = len(plan)
        duration = (
            cfg.step_overhead_s + prefill_tokens / cfg.prefill_tokens_per_s + cfg.decode_per_seq_s * n_seqs
        )
        return duration * cfg.latency_scale * self.faults.compute_factor(self.name)

    def _grow(self, req: SimRequest, preempted: set[int]) -> bool:
        """One more block for a decoding request, preempting (:meth:`_victim`) if needed."""
        while True:
            blocks = self._allocate(1)
            if blocks is not None:
                req.blocks.extend(blocks)
                return True
            victim = self._victim(req)
            self.running.remove(victim)
            self._release(victim.blocks)
            victim.stored_blocks = 0
            victim.target = victim.prompt_tokens + victim.generated
            victim.computed = 0
            victim.num_preemptions += 1
            preempted.add(id(victim))
            self._wait(victim, preempted=True)
            self.observer.preempted()
            if victim is req:
                return False

    def _victim(self, req: SimRequest) -> SimRequest:
        """Whom a decoding ``req`` short of a block preempts: fcfs, the newest other running request (``req``
        itself when alone); priority, the running request of the largest (priority, arrival), ``req``
        included (vLLM's ``max(running, key=(priority, arrival_time))``)."""
        if self.cfg.scheduling_policy == "priority":
            return max(self.running, key=_order)
        victims = [r for r in self.running if r is not req]
        return victims[-1] if victims else req

    def end_step(self, now: float) -> None:
        """Apply the step planned by ``begin_step``: KV computed, tokens sampled, requests done."""
        plan, self._plan = self._plan, []
        self.steps += 1
        prompt_computed = 0
        sampled = 0
        for req, n in plan:
            if req.finished:
                continue
            if req.computed < req.target and not req.external_tokens:
                prompt_computed += n  # vLLM counts computed prompt tokens, not the recomputed one
            req.computed += n
            self._store_full(req)
            if req.computed < req.target:
                continue
            req.generated += 1
            sampled += 1
            if req.first_token_ts is None:
                req.first_token_ts = now
                self.observer.first_token(req, now)
            elif req.last_token_ts is not None:
                self.observer.inter_token(now - req.last_token_ts)
            req.last_token_ts = now
            if req.generated >= req.max_tokens:
                self._finish(req, "stop" if req.stop_at_max else "length", now)
            elif req.notify is not None:
                req.notify(req)
        self.observer.step(prompt_computed + sampled, sampled)

    def _finish(self, req: SimRequest, reason: str, now: float) -> None:
        req.finish_reason = reason
        req.finished_ts = now
        if req in self.running:
            self.running.remove(req)
        elif req.kv_stage == "waiting_to_start" and req in self.waiting:
            self.waiting.remove(req)
        elif req in self.ready:
            self.ready.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.loading.pop(req.internal_id, None)
        self._pending_remote.pop(req.internal_id, None)
        if reason in ("length", "stop") and req.do_remote_decode and req.blocks:
            lease = _Lease(blocks=req.blocks, expiry=now + self.cfg.lease_duration_s)
            req.leased_block_ids = tuple(req.blocks)
            req.blocks = []
            self.leases[req.internal_id] = lease
            heapq.heappush(self._lease_heap, (lease.expiry, req.internal_id))
            if self.cfg.transfer_mode == "push" and self.fabric is not None:
                self.fabric.push_ready(self, req, now)
        elif req.blocks:
            self._release(req.blocks)
        self.observer.finished(req, now)
        if req.notify is not None:
            req.notify(req)

    def queued(self) -> tuple[int, int]:
        """(requests not yet running, prompt tokens of requests still in prefill), for admission limits."""
        queued = len(self.waiting) + len(self.loading) + len(self.ready)
        tokens = sum(r.prompt_tokens for r in (*self.waiting, *self.loading.values(), *self.ready))
        tokens += sum(r.prompt_tokens for r in self.running if r.first_token_ts is None)
        return queued, tokens

    # -- gauges --------------------------------------------------------------------

    def gauges(self) -> dict[str, float]:
        stalled = sum(1 for r in self.waiting if r.kv_stage == "waiting_to_start")
        deferred = len(self.loading) + len(self.ready)
        return {
            "running": float(len(self.running)),
            "waiting_capacity": float(len(self.waiting) - stalled),
            "waiting_deferred": float(deferred + stalled),
            "waiting_to_start": float(stalled),
            "in_progress": float(len(self.loading)),
            "completed_waiting": float(len(self.ready)),
            "kv_cache_usage": self.kv_cache_usage,
        }


def _order(req: SimRequest) -> tuple[int, float]:
    """The priority policy's order: lower priority first, then earlier arrival."""
    return req.priority, req.arrival


def drive(engine: Engine, until: float, now: float = 0.0, max_steps: int = 1_000_000) -> float:
    """Run ``engine`` on a virtual clock from ``now`` to ``until``; returns the final time."""
    for _ in range(max_steps):
        engine.advance(now)
        if now >= until:
            engine.flush_events()
            return now
        if engine.has_work():
            duration = engine.begin_step(now)
            if duration is not None:
                now += duration
                engine.end_step(now)
                engine.flush_events()
                continue
        engine.flush_events()
        nxt = engine.next_timer()
        if nxt is None or nxt > until:
            return until
        now = max(now, nxt)
    return now
