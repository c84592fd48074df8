"""``pdscope sim`` as a process: flags or config pools, live faults, clean Ctrl-C."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
import zmq

from pdscope import simtokenizer
from pdscope.cli import main
from pdscope.config import ConfigError
from pdscope.kvevents import END_SEQ, Batch, BlockStored, decode_batch, decode_seq
from simulator.cli import _local_zmq
from tests.support.sockets import free_port, free_ports
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
PDSCOPE = [sys.executable, "-m", "pdscope.cli"]


class SimProcess:
    def __init__(self, args: list[str], cwd: Path) -> None:
        self.proc = subprocess.Popen(
            [*PDSCOPE, *args],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_admin(self, timeout: float = 20.0) -> dict[str, str]:
        """The URLs the simulator printed (instance name or ``admin`` -> URL), once it printed the
        admin one."""

        def printed() -> list[list[str]] | None:
            rows = [line.split() for line in self.lines]
            if any(r and r[0] == "admin" for r in rows):
                return rows
            if self.proc.poll() is not None:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise AssertionError(f"simulator exited before it started: {self.lines} {err}")
            return None

        rows = wait_until("the simulator to print its admin URL", printed, timeout_s=timeout)
        return {
            r[1] if r[0] != "admin" else "admin": r[-1]
            for r in rows
            if r and r[0] in ("prefill", "decode", "admin")
        }

    def interrupt(self, timeout: float = 15.0) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        return self.proc.returncode, err


@pytest.fixture()
def sims() -> Iterator[list[SimProcess]]:
    started: list[SimProcess] = []
    yield started
    for sim in started:
        if sim.proc.poll() is None:
            sim.proc.kill()
            sim.proc.wait(5)


def fault_cli(admin: str, *args: str) -> tuple[int, object]:
    """``pdscope sim fault ...`` in-process (it is only an HTTP client of the admin API)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["sim", "--admin-url", admin, "fault", *args])
    return code, json.loads(out.getvalue()) if out.getvalue().strip() else err.getvalue()


@pytest.mark.slow
def test_sim_from_flags_with_scenario_and_live_faults(tmp_path: Path, sims: list[SimProcess]) -> None:
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text("faults:\n  - {at: 0, kind: slow_nic, decode: decode-1, factor: 5}\n")
    sim = SimProcess(
        [
            "sim",
            "--prefill",
            "1",
            "--decode",
            "2",
            "--port",
            "0",
            "--admin-port",
            "0",
            "--latency-scale",
            "0",
            "--scenario",
            str(scenario),
        ],
        tmp_path,
    )
    sims.append(sim)
    urls = sim.wait_admin()
    roles = {
        line.split()[1]: line.split()[0] for line in sim.lines if line.split()[0] in ("prefill", "decode")
    }
    assert roles == {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}
    for name in roles:
        assert httpx.get(urls[name] + "/health", timeout=5).status_code == 200
    admin = urls["admin"]
    code, out = fault_cli(admin, "add", "slow", "--instance", "decode-0", "--factor", "3")
    assert code == 0 and isinstance(out, dict)
    fid = out["id"]
    code, out = fault_cli(admin, "list")
    assert code == 0 and isinstance(out, dict)
    assert sorted(f["kind"] for f in out["faults"]) == ["slow", "slow_nic"]
    assert fault_cli(admin, "rm", str(fid))[0] == 0
    assert fault_cli(admin, "rm", str(fid))[0] == 1
    code, out = fault_cli(admin, "add", "slow_link", "--prefill", "prefill-0")  # no decode, no factor
    assert code == 1
    assert fault_cli(admin, "clear") == (0, {"cleared": 1})
    code, err = sim.interrupt()
    assert code == 0 and "simulator stopped" in err


