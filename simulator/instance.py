"""One simulated vLLM instance: engine + runner + metrics registry (+ span emitter, + KV events).

``SimInstance`` is what the HTTP app serves. ``restart()`` models a process restart
after the instance was down: a new engine id, empty KV cache and fresh counters, as a
restarted vLLM has. With a ``kv_events_endpoint`` the instance publishes its engine's KV
cache events (simulator/kvpublish.py); the publisher outlives restarts (its sequence goes
on), and a stop publishes ``AllBlocksCleared`` (the cache is gone) so subscribers forget it
at once. It knows nothing about HTTP sockets (fleet.py) or HTTP (server.py).
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

from pdscope.simconfig import SimulatorConfig
from simulator.engine import Engine
from simulator.fabric import Fabric
from simulator.faults import FaultSet
from simulator.kvpublish import KvEventPublisher
from simulator.metrics import VllmMetrics
from simulator.runner import EngineRunner
from simulator.tracing import SpanEmitter


class SimInstance:
    def __init__(
        self,
        *,
        name: str,
        role: str,
        index: int,
        model_name: str,
        cfg: SimulatorConfig,
        kv_bytes_per_token: int,
        fabric: Fabric,
        faults: FaultSet,
        seed: int,
        otlp_endpoint: str | None = None,
        kv_events_endpoint: str | None = None,
        kv_events_replay_endpoint: str | None = None,
        kv_events_topic: str = "",
    ) -> None:
        self.name = name
        self.role = role
        self.index = index
        self.model_name = model_name
        self.cfg = cfg
        self.kv_bytes_per_token = kv_bytes_per_token
        self.fabric = fabric
        self.faults = faults
        self.rng = random.Random(f"{seed}:{name}")
        self.side_channel_port = cfg.side_channel_port + index
        self.emitter: SpanEmitter | None = None
        if cfg.tracing:
            self.emitter = SpanEmitter(name, otlp_endpoint)
        self.generation = 0
        self.kv_events: KvEventPublisher | None = None
        if kv_events_endpoint is not None:
            self.kv_events = KvEventPublisher(kv_events_endpoint, kv_events_replay_endpoint, kv_events_topic)
        self._build()

    def _build(self) -> None:
        self.created = int(time.time())
        self.engine_id = str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
        self.metrics = VllmMetrics(self.model_name, self.cfg, self.kv_bytes_per_token)
        self.engine = Engine(
            self.name,
            self.role,
            self.cfg,
            engine_id=self.engine_id,
            kv_bytes_per_token=self.kv_bytes_per_token,
            fabric=self.fabric,
            faults=self.faults,
            observer=self.metrics,
        )
        if self.kv_events is not None:
            self.engine.on_events = self.kv_events.publish
        self.runner = EngineRunner(self.engine)
        # maps the runner's monotonic clock to epoch seconds, for spans and "created"
        self.wall_offset = time.time() - time.monotonic()
        if self.role == "prefill":
            self.fabric.register(self.engine)

    def start(self) -> None:
        self.runner.start()

    async def stop(self) -> None:
        await self.runner.stop()
        self.engine.crash(self.runner.clock())
        self.engine.flush_events()
        self.fabric.unregister(self.engine)

    async def restart(self) -> None:
        """Come back after being down: a fresh engine, KV cache and registry."""
        await self.stop()
        self.generation += 1
        self._build()
        self.start()

    def close(self) -> None:
        """Release what outlives restarts (the KV events sockets); after the last stop."""
        if self.kv_events is not None:
            self.kv_events.close()

    def shutdown_tracing(self) -> None:
        if self.emitter is not None:
            self.emitter.shutdown()

    def next_hex(self) -> str:
        return f"{self.rng.getrandbits(32):08x}"

    @property
    def system_fingerprint(self) -> str:
        return f"vllm-{self.cfg.vllm_version}-{self.engine_id[:8]}"

    def kv_transfer_params(self, internal_id: str, blocks: list[int], num_tokens: int) -> dict[str, Any]:
        """What real P (NixlPullConnector, pull mode) returns to the proxy: vLLM 0.32.0's keys as
        captured in tests/fixtures/vllm-0.32.0-cpu, or 0.33.0's as read from its source. Push mode
        (NixlPushConnector): the push scheduler's keys, the same in both versions."""
        if self.cfg.transfer_mode == "push":
            return self._push_params(internal_id, blocks, num_tokens)
        if self.cfg.vllm_version == "0.32.0":
            return {
                "dcp_size": 1,
                "do_remote_decode": False,
                "do_remote_prefill": True,
                "pp_size": 1,
                "remote_block_ids": [list(blocks)],
                "remote_blocks_expiry_time": None,
                "remote_engine_id": self.engine_id,
                "remote_host": self.cfg.side_channel_host,
                "remote_num_tokens": num_tokens,
                "remote_port": self.side_channel_port,
                "remote_prefill_cached_tokens": 0,
                "remote_request_id": internal_id,
                "tp_size": self.cfg.tp_size,
                "transfer_mode": "pull",
            }
        return self._params_033(internal_id, blocks, num_tokens)

    def _params_033(self, internal_id: str, blocks: list[int], num_tokens: int) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(blocks)],
            "remote_engine_id": self.engine_id,
            "remote_request_id": internal_id,
            "remote_host": self.cfg.side_channel_host,
            "remote_port": self.side_channel_port,
            "tp_size": self.cfg.tp_size,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": num_tokens,
            "remote_blocks_expiry_time": None,
            "remote_registration_generation": 0,
            "transfer_mode": "pull",
        }

    def _push_params(self, internal_id: str, blocks: list[int], num_tokens: int) -> dict[str, Any]:
        """P's answer in push mode (NixlPushConnector's push scheduler): 0.33's pull keys without the
        lease fields, in transfer_mode push."""
        params = self._params_033(internal_id, blocks, num_tokens)
        del params["remote_blocks_expiry_time"], params["remote_registration_generation"]
        params["transfer_mode"] = "push"
        return params
