"""A simulated fleet for other components' tests: ``running_fleet``.

Usage::

    from simulator.testing import running_fleet

    with running_fleet(n_prefill=1, n_decode=2, seed=0, latency_scale=0.0) as fleet:
        fleet.prefill_urls          # ["http://127.0.0.1:41234"]
        fleet.decode_urls           # ["http://127.0.0.1:41235", "http://127.0.0.1:41236"]
        fleet.instances             # [("prefill", "prefill-0", url), ("decode", "decode-0", url), ...]
        fleet.admin_url             # the admin API (see simulator/admin.py)
        fid = fleet.inject({"kind": "slow_link", "prefill": "prefill-0", "decode": "decode-1", "factor": 50})
        fleet.remove_fault(fid); fleet.clear_faults()
        fleet.stats()               # event-loop lag of the simulator: {"trustworthy": True, ...}
        text = fleet.config_yaml(proxy={"port": 0})   # a valid pdscope.yaml for this fleet
        fleet.cached_tokens(token_ids)   # {name: prompt tokens each instance's prefix cache holds now}

    with running_fleet(kv_events=True) as fleet:     # every instance publishes its KV cache events
        fleet.kv_events   # {name: (endpoint, replay_endpoint, topic)} on free ports; in config_yaml too

Contract: the fleet runs in a background thread with its own event loop, on free ports
of 127.0.0.1, with instance names ``prefill-<i>`` / ``decode-<i>`` in pools ``prefill`` /
``decode``. ``**params`` are keys of the ``simulator:`` config section (see
simulator/config.py), e.g. ``latency_scale=0`` (zero latency), ``lease_duration_s=1``,
``kv_capacity_blocks=64``. ``inject`` takes a fault spec (dict or FaultSpec; see
simulator/faults.py), returns its id, and raises ValueError/ConfigError if it is invalid.
Leaving the block stops every instance; starting or stopping takes at most ``timeout_s``
(TimeoutError otherwise). Nothing here blocks for longer than ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import yaml

from pdscope.simconfig import LLAMA3_70B_KV_BYTES_PER_TOKEN
from simulator.config import parse_simulator_config
from simulator.faults import FaultSpec, parse_fault
from simulator.fleet import Fleet, InstanceSpec
from simulator.runtime import loop_factory

T = TypeVar("T")
DEFAULT_MODEL = "sim-llama-70b"


class RunningFleet:
    """Handle on a fleet running in a background thread (see module docstring)."""

    def __init__(
        self,
        fleet: Fleet,
        loop: asyncio.AbstractEventLoop,
        params: dict[str, Any],
        kv_bytes_per_token: int,
        timeout_s: float,
    ) -> None:
        self.fleet = fleet
        self.loop = loop
        self.params = params
        self.kv_bytes_per_token = kv_bytes_per_token
        self.timeout_s = timeout_s
        self.instances: list[tuple[str, str, str]] = fleet.describe()
        self.prefill_urls = [url for role, _, url in self.instances if role == "prefill"]
        self.decode_urls = [url for role, _, url in self.instances if role == "decode"]
        self.admin_url = fleet.admin_url
        self.model_name = fleet.model_name
        self.kv_events = fleet.kv_events()

    def url_of(self, name: str) -> str:
        return self.fleet.url_of(name)

    def call(self, fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run ``fn()`` on the fleet's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(self.timeout_s)

    def inject(self, fault_spec: dict[str, Any] | FaultSpec) -> int:
        spec = fault_spec if isinstance(fault_spec, FaultSpec) else parse_fault(fault_spec)

        async def go() -> int:
            return self.fleet.inject(spec)

        return self.call(go)

    def remove_fault(self, fid: int) -> bool:
        async def go() -> bool:
            return self.fleet.remove_fault(fid)

        return self.call(go)

    def clear_faults(self) -> int:
        async def go() -> int:
            return self.fleet.clear_faults()

        return self.call(go)

    def cached_tokens(self, token_ids: list[int], lora: str | None = None) -> dict[str, int]:
        async def go() -> dict[str, int]:
            return self.fleet.cached_tokens(token_ids, lora)

        return self.call(go)

    def stats(self) -> dict[str, Any]:
        async def go() -> dict[str, Any]:
            return self.fleet.lag.stats()

        return self.call(go)

    def config_dict(self, **overrides: Any) -> dict[str, Any]:
        mode = self.params.get("transfer_mode", "pull")  # the pools hand off as the instances do
        pools: dict[str, Any] = {
            "prefill": {"role": "prefill", "handoff": mode, "instances": []},
            "decode": {"role": "decode", "handoff": mode, "instances": []},
        }
        for role, name, url in self.instances:
            entry: dict[str, Any] = {"name": name, "url": url}
            if name in self.kv_events:
                endpoint, replay, _topic = self.kv_events[name]
                entry["kv_events_endpoint"] = endpoint
                if replay is not None:
                    entry["kv_events_replay_endpoint"] = replay
            pools[role]["instances"].append(entry)
        data: dict[str, Any] = {
            "model": {"name": self.model_name, "kv_bytes_per_token": self.kv_bytes_per_token},
            "pools": pools,
            "simulator": dict(self.params),
        }
        return _merge(data, overrides)

    def config_yaml(self, **overrides: Any) -> str:
        """A valid pdscope.yaml for this fleet; ``overrides`` are merged into the top level."""
        return yaml.safe_dump(self.config_dict(**overrides), sort_keys=False)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _FleetThread:
    """The fleet's background thread and its event loop: started, waited for, stopped."""

    def __init__(
        self, fleet: Fleet, loop: asyncio.AbstractEventLoop, scenario: list[FaultSpec] | None
    ) -> None:
        self.fleet = fleet
        self.loop = loop
        self.scenario = scenario
        self.ready = threading.Event()
        self.failure: list[BaseException] = []
        self.stop_future: list[asyncio.Future[None]] = []
        self.thread = threading.Thread(target=self._thread_main, name="sim-fleet", daemon=True)

    async def _main(self) -> None:
        self.stop_future.append(self.loop.create_future())
        try:
            await self.fleet.start(self.scenario)
        except BaseException as exc:
            self.failure.append(exc)
            self.ready.set()
            await self.fleet.stop()
            return
        self.ready.set()
        try:
            await self.stop_future[0]
        finally:
            await self.fleet.stop()

    def _thread_main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main())
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def start(self, timeout_s: float) -> None:
        """Start the fleet; raises TimeoutError, or what the fleet's start raised."""
        self.thread.start()
        if not self.ready.wait(timeout_s):
            raise TimeoutError("the simulated fleet did not start in time")
        if self.failure:
            self.thread.join(timeout_s)
            raise self.failure[0]

    def stop(self, timeout_s: float) -> None:
        self.loop.call_soon_threadsafe(_resolve, self.stop_future[0])
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise TimeoutError("the simulated fleet did not stop in time")