@pytest.mark.slow
def test_sim_from_config_binds_the_pool_urls(tmp_path: Path, sims: list[SimProcess]) -> None:
    ports = free_ports(5)
    pa = {
        "name": "pa",
        "url": f"http://127.0.0.1:{ports[0]}",
        "kv_events_endpoint": f"tcp://localhost:{ports[3]}",
        "kv_events_replay_endpoint": f"tcp://127.0.0.1:{ports[4]}",
        "kv_events_topic": "kv@pa",
    }
    cfg = {
        "model": {"name": "m-test", "kv_bytes_per_token": 1024},
        "pools": {
            "p": {"role": "prefill", "instances": [pa]},
            "d": {"role": "decode", "instances": [{"name": "da", "url": f"http://127.0.0.1:{ports[1]}"}]},
        },
        "simulator": {"admin_port": ports[2], "latency_scale": 0, "scenario": "faults.yaml"},
    }
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "faults.yaml").write_text("faults:\n  - {kind: slow, instance: pa, factor: 2}\n")
    path = tmp_path / "conf" / "pdscope.yaml"
    path.write_text(yaml.safe_dump(cfg))
    sim = SimProcess(["--config", str(path), "sim"], tmp_path)
    sims.append(sim)
    urls = sim.wait_admin()
    assert urls == {
        "pa": f"http://127.0.0.1:{ports[0]}",
        "da": f"http://127.0.0.1:{ports[1]}",
        "admin": f"http://127.0.0.1:{ports[2]}",
    }
    models = httpx.get(urls["da"] + "/v1/models", timeout=5).json()
    assert models["data"][0]["id"] == "m-test"
    faults = httpx.get(urls["admin"] + "/faults", timeout=5).json()[
        "faults"
    ]  # scenario found next to the config
    assert [(f["kind"], f["instance"]) for f in faults] == [("slow", "pa")]
    # pa publishes its KV events where its config entry says; the replay socket has them all
    prompt = " ".join(f"w{i}" for i in range(40))
    body = {"model": "m-test", "prompt": prompt, "max_tokens": 1}
    assert httpx.post(urls["pa"] + "/v1/completions", json=body, timeout=5).status_code == 200
    stored = [
        e
        for _, b in replay_all(f"tcp://127.0.0.1:{ports[4]}")
        for e in b.events
        if isinstance(e, BlockStored)
    ]
    assert [t for e in stored for t in e.token_ids] == simtokenizer.text_ids(prompt)[:32]
    ids = simtokenizer.text_ids(prompt)
    got = httpx.post(urls["admin"] + "/admin/cached_tokens", json={"token_ids": ids}, timeout=5).json()
    assert got == {"instances": {"pa": 32, "da": 0}}
    code, _ = sim.interrupt()
    assert code == 0


def replay_all(endpoint: str) -> list[tuple[str, Batch]]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    out: list[tuple[str, Batch]] = []
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big", signed=True)])
        for _ in range(10_000):
            assert sock.poll(5000), "no end of replay"
            frames = sock.recv_multipart()
            if decode_seq(frames[-2]) == END_SEQ:
                return out
            out.append((frames[1].decode(), decode_batch(frames[-1])))
    finally:
        sock.close(0)
    raise AssertionError("replay did not end")


@pytest.mark.parametrize(
    ("endpoint", "bound"),
    [
        (None, None),
        ("tcp://localhost:5557", "tcp://127.0.0.1:5557"),
        ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5557"),
        ("ipc:///tmp/kv.sock", "ipc:///tmp/kv.sock"),
        ("tcp://10.0.0.5:5557", "error"),
        ("tcp://127.0.0.1", "error"),
    ],
)
def test_kv_events_endpoints_bind_locally_only(endpoint: str | None, bound: str | None) -> None:
    if bound == "error":
        with pytest.raises(ConfigError, match=r"pools\.p: pa: kv_events_endpoint"):
            _local_zmq("p", "pa", "kv_events_endpoint", endpoint)
    else:
        assert _local_zmq("p", "pa", "kv_events_endpoint", endpoint) == bound


def test_fault_cli_without_a_simulator_says_so(tmp_path: Path) -> None:
    code, err = fault_cli(f"http://127.0.0.1:{free_port()}", "list")
    assert code == 1 and "cannot reach" in str(err)


def test_bad_scenario_is_a_config_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario = tmp_path / "bad.yaml"
    scenario.write_text("faults:\n  - {kind: slow_link, factor: 2}\n")
    code = main(["sim", "--port", "0", "--admin-port", "0", "--scenario", str(scenario)])
    err = capsys.readouterr().err
    assert code == 1 and "faults[0]" in err and "prefill" in err
