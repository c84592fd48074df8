"""Runs a fleet in the foreground for ``pdscope sim`` until Ctrl-C or SIGTERM.

Builds the fleet from instance tuples (role, name, host, port, kv_events_endpoint,
kv_events_replay_endpoint, kv_events_topic) and the ``simulator:`` mapping, prints each
instance's role, name and URL (and the admin URL), serves, and stops every instance
cleanly on SIGINT/SIGTERM. Uses uvloop where available.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from typing import Any

from pdscope.runmain import run_main, stop_on_signals
from pdscope.simconfig import LLAMA3_70B_KV_BYTES_PER_TOKEN
from simulator.config import parse_simulator_config
from simulator.faults import load_scenario
from simulator.fleet import Fleet, InstanceSpec

logger = logging.getLogger(__name__)


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:  # not on Windows; the stdlib loop works, only slower
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def serve_fleet(
    specs: list[tuple[str, str, str, int, str | None, str | None, str]],
    section: dict[str, Any],
    *,
    model_name: str,
    kv_bytes_per_token: int | None,
    otlp_endpoint: str | None,
) -> int:
    cfg = parse_simulator_config(section)
    scenario = load_scenario(cfg.scenario) if cfg.scenario else []
    kv_bytes = cfg.kv_bytes(kv_bytes_per_token or LLAMA3_70B_KV_BYTES_PER_TOKEN)

    async def main() -> None:
        fleet = Fleet(
            [InstanceSpec(*spec) for spec in specs],
            model_name=model_name,
            kv_bytes_per_token=kv_bytes,
            cfg=cfg,
            otlp_endpoint=otlp_endpoint,
        )
        stop = asyncio.Event()
        stop_on_signals(stop)
        try:
            await fleet.start(scenario)
            for role, name, url in fleet.describe():
                print(f"{role:8s} {name:16s} {url}", flush=True)
            print(f"{'admin':8s} {'':16s} {fleet.admin_url}", flush=True)
            if scenario:
                print(f"scenario: {len(scenario)} fault(s) from {cfg.scenario}", flush=True)
            await stop.wait()
        finally:
            await fleet.stop()
            print("simulator stopped", file=sys.stderr, flush=True)

    return run_main(main, "pdscope sim", loop_factory())
