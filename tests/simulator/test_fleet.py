"""Fleet plumbing: the event-loop lag monitor, unknown overrides, unique names."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdscope.config import ConfigError
from pdscope.simconfig import SimulatorConfig
from simulator.fleet import Fleet, InstanceSpec, LoopLagMonitor
from tests.support.waiting import async_wait_until


def test_lag_monitor_marks_a_blocked_loop_untrustworthy() -> None:
    async def go() -> tuple[dict[str, object], dict[str, object]]:
        mon = LoopLagMonitor(threshold_s=0.05, interval_s=0.01)
        mon.start()
        calm = await async_wait_until("a few samples", mon.stats, done=lambda st: st["samples"] >= 3)
        seen = len(mon.samples)
        time.sleep(0.2)  # noqa: ASYNC251 - on purpose, the thing under test: something hogs the loop
        # the next sample is the sleeper the hog held up
        hogged = await async_wait_until(
            "a sample after the hog", mon.stats, done=lambda st: st["samples"] > seen
        )
        await mon.stop()
        return calm, hogged

    calm, hogged = asyncio.run(go())
    assert calm["samples"] and hogged["loop_lag_max_s"] >= 0.15  # type: ignore[operator]
    assert hogged["trustworthy"] is False


def test_fleet_rejects_unknown_override_names_and_duplicate_instances() -> None:
    cfg = SimulatorConfig(instances={"decode-9": {"kv_capacity_blocks": 10}})
    with pytest.raises(ConfigError, match="decode-9"):
        Fleet(
            [InstanceSpec("prefill", "prefill-0"), InstanceSpec("decode", "decode-0")],
            model_name="m",
            kv_bytes_per_token=1,
            cfg=cfg,
        )
    with pytest.raises(ValueError, match="unique"):
        Fleet(
            [InstanceSpec("prefill", "x"), InstanceSpec("decode", "x")],
            model_name="m",
            kv_bytes_per_token=1,
            cfg=SimulatorConfig(),
        )


def test_per_instance_knobs_make_an_instance_report_another_identity() -> None:
    """block_size, cache_dtype and served_model_name per instance, as vLLM reports them: in
    vllm:cache_config_info's labels, the metrics' model_name label and /v1/models."""
    import httpx

    from collector.fastparse import extract_signals
    from simulator.testing import running_fleet

    odd = {"block_size": 32, "cache_dtype": "fp8", "served_model_name": "other-model"}
    with running_fleet(n_prefill=1, n_decode=1, instances={"decode-0": odd}) as fleet:
        pages = {
            n: httpx.get(fleet.url_of(n) + "/metrics", timeout=10).text for n in ("prefill-0", "decode-0")
        }
        models = httpx.get(fleet.url_of("decode-0") + "/v1/models", timeout=10).json()
    assert dict(extract_signals(pages["decode-0"]).identity) == {
        "block_size": "32",
        "cache_dtype": "fp8",
        "model": "other-model",
    }
    mine = dict(extract_signals(pages["prefill-0"]).identity)
    assert mine["block_size"] == "16" and mine["cache_dtype"] == "auto" and mine["model"] != "other-model"
    assert [m["id"] for m in models["data"]] == ["other-model"]
