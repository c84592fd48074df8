"""`pdscope demo` end to end: URLs printed, requests flowing, a weight change after the
injected fault, and nothing left running after Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.processes import processes_mentioning
from tests.support.sockets import free_ports
from tests.support.waiting import WaitTimeout, wait_until

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # up to 240 s to see the reaction, then the stop


def _weight_fell(line: str, instance: str) -> bool:
    """A printed weight change of ``instance`` that lowers its weight."""
    m = re.search(rf"weight {re.escape(instance)}: (\d+\.\d+) -> (\d+\.\d+)", line)
    return bool(m) and float(m.group(2)) < float(m.group(1))


def _reaction(lines: list[str]) -> tuple[int | None, str | None]:
    """Where the fault was printed, and the first printed fall of decode-0's weight after it."""
    snapshot = list(lines)  # appended to by the reader thread
    fault_at = next((i for i, ln in enumerate(snapshot) if "FAULT:" in ln), None)
    if fault_at is None:
        return None, None
    return fault_at, next((ln for ln in snapshot[fault_at:] if _weight_fell(ln, "decode-0")), None)


def test_demo_runs_reacts_to_the_fault_and_cleans_up(tmp_path: Path) -> None:
    base = yaml.safe_load((REPO / "examples" / "pdscope.yaml").read_text())
    ports = free_ports(11)
    for i, (pool, inst) in enumerate(
        (p, i) for p in ("prefill", "decode") for i in base["pools"][p]["instances"]
    ):
        inst["url"] = f"http://127.0.0.1:{ports[i]}"
        del pool
    base["proxy"] = {"port": ports[5]}
    base["controller"] = dict(base.get("controller", {}), port=ports[6], interval_s=1)
    base["collector"] = dict(
        base.get("collector", {}),
        port=ports[7],
        scrape_interval_s=1,
        scrape_timeout_s=0.8,
        spool_dir=str(tmp_path / "collector-spool"),
    )
    base["dashboard"] = {"port": ports[8]}
    base["simulator"] = {"admin_port": ports[9]}
    cfg = tmp_path / "demo-config.yaml"
    cfg.write_text(yaml.safe_dump(base))
    workdir = tmp_path / "work"

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdscope.cli",
            "--log-level",
            "WARNING",
            "--config",
            str(cfg),
            "demo",
            "--workdir",
            str(workdir),
            "--fault-after",
            "15",
            "--duration",
            "300",
            "--no-dashboard",
            "--rate",
            "4",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        try:
            wait_until(
                "decode-0's weight to fall after the fault",
                lambda: _reaction(lines),
                done=lambda seen: seen[1] is not None or proc.poll() is not None,
                timeout_s=240,
                every_s=1,
            )
        except WaitTimeout:
            pass  # the asserts below say what was missing, with the demo's output
        fault_seen_at, changed_after_fault = _reaction(lines)
        out = "\n".join(lines)
        assert f"http://127.0.0.1:{ports[5]}" in out, out  # the proxy URL is printed
        assert fault_seen_at is not None, f"no fault injected:\n{out}"
        assert changed_after_fault, f"no weight change after the fault:\n{out}"
        # requests flowed through the proxy: its own counter says so
        with urllib.request.urlopen(f"http://127.0.0.1:{ports[5]}/metrics", timeout=5) as resp:
            metrics = resp.read().decode()
        ok = sum(
            float(m.group(1))
            for m in re.finditer(
                r'^pdscope_proxy_requests_total\{[^}]*outcome="ok"[^}]*\} (\S+)$', metrics, re.M
            )
        )
        assert ok >= 5, metrics[:2000]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        reader.join(timeout=5)
    assert "stopped." in "\n".join(lines)
    # the demo has stopped; its children may still be being reaped (a timeout: processes left behind)
    wait_until(
        "no process of the demo left behind after it stopped",
        lambda: processes_mentioning(str(cfg)) + processes_mentioning(str(workdir)),
        done=lambda procs: procs == [],
    )
