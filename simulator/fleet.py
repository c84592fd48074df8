"""N prefill + M decode simulated instances in one process, on one asyncio loop.

Each instance listens on its own port on 127.0.0.1 (a uvicorn server with httptools on a
socket the fleet binds itself, so port 0 works and a downed instance can come back on
the same port). The fleet owns the fault set (applied live, delayed or from a scenario),
the fabric between P and D, an admin API (faults, instances, loop-lag stats) and an
event-loop lag monitor: results taken while the loop lagged past the threshold are
marked untrustworthy. It must run entirely inside one event loop; testing.py runs it in
a thread for tests, cli.py in the main thread.

In-process, on the caller's running loop (what a benchmark or a test that owns its loop does)::

    fleet = Fleet([InstanceSpec("prefill", "prefill-0"), InstanceSpec("decode", "decode-0")],
                  model_name="sim-llama-70b", kv_bytes_per_token=327680,
                  cfg=parse_simulator_config({"latency_scale": 0}))   # simulator/config.py
    await fleet.start()          # binds free ports (port 0); fleet.describe() -> (role, name, url)
    try:
        fleet.kv_events()        # {name: (endpoint, replay_endpoint, topic)} of the publishing ones
        fleet.cached_tokens(ids) # {name: tokens a request with these ids would hit now}
    finally:
        await fleet.stop()

An ``InstanceSpec`` with ``kv_events_endpoint`` (port ``*`` for a free one) publishes that
instance's KV cache events there (simulator/kvpublish.py), with an optional replay socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import uvicorn
import zmq

from pdscope.config import ConfigError
from pdscope.simconfig import SimulatorConfig
from pdscope.stats import percentile
from simulator.admin import AdminApp
from simulator.fabric import Fabric
from simulator.faults import FaultSet, FaultSpec
from simulator.instance import SimInstance
from simulator.server import InstanceApp

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class InstanceSpec:
    role: str  # "prefill" | "decode"
    name: str
    host: str = "127.0.0.1"
    port: int = 0
    kv_events_endpoint: str | None = None  # e.g. tcp://127.0.0.1:5557, or tcp://127.0.0.1:* (free port)
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""


def bind_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class _Listener:
    """One uvicorn server on one socket; can be stopped and started again on the same port."""

    def __init__(self, app: Any, host: str, port: int) -> None:
        self.app = app
        self.host = host
        self.sock = bind_socket(host, port)
        self.port: int = self.sock.getsockname()[1]
        self.server: uvicorn.Server | None = None

    async def start(self) -> None:
        if self.sock.fileno() < 0:
            self.sock = bind_socket(self.host, self.port)
        config = uvicorn.Config(
            self.app,
            http="httptools",
            ws="none",
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,
            backlog=4096,
            proxy_headers=False,
        )
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[self.sock])
        self.server = server

    async def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.force_exit = True
            await server.shutdown(sockets=[self.sock])
        self.sock.close()


class LoopLagMonitor:
    """Measures how late the event loop wakes a periodic sleeper."""

    def __init__(self, threshold_s: float, interval_s: float = 0.02) -> None:
        self.threshold_s = threshold_s
        self.interval_s = interval_s
        self.samples: deque[float] = deque(maxlen=10000)
        self.max_lag_s = 0.0
        self.since = time.time()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def reset(self) -> None:
        self.samples.clear()
        self.max_lag_s = 0.0
        self.since = time.time()

    async def _run(self) -> None:
        warned = False
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            lag = max(0.0, time.perf_counter() - t0 - self.interval_s)
            self.samples.append(lag)
            self.max_lag_s = max(self.max_lag_s, lag)
            if lag > self.threshold_s and not warned:
                logger.warning(
                    "event-loop lag %.3fs is over %.3fs: simulated timings are untrustworthy",
                    lag,
                    self.threshold_s,
                )
                warned = True

    def stats(self) -> dict[str, Any]:
        p99 = percentile(self.samples, 99)
        return {
            "loop_lag_max_s": self.max_lag_s,
            "loop_lag_p99_s": 0.0 if p99 is None else p99,
            "loop_lag_threshold_s": self.threshold_s,
            "samples": len(self.samples),
            "since": self.since,
            "trustworthy": self.max_lag_s <= self.threshold_s,
        }


class Fleet:
    def __init__(
        self,
        specs: list[InstanceSpec],
        *,
        model_name: str,
        kv_bytes_per_token: int,
        cfg: SimulatorConfig,
        otlp_endpoint: str | None = None,
        admin_host: str = "127.0.0.1",
    ) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError("instance names must be unique")
        unknown = sorted(set(cfg.instances) - set(names))
        if unknown:
            raise ConfigError([f"simulator.instances: no instance named {', '.join(unknown)} in this fleet"])
        self.cfg = cfg
        self.model_name = model_name
        self.faults = FaultSet(on_change=self._fault_changed)
        self.fabric = Fabric(cfg, self.faults, kv_bytes_per_token, seed=cfg.seed)
        self.specs = specs
        self.instances: dict[str, SimInstance] = {}
        self._build_instances(model_name, kv_bytes_per_token, otlp_endpoint)
        self.listeners = {
            s.name: _Listener(InstanceApp(self.instances[s.name]), s.host, s.port) for s in specs
        }
        self.admin = _Listener(AdminApp(self), admin_host, cfg.admin_port)
        self.lag = LoopLagMonitor(cfg.loop_lag_threshold_s)
        self._timers: list[asyncio.TimerHandle] = []
        self._pending: dict[int, FaultSpec] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._down: set[str] = set()
        self._down_locks: dict[str, asyncio.Lock] = {}
        self.started_at = 0.0

    def _build_instances(self, model_name: str, kv_bytes_per_token: int, otlp_endpoint: str | None) -> None:
        """One SimInstance per spec, indexed per role; a KV events socket that cannot be bound closes
        those made so far and is a ConfigError."""
        cfg = self.cfg
        counters = {"prefill": 0, "decode": 0}
        for spec in self.specs:
            index = counters[spec.role]
            counters[spec.role] += 1
            own = cfg.for_instance(spec.name)
            try:
                self.instances[spec.name] = SimInstance(
                    name=spec.name,
                    role=spec.role,
                    index=index,
                    model_name=own.served_model_name or model_name,
                    cfg=own,
                    kv_bytes_per_token=kv_bytes_per_token,
                    fabric=self.fabric,
                    faults=self.faults,
                    seed=cfg.seed,
                    otlp_endpoint=cfg.otlp_endpoint or otlp_endpoint,
                    kv_events_endpoint=spec.kv_events_endpoint,
                    kv_events_replay_endpoint=spec.kv_events_replay_endpoint,
                    kv_events_topic=spec.kv_events_topic,
                )
            except zmq.ZMQError as exc:
                for inst in self.instances.values():
                    inst.close()
                raise ConfigError(
                    [f"{spec.name}: kv_events_endpoint / kv_events_replay_endpoint cannot be bound: {exc}"]
                ) from exc

    # -- addresses -----------------------------------------------------------------

    def url_of(self, name: str) -> str:
        lst = self.listeners[name]
        return f"http://{lst.host}:{lst.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.admin.host}:{self.admin.port}"

    def describe(self) -> list[tuple[str, str, str]]:
        return [(s.role, s.name, self.url_of(s.name)) for s in self.specs]

    def is_up(self, name: str) -> bool:
        return name not in self._down

    def kv_events(self) -> dict[str, tuple[str, str | None, str]]:
        """``{name: (endpoint, replay_endpoint, topic)}`` of every instance publishing KV events (the
        bound addresses: a ``*`` port is resolved)."""
        out: dict[str, tuple[str, str | None, str]] = {}
        for name, inst in self.instances.items():
            pub = inst.kv_events
            if pub is not None:
                out[name] = (pub.endpoint, pub.replay_endpoint, pub.topic)
        return out

    def cached_tokens(self, token_ids: Sequence[int], lora: str | None = None) -> dict[str, int]:
        """Per instance, the prompt tokens a new request with ``token_ids`` would find cached now (the
        engines' truth; a down instance holds nothing)."""
        return {
            name: 0 if name in self._down else inst.engine.cached_prefix_tokens(token_ids, lora)
            for name, inst in self.instances.items()
        }

    # -- lifecycle -----------------------------------------------------------------

    async def start(self, scenario: list[FaultSpec] | None = None) -> None:
        self.started_at = time.monotonic()
        for name, inst in self.instances.items():
            inst.start()
            await self.listeners[name].start()
        await self.admin.start()
        self.lag.start()
        for spec in scenario or []:
            self.inject(spec)

    async def stop(self) -> None:
        for timer in self._timers:
            timer.cancel()
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.lag.stop()

        async def stop_one(name: str) -> None:
            await self.instances[name].stop()
            await self.listeners[name].stop()

        await asyncio.gather(self.admin.stop(), *(stop_one(name) for name in self.instances))
        for inst in self.instances.values():
            inst.shutdown_tracing()
            inst.close()

    # -- faults --------------------------------------------------------------------

    def inject(self, spec: FaultSpec) -> int:
        """Apply ``spec`` after ``spec.at`` seconds, for ``spec.duration`` (None: until cleared)."""
        unknown = spec.instances() - set(self.instances)
        if unknown:
            raise ValueError(f"unknown instance(s): {', '.join(sorted(unknown))}")
        loop = asyncio.get_running_loop()
        fid = self.faults.reserve_id()
        if spec.at > 0:
            self._pending[fid] = spec
            self._timers.append(loop.call_later(spec.at, self._activate, fid, spec))
        else:
            self._activate(fid, spec)
        return fid

    def _activate(self, fid: int, spec: FaultSpec) -> None:
        self._pending.pop(fid, None)
        self.faults.add(spec, fid)
        logger.info("fault %d on: %s", fid, spec.model_dump(exclude_none=True))
        if spec.duration is not None:
            self._timers.append(asyncio.get_running_loop().call_later(spec.duration, self.remove_fault, fid))

    def remove_fault(self, fid: int) -> bool:
        if self._pending.pop(fid, None) is not None:
            return True
        return self.faults.remove(fid)

    def clear_faults(self) -> int:
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        n = len(self._pending)
        self._pending.clear()
        return n + self.faults.clear()

    def fault_list(self) -> list[dict[str, Any]]:
        active = [
            {"id": fid, "active": True, **s.model_dump(exclude_none=True)}
            for fid, s in self.faults.active().items()
        ]
        pending = [
            {"id": fid, "active": False, **s.model_dump(exclude_none=True)}
            for fid, s in self._pending.items()
        ]
        return active + pending

    def _fault_changed(self, fid: int, spec: FaultSpec, added: bool) -> None:
        if not added:
            logger.info("fault %d off: %s", fid, spec.kind)
        for inst in self.instances.values():
            inst.runner.wake()
        if spec.kind == "down" and spec.instance:
            task = asyncio.get_running_loop().create_task(self._apply_down(spec.instance))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _apply_down(self, name: str) -> None:
        """Make the instance's state match the fault set (one change at a time per instance)."""
        async with self._down_locks.setdefault(name, asyncio.Lock()):
            want_down = self.faults.is_down(name)
            if want_down and name not in self._down:
                self._down.add(name)
                logger.info("instance %s down", name)
                await self.instances[name].stop()
                await self.listeners[name].stop()
            elif not want_down and name in self._down:
                logger.info("instance %s back", name)
                await self.instances[name].restart()
                if self.cfg.startup_s:  # its new process started; it answers once loaded
                    await asyncio.sleep(self.cfg.startup_s)
                await self.listeners[name].start()
                self._down.discard(name)
