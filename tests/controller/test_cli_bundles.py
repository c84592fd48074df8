"""``pdscope control`` with bundles on, as a process: an alert that fires writes its bundle, the webhook
says where it is, and the API serves it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import BytesIO
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.sockets import free_port
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def hook() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    got: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            n = int(self.headers.get("Content-Length", "0"))
            got.append(json.loads(self.rfile.read(n)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/alerts", got
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_a_firing_alert_s_bundle_is_written_announced_and_served(
    tmp_path: Path, hook: tuple[str, list[dict[str, Any]]]
) -> None:
    url, posted = hook
    port = free_port()
    folder = tmp_path / "bundles"
    cfg = tmp_path / "pdscope.yaml"
    # nothing is scraped, so CollectorBehind fires at the first tick: the one rule that writes here
    cfg.write_text(f"""
model: {{name: m, kv_bytes_per_token: 1}}
pools:
  prefill: {{role: prefill, instances: [{{name: p0, url: "http://127.0.0.1:9"}}]}}
  decode: {{role: decode, instances: [{{name: d0, url: "http://127.0.0.1:9"}}]}}
store: {{url: "sqlite:///{tmp_path / "s.db"}"}}
alerts: {{rules: {{CollectorBehind: {{for_s: 0}}}}}}
controller:
  port: {port}
  interval_s: 0.2
  alert_webhook_url: "{url}"
  bundles: {{enabled: true, dir: "{folder}", rules: [CollectorBehind], window_s: 60}}
""")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdscope.cli", "--config", str(cfg), "control"],
        cwd=REPO,
        env={**os.environ, "PDSCOPE_API_TOKEN": "tok"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        firing = wait_until(
            "the webhook's firing CollectorBehind",
            lambda: [a for p in posted for a in p["alerts"] if a["labels"]["alertname"] == "CollectorBehind"],
            timeout_s=30,
            every_s=0.1,
        )
        ann = firing[0]["annotations"]
        name = ann["bundle_name"]
        assert name.startswith("pdscope-CollectorBehind-fleet-") and ann["bundle"] == str(folder / name)
        assert ann["bundle_url"] == f"{base}/v1/bundles/{name}"
        wait_until("the bundle file", (folder / name).is_file, timeout_s=30, every_s=0.1)
        listing = httpx.get(f"{base}/v1/bundles", timeout=5).json()
        assert [b["name"] for b in listing["bundles"]] == [name] and listing["enabled"] is True
        body = httpx.get(ann["bundle_url"], timeout=5).content
        assert body == (folder / name).read_bytes()
        with tarfile.open(fileobj=BytesIO(body), mode="r:gz") as tar:
            inside = {m.name.split("/", 1)[1] for m in tar.getmembers()}
        assert {"manifest.json", "report.html", "alerts.jsonl", "settings.json"} <= inside
        # ... and why the SLO was missed around it, from the controller's attribution, a fixed range
        why = ann["attribution_url"]
        assert why.startswith(f"{base}/v1/slo/attribution?from=") and "&until=" in why
        answer = httpx.get(why, timeout=10)
        assert answer.status_code == 200 and "top" in answer.json(), answer.text[:300]
        health = httpx.get(f"{base}/healthz", timeout=5).json()
        assert health["bundles"]["written"] >= 1 and health["bundles"]["failed"] == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    text = out.decode(errors="replace")
    assert proc.returncode in (0, -signal.SIGTERM), text[-2000:]
    assert "Traceback" not in text, text[-2000:]