@contextlib.contextmanager
def running_fleet(
    n_prefill: int = 1,
    n_decode: int = 1,
    seed: int = 0,
    *,
    model_name: str = DEFAULT_MODEL,
    kv_bytes_per_token: int = LLAMA3_70B_KV_BYTES_PER_TOKEN,
    scenario: list[FaultSpec] | None = None,
    timeout_s: float = 15.0,
    kv_events: bool = False,
    **params: Any,
) -> Iterator[RunningFleet]:
    """Start ``n_prefill`` + ``n_decode`` simulated vLLM instances; yield a RunningFleet."""
    params = {"seed": seed, **params}
    cfg = parse_simulator_config(params)
    ep = "tcp://127.0.0.1:*" if kv_events else None  # ZMQ picks a free port
    names = [("prefill", f"prefill-{i}") for i in range(n_prefill)]
    names += [("decode", f"decode-{i}") for i in range(n_decode)]
    specs = [
        InstanceSpec(role, name, kv_events_endpoint=ep, kv_events_replay_endpoint=ep) for role, name in names
    ]
    loop = loop_factory()()
    fleet = Fleet(specs, model_name=model_name, kv_bytes_per_token=kv_bytes_per_token, cfg=cfg)
    runner = _FleetThread(fleet, loop, scenario)
    runner.start(timeout_s)
    try:
        yield RunningFleet(fleet, loop, params, kv_bytes_per_token, timeout_s)
    finally:
        runner.stop(timeout_s)
