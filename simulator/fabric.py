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
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pdscope.simconfig import SimulatorConfig
from simulator.faults import FaultSet
from simulator.model import RemoteKV, Transfer

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
        nbytes = num_blocks * cfg.block_size * self.kv_bytes_per_token
        descriptors = num_blocks * cfg.descriptors_per_block
        factor = self.faults.link_factor(peer.name, d_name)
        wire_s = (
            (nbytes / cfg.link_bandwidth_bytes_per_s + descriptors * cfg.per_descriptor_s) * factor * scale
        )
        link = (peer.name, d_name)
        start = max(now + post_s, self._link_free_at.get(link, 0.0))
        done_at = start + wire_s
        self._link_free_at[link] = done_at
        rate = self.faults.failure_rate(peer.name, d_name)
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
