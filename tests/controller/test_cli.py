"""``pdscope control`` as a process: starts, migrates, serves, reconciles, stops on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support.sockets import free_port
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_pdscope_control_serves_and_reconciles(tmp_path: Path) -> None:
    port = free_port()
    cfg = tmp_path / "pdscope.yaml"
    cfg.write_text(f"""
model: {{name: m, kv_bytes_per_token: 1}}
pools:
  prefill: {{role: prefill, instances: [{{name: p0, url: "http://127.0.0.1:9"}}]}}
  decode: {{role: decode, instances: [{{name: d0, url: "http://127.0.0.1:9"}}]}}
store: {{url: "sqlite:///{tmp_path / "s.db"}"}}
controller: {{port: {port}, interval_s: 0.2, mode: advisory}}
""")
    env = {**os.environ, "PDSCOPE_API_TOKEN": "tok"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdscope.cli", "--config", str(cfg), "control"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        health = wait_until(
            "two reconcile ticks",
            lambda: httpx.get(f"{base}/healthz", timeout=1).json(),
            done=lambda h: h["ticks"] >= 2,
            timeout_s=30,
            every_s=0.2,
            ignore=(httpx.HTTPError,),
        )
        assert health["mode"] == "advisory", health
        table = httpx.get(f"{base}/v1/routing", timeout=2).json()
        assert table["enforce"] is False and {i["name"] for i in table["instances"]} == {"p0", "d0"}
        r = httpx.post(
            f"{base}/v1/instances/d0/drain",
            json={"reason": "test"},
            headers={"Authorization": "Bearer tok"},
            timeout=5,
        )
        assert r.status_code == 200 and r.json()["drained"] is True
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    text = out.decode(errors="replace")
    # uvicorn shuts down gracefully, then re-raises the captured SIGTERM: -15 is a clean stop too
    assert proc.returncode in (0, -signal.SIGTERM), text[-2000:]
    assert "Traceback" not in text, text[-2000:]
    assert "tick 2:" in text
