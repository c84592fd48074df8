"""``pdscope proxy --workers N``: N processes on one port (SO_REUSEPORT), each its own proxy id.

Runs the real command: both workers poll the controller under ``<proxy.id>/w<i>``, requests on
the shared port are answered, each worker serves alone on its admin port, a killed worker is
started again, and SIGTERM stops them all.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
import yaml

from tests.processes import processes_mentioning
from tests.proxy.conftest import fake_fleet
from tests.support.controllers import FakeController, table
from tests.support.serving import serve
from tests.support.sockets import free_port
from tests.support.waiting import async_wait_until

REPO = Path(__file__).resolve().parents[2]
COMPLETION = {"model": "fake", "prompt": "a b c", "max_tokens": 4}


def _ids(ctl: FakeController) -> dict[str, set[str]]:
    """proxy id -> the boots seen polling under it."""
    out: dict[str, set[str]] = {}
    for r in list(ctl.requests):
        q = parse_qs(urlsplit(r.path).query)
        if "proxy" in q:
            out.setdefault(q["proxy"][0], set()).add(q["boot"][0])
    return out


async def _health(client: httpx.AsyncClient, port: int) -> dict[str, object] | None:
    try:
        r = await client.get(f"http://127.0.0.1:{port}/healthz")
    except httpx.HTTPError:
        return None
    body: dict[str, object] = r.json()
    return body


@pytest.mark.slow
async def test_two_workers_share_a_port_poll_as_two_proxies_and_are_supervised(tmp_path: Path) -> None:
    port, admin = free_port(), free_port()
    while admin + 1 == port or admin == port:
        admin = free_port()
    async with fake_fleet(1, 1) as fleet:
        ctl = FakeController(
            table(
                [
                    ("p0", "prefill", "prefill", fleet.prefill[0].url, 1.0, False),
                    ("d0", "decode", "decode", fleet.decode[0].url, 1.0, False),
                ]
            )
        )
        async with serve(ctl.app()) as ctl_url:
            cfg = tmp_path / "pdscope.yaml"
            cfg.write_text(
                yaml.safe_dump(
                    {
                        "model": {"name": "fake", "kv_bytes_per_token": 10},
                        "pools": {
                            "prefill": {
                                "role": "prefill",
                                "instances": [{"name": "p0", "url": fleet.prefill[0].url}],
                            },
                            "decode": {
                                "role": "decode",
                                "instances": [{"name": "d0", "url": fleet.decode[0].url}],
                            },
                        },
                        "proxy": {
                            "id": "edge-1",
                            "port": port,
                            "controller_url": ctl_url,
                            "routing_poll_s": 0.1,
                            "tracing": False,
                        },
                    }
                )
            )
            proc = subprocess.Popen(  # noqa: ASYNC220 -- started, not waited on
                [
                    sys.executable,
                    "-m",
                    "pdscope.cli",
                    "--config",
                    str(cfg),
                    "proxy",
                    "--workers",
                    "2",
                    "--worker-admin-port",
                    str(admin),
                ],
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            try:
                async with httpx.AsyncClient(timeout=5) as client:
                    await async_wait_until(
                        "both workers polling under their own ids",
                        lambda: set(_ids(ctl)) == {"edge-1/w0", "edge-1/w1"},
                        timeout_s=60,
                    )
                    for i in range(2):
                        h = await _health(client, admin + i)
                        assert h is not None and h["proxy_id"] == f"edge-1/w{i}"
                    answers = await asyncio.gather(
                        *(
                            client.post(f"http://127.0.0.1:{port}/v1/completions", json=COMPLETION)
                            for _ in range(8)
                        )
                    )
                    assert [a.status_code for a in answers] == [200] * 8
                    # kill -9 one worker: the parent starts it again, under the same id, a new boot
                    h0 = await _health(client, admin)
                    assert h0 is not None
                    old_pid = int(str(h0["pid"]))
                    os.kill(old_pid, signal.SIGKILL)

                    async def restarted() -> bool:
                        h = await _health(client, admin)
                        return h is not None and h["pid"] != old_pid

                    await async_wait_until("worker 0 started again", restarted, timeout_s=60)
                    await async_wait_until(
                        "worker 0 polling with a new boot",
                        lambda: len(_ids(ctl)["edge-1/w0"]) == 2,
                        timeout_s=30,
                    )
                    pids = [int(str((await _health(client, admin + i) or {})["pid"])) for i in range(2)]
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    rc = proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    raise
    err = proc.stderr.read().decode() if proc.stderr else ""
    assert rc == 0, err
    assert "edge-1/w0 exited (code -9): starting it again" in err
    assert not [p for p in pids if p in processes_mentioning("multiprocessing")], (
        "a worker outlived its parent"
    )
