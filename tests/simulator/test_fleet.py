"""Fleet plumbing: the event-loop lag monitor, unknown overrides, unique names."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdscope.config import ConfigError
from simulator.config import SimulatorConfig
from simulator.fleet import Fleet, InstanceSpec, LoopLagMonitor


def test_lag_monitor_marks_a_blocked_loop_untrustworthy() -> None:
    async def go() -> tuple[dict[str, object], dict[str, object]]:
        mon = LoopLagMonitor(threshold_s=0.05, interval_s=0.01)
        mon.start()
        await asyncio.sleep(0.1)
        calm = mon.stats()
        time.sleep(0.2)  # noqa: ASYNC251 - on purpose: something hogs the loop
        await asyncio.sleep(0.05)
        hogged = mon.stats()
        await mon.stop()
        return calm, hogged

    calm, hogged = asyncio.run(go())
    assert calm["samples"] and hogged["loop_lag_max_s"] >= 0.15  # type: ignore[operator]
    assert hogged["trustworthy"] is False


def test_fleet_rejects_unknown_override_names_and_duplicate_instances() -> None:
    cfg = SimulatorConfig(instances={"decode-9": {"kv_capacity_blocks": 10}})
    with pytest.raises(ConfigError, match="decode-9"):
        Fleet([InstanceSpec("prefill", "prefill-0"), InstanceSpec("decode", "decode-0")], model_name="m",
              kv_bytes_per_token=1, cfg=cfg)
    with pytest.raises(ValueError, match="unique"):
        Fleet([InstanceSpec("prefill", "x"), InstanceSpec("decode", "x")], model_name="m", kv_bytes_per_token=1,
              cfg=SimulatorConfig())
