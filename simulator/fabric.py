"""The simulated NIXL fabric between P and D engines of one fleet.

D engines call ``start_pull`` (a NIXL READ of P's leased blocks), ``finish_pull`` (the
"done" notification that lets P free them) and ``heartbeat`` (lease extension). The
fabric finds P by ``remote_engine_id`` and models each P x D link as one FIFO resource:
a READ starts when the link is free, takes ``bytes / bandwidth + descriptors * cost``
(times the link's fault factor and the latency scale), and fails with the fault's rate
(decided by a seeded RNG). A READ of blocks whose lease already expired still succeeds,
as on real vLLM 0.32 (the blocks are free but not yet reused; see the lease-expiry
capture in tests/fixtures/vllm-0.32.0-cpu); P then counts a notification after expiry.
A P that is down or unknown fails the handshake. It is pure: time comes in as arguments.

Push mode (vLLM's NixlPushConnector): D registers its allocated blocks with P
(``register_push``) and P, once its prefill finished (``push_ready``), WRITEs into them over
the same link model; whichever comes second starts the write. They are matched as vLLM's P
matches them, by the request id without its random suffix (so P and D must get the same
``X-Request-Id``). A registration to a P that is down or unknown (a new engine id after a
restart) fails at once, as D's registration notification does; one whose P never finishes
waits for D's registration timeout. P records the writes (``transfer_done`` on P's observer).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

from pdscope.simconfig import SimulatorConfig
from simulator.faults import FaultSet
from simulator.model import PUSH_REGISTRATION, RemoteKV, SimRequest, Transfer

_V = TypeVar("_V")
_PUSH_PENDING_MAX = 65536  # registrations (or finished Ps) waiting for their other half, per fabric

if TYPE_CHECKING:
    from simulator.engine import Engine


class Fabric:
    def __init__(
        self, cfg: SimulatorConfig, faults: FaultSet, kv_bytes_per_token: int, seed: int = 0
    ) -> None:
        self.cfg = cfg
        self.faults = faults
        self.kv_bytes_per_token = kv_bytes_per_token
        self._rng = random.Random(seed)
        self._by_engine_id: dict[str, Engine] = {}
        self._link_free_at: dict[tuple[str, str], float] = {}
        # push mode, keyed by (P's engine id, external request id): D's registration waiting for P
        # to finish, and P's finished request (its internal id) waiting for D's registration
        self._push_regs: OrderedDict[tuple[str, str], tuple[Engine, SimRequest, int]] = OrderedDict()
        self._push_done: OrderedDict[tuple[str, str], str] = OrderedDict()

    def register(self, engine: Engine) -> None:
        self._by_engine_id[engine.engine_id] = engine

    def unregister(self, engine: Engine) -> None:
        if self._by_engine_id.get(engine.engine_id) is engine:
            del self._by_engine_id[engine.engine_id]

    def _peer(self, remote: RemoteKV) -> Engine | None:
        peer = self._by_engine_id.get(remote.engine_id)
        if peer is None or self.faults.is_down(peer.name):
            return None
        return peer

    def start_pull(self, d_name: str, remote: RemoteKV, num_blocks: int, now: float) -> Transfer:
        cfg = self.cfg
        scale = cfg.latency_scale
        post_s = cfg.post_time_s * scale
        peer = self._peer(remote)
        if peer is None:
            return Transfer(False, now + post_s, 0.0, post_s, 0, 0, "handshake_failed")
        if self.faults.stale_peer(peer.name, d_name):  # D reads through an agent P no longer has
            return Transfer(False, now + post_s, 0.0, post_s, 0, 0, "transfer_failed")
        return self._over_link(peer.name, d_name, num_blocks, now)

    def _over_link(self, p_name: str, d_name: str, num_blocks: int, now: float) -> Transfer:
        """One READ (pull) or WRITE (push) of ``num_blocks`` on the P x D link, posted at ``now``."""
        cfg = self.cfg
        scale = cfg.latency_scale
        post_s = cfg.post_time_s * scale
        nbytes = num_blocks * cfg.block_size * self.kv_bytes_per_token
        descriptors = num_blocks * cfg.descriptors_per_block
        factor = self.faults.link_factor(p_name, d_name)
        wire_s = (
            (nbytes / cfg.link_bandwidth_bytes_per_s + descriptors * cfg.per_descriptor_s) * factor * scale
        )
        link = (p_name, d_name)
        start = max(now + post_s, self._link_free_at.get(link, 0.0))
        done_at = start + wire_s
        self._link_free_at[link] = done_at
        rate = self.faults.failure_rate(p_name, d_name)
        ok = not (rate > 0 and self._rng.random() < rate)
        return Transfer(
            ok, done_at, done_at - now - post_s, post_s, nbytes, descriptors, "" if ok else "transfer_failed"
        )

    def finish_pull(self, remote: RemoteKV, now: float) -> None:
        peer = self._peer(remote)
        if peer is not None:
            peer.lease_release(remote.request_id, now)

    def heartbeat(self, remotes: Iterable[RemoteKV], now: float) -> None:
        for remote in remotes:
            peer = self._peer(remote)
            if peer is not None:
                peer.lease_heartbeat(remote.request_id, now)

    # -- push mode ---------------------------------------------------------------------

    def register_push(self, d: Engine, req: SimRequest, num_blocks: int, now: float) -> Transfer | None:
        """D registered ``num_blocks`` blocks for ``req`` with its P: the write when P has finished
        (or a failed registration), else None (the write starts when P finishes)."""
        assert req.remote is not None
        peer = self._peer(req.remote)
        if peer is None or self.faults.stale_peer(peer.name, d.name):
            post_s = self.cfg.post_time_s * self.cfg.latency_scale
            return Transfer(False, now + post_s, 0.0, post_s, 0, 0, PUSH_REGISTRATION + "_failed")
        key = (peer.engine_id, req.request_id)
        p_internal = self._push_done.pop(key, None)
        if p_internal is None:
            _bounded_put(self._push_regs, key, (d, req, num_blocks))
            return None
        return self._write(peer, d, req, p_internal, num_blocks, now)

    def push_ready(self, p: Engine, req: SimRequest, now: float) -> None:
        """P finished ``req``'s prefill and holds its blocks: write them to a registered D, or wait."""
        key = (p.engine_id, req.request_id)
        reg = self._push_regs.pop(key, None)
        if reg is None:
            _bounded_put(self._push_done, key, req.internal_id)
            return
        d, d_req, num_blocks = reg
        if not d_req.finished:
            d.push_started(d_req, self._write(p, d, d_req, req.internal_id, num_blocks, now))

    def push_written(self, remote: RemoteKV, t: Transfer, now: float) -> None:
        """P's write into D's blocks ended (``t.ok`` or not): P records it and frees its blocks."""
        peer = self._by_engine_id.get(remote.engine_id)
        if peer is None:
            return  # P is gone (down, or restarted since): nothing left to record on
        if t.ok:
            peer.observer.transfer_done(t)
        else:
            peer.observer.transfer_failed()
        peer.lease_release(remote.request_id, now)

    def push_forget(self, p: Engine, internal_id: str) -> None:
        """P's lease on ``internal_id`` ended before any D registered for it."""
        self._push_done.pop((p.engine_id, internal_id.rsplit("-", 1)[0]), None)

    def _write(
        self, peer: Engine, d: Engine, d_req: SimRequest, p_internal: str, num_blocks: int, now: float
    ) -> Transfer:
        assert d_req.remote is not None
        d_req.remote = replace(d_req.remote, request_id=p_internal)  # P's blocks, released when written
        return self._over_link(peer.name, d.name, num_blocks, now)


def _bounded_put(table: OrderedDict[tuple[str, str], _V], key: tuple[str, str], value: _V) -> None:
    table[key] = value
    while len(table) > _PUSH_PENDING_MAX:
        table.popitem(last=False)
