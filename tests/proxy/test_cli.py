"""``pdscope proxy``: flags over the config, and the real process (uvloop + httptools) end to end."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from proxy.cli import add_arguments, apply_overrides
from tests.proxy.conftest import fake_fleet, make_settings
from tests.support.sockets import closed_port_url, free_port
from tests.support.waiting import async_wait_until


def test_flags_override_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = make_settings(["http://p"], ["http://d"])
    args = parser.parse_args(["--policy", "round-robin", "--port", "9123", "--no-tracing"])
    out = apply_overrides(settings, args)
    assert (out.proxy.policy, out.proxy.port, out.proxy.tracing) == ("round-robin", 9123, False)
    assert out.proxy.timeouts == settings.proxy.timeouts
    assert apply_overrides(settings, parser.parse_args([])) is settings


@pytest.mark.slow
async def test_pdscope_proxy_process_serves_a_stream(tmp_path: Path) -> None:
    async with fake_fleet(1, 1) as fleet:
        port = free_port()
        settings = make_settings(
            [fleet.prefill[0].url],
            [fleet.decode[0].url],
            proxy={"port": port, "otlp_endpoint": closed_port_url()},
        )  # collector down: must not matter
        cfg = tmp_path / "pdscope.yaml"
        cfg.write_text(yaml.safe_dump(settings.model_dump(mode="json")))
        pdscope = str(Path(sys.executable).with_name("pdscope"))
        proc = await asyncio.create_subprocess_exec(
            pdscope,
            "--config",
            str(cfg),
            "proxy",
            "--policy",
            "round-robin",
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient(timeout=10) as client:

                async def healthy() -> bool:
                    if proc.returncode is not None:
                        raise AssertionError(f"pdscope proxy exited with {proc.returncode} before it served")
                    return (await client.get(url + "/healthz")).status_code == 200

                await async_wait_until(
                    "pdscope proxy to serve /healthz", healthy, ignore=(httpx.HTTPError,), timeout_s=15
                )
                resp = await client.post(
                    url + "/v1/chat/completions",
                    json={
                        "model": "fake",
                        "messages": [{"role": "user", "content": "hi there"}],
                        "stream": True,
                    },
                )
                assert resp.status_code == 200
                assert resp.text.rstrip().endswith("data: [DONE]")
                metrics = (await client.get(url + "/metrics")).text
            assert 'pdscope_proxy_requests_total{endpoint="/v1/chat/completions",outcome="ok"} 1.0' in metrics
        finally:
            proc.terminate()
            out, _ = await asyncio.wait_for(proc.communicate(), 15)
        # uvicorn shuts down gracefully, then re-raises SIGTERM: -15 is a clean stop
        assert proc.returncode in (0, -15), out.decode()[-2000:]
        assert b"Traceback" not in out, out.decode()[-2000:]
        assert len(fleet.decode[0].calls) == 1
