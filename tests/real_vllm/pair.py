"""Start and stop a real 1P1D vLLM pair on 127.0.0.1 (CPU, NixlConnector over UCX loopback).

Used by the ``real_pd`` fixture (``conftest.py``) and by ``capture_fixtures.py``. Each instance is
started with ``deploy/vllm/launch-cpu.sh`` in its own process group on free ports (HTTP and
NIXL side channel) taken outside the kernel's ephemeral range and held by lock files, so
concurrent sessions and outgoing connections cannot grab them first; P is pinned to core 0,
D to core 1. :meth:`RealPair.stop` sends SIGTERM to each group, then SIGKILL after a grace
period; it only signals groups this module started.
Logs go to ``logs_dir/<instance>.log`` and stay there.

Opt-in (``kv_events=True``): each instance publishes its KV cache events (``launch-cpu.sh
--kv-events``) on an ``ipc://`` endpoint it binds (vLLM connects a ``tcp://host:port`` PUB
endpoint instead of binding it, and ``tcp://*`` would bind every interface), with a replay
socket on a free loopback port; :meth:`RealPair.config_dict` then names both in each instance's
entry. Off by default: the session's shared pair runs without events.

Must not hang: every wait is bounded and fails with the log tails.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "deploy" / "vllm" / "launch-cpu.sh"
STAMP_NAME = ".pdscope-vllm-cpu-ready"

MODEL_NAME = "tiny"
# Tiny Llama: 2 layers * 2 KV heads * head_dim 32 * 2 (K and V) * 2 bytes (bf16).
KV_BYTES_PER_TOKEN = 2 * 2 * 32 * 2 * 2
BLOCK_SIZE = 128  # vLLM's CPU KV block size, in tokens
KV_CACHE_BYTES = 67108864  # --kv-cache-memory-bytes in launch-cpu.sh
PREFILL_NAME = "real-p0"
DECODE_NAME = "real-d0"


class PairStartError(RuntimeError):
    """The pair did not come up; the message carries both log tails."""


def _port_range() -> tuple[int, int]:
    """Ports the kernel never hands out by itself: below (or above) the ephemeral range.

    vLLM binds our ports tens of seconds after we pick them; a port from the ephemeral range
    (what binding port 0 returns) can meanwhile become some outgoing connection's local port.
    """
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999
    return (10000, lo - 1) if lo > 12000 else (hi + 1, 65535)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class PortReservations:
    """Free ports outside the ephemeral range, each held by an flock until :meth:`release`.

    The lock files keep concurrent test sessions on this machine (other pairs) off each
    other's ports between picking a port and vLLM binding it.
    """

    def __init__(self) -> None:
        self._fds: list[int] = []
        self._dir = Path(tempfile.gettempdir()) / "pdscope-real-vllm-ports"
        self._dir.mkdir(exist_ok=True)

    def take(self) -> int:
        lo, hi = _port_range()
        for _ in range(500):
            port = random.randint(lo, hi)
            fd = os.open(self._dir / f"{port}.lock", os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            if _bindable(port):
                self._fds.append(fd)
                return port
            os.close(fd)
        raise PairStartError(f"no free port found in {lo}-{hi}")

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def env_problem(env_dir: Path) -> str | None:
    """Why ``env_dir`` is not a usable CPU vLLM env, or None when it is."""
    if not (env_dir / "bin" / "python").exists():
        return f"no CPU vLLM env at {env_dir} (run `make vllm-cpu`)"
    if not (env_dir / STAMP_NAME).exists():
        return f"CPU vLLM env at {env_dir} is incomplete (no {STAMP_NAME}; rerun `make vllm-cpu`)"
    if not (env_dir / "tiny-llama" / "config.json").exists():
        return f"no tiny model in {env_dir}/tiny-llama (rerun `make vllm-cpu`)"
    return None


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Instance:
    name: str
    role: str
    port: int
    side_port: int
    core: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    kv_events_endpoint: str | None = None  # ipc://... when the pair publishes KV events
    kv_events_replay_endpoint: str | None = None  # tcp://127.0.0.1:PORT

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None


@dataclass
class RealPair:
    env_dir: Path
    logs_dir: Path
    otlp_endpoint: str | None = None
    lease_s: int | None = None
    nixl_progress: str = "delay"  # launch-cpu.sh --nixl-progress: delay | busy | off
    kv_events: bool = False  # launch-cpu.sh --kv-events (+ replay), see the module docstring
    handoff: str = "pull"  # launch-cpu.sh --handoff: pull (NixlConnector) or push (NixlPushConnector)
    engine_id: str | None = (
        None  # launch-cpu.sh --engine-id for P (kv_transfer_config.engine_id); None: vLLM's
    )
    prefill: Instance = field(init=False)
    decode: Instance = field(init=False)
    startup_s: float = 0.0

    def __post_init__(self) -> None:
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self._ports = PortReservations()
        self.prefill = Instance(PREFILL_NAME, "prefill", 0, 0, 0, self.logs_dir / f"{PREFILL_NAME}.log")
        self.decode = Instance(DECODE_NAME, "decode", 0, 0, 1, self.logs_dir / f"{DECODE_NAME}.log")
        # An ipc path must stay short (about 100 bytes): not under pytest's tmp dirs.
        self._ipc_dir = Path(tempfile.mkdtemp(prefix="pdscope-kv-")) if self.kv_events else None

    # -- lifecycle ------------------------------------------------------------------------

    def _spawn(self, inst: Instance, extra_env: dict[str, str]) -> None:
        cmd = [
            "bash",
            str(LAUNCH),
            "--role",
            inst.role,
            "--port",
            str(inst.port),
            "--side-port",
            str(inst.side_port),
            "--core",
            str(inst.core),
            "--name",
            inst.name,
            "--env",
            str(self.env_dir),
        ]
        if self.otlp_endpoint:
            cmd += ["--otlp", self.otlp_endpoint]
        if self.lease_s is not None:
            cmd += ["--lease", str(self.lease_s)]
        cmd += ["--nixl-progress", self.nixl_progress, "--handoff", self.handoff]
        if self.engine_id is not None and inst is self.prefill:
            cmd += ["--engine-id", self.engine_id]
        if inst.kv_events_endpoint:
            cmd += ["--kv-events", inst.kv_events_endpoint]
            if inst.kv_events_replay_endpoint:
                cmd += ["--kv-events-replay", inst.kv_events_replay_endpoint]
        env = dict(os.environ, **extra_env)
        with open(inst.log, "ab") as log:
            inst.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=REPO,
                env=env,
                start_new_session=True,
            )

    def start(self, timeout_s: float = 240.0, extra_env: dict[str, str] | None = None) -> RealPair:
        """Start both and wait until each answers ``/health`` and holds its ports.

        A lost port race (another process bound one of our ports first) is retried once on
        fresh ports. Raises :class:`PairStartError` with both log tails.
        """
        t0 = time.monotonic()
        for attempt in (1, 2):
            self._ports.release()
            for inst in (self.prefill, self.decode):
                if attempt > 1 and inst.log.exists():
                    inst.log.rename(inst.log.with_suffix(f".attempt{attempt - 1}.log"))
                inst.port, inst.side_port = self._ports.take(), self._ports.take()
                if self._ipc_dir is not None:
                    self._ipc_dir.mkdir(exist_ok=True)
                    inst.kv_events_endpoint = f"ipc://{self._ipc_dir}/{inst.name}.sock"
                    inst.kv_events_replay_endpoint = f"tcp://127.0.0.1:{self._ports.take()}"
                self._spawn(inst, extra_env or {})
            try:
                self._wait_healthy(t0 + timeout_s)
                self._check_ports_bound()
                break
            except PairStartError as exc:
                self.stop()
                if attempt == 2 or "Address already in use" not in str(exc):
                    raise
            except BaseException:
                self.stop()
                raise
        self.startup_s = time.monotonic() - t0
        return self

    def _check_ports_bound(self) -> None:
        # vLLM's NIXL side-channel listener runs in a thread: if its bind fails, the thread dies
        # and /health still answers 200. Its log line is the only sign.
        for inst in (self.prefill, self.decode):
            if "Address already in use" in tail(inst.log, 400):
                raise PairStartError(
                    f"{inst.name} lost a port race (Address already in use)\n" + self.log_tails()
                )

    def _wait_healthy(self, deadline: float) -> None:
        pending = [self.prefill, self.decode]
        with httpx.Client(timeout=2.0) as client:
            while pending:
                for inst in list(pending):
                    assert inst.proc is not None
                    rc = inst.proc.poll()
                    if rc is not None:
                        raise PairStartError(
                            f"{inst.name} exited with {rc} before it was healthy\n" + self.log_tails()
                        )
                    with contextlib.suppress(httpx.HTTPError):
                        if client.get(inst.url + "/health").status_code == 200:
                            pending.remove(inst)
                if not pending:
                    return
                self._check_ports_bound()  # a lost port race hangs start-up: fail fast instead
                if time.monotonic() > deadline:
                    names = ", ".join(i.name for i in pending)
                    raise PairStartError(
                        f"{names} not healthy after the start-up budget\n" + self.log_tails()
                    )
                time.sleep(0.5)

    def restart(self, inst: Instance, timeout_s: float, extra_env: dict[str, str] | None = None) -> float:
        """Stop ``inst`` (its whole process group) and start it again on the same ports, as a restarted pod
        comes back; returns the seconds until it answered ``/health`` again."""
        t0 = time.monotonic()
        self._stop_procs([inst], grace_s=15.0)
        self._spawn(inst, extra_env or {})
        deadline = t0 + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                assert inst.proc is not None
                if (rc := inst.proc.poll()) is not None:
                    raise PairStartError(f"{inst.name} exited with {rc} on restart\n" + self.log_tails())
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(inst.url + "/health").status_code == 200:
                        return time.monotonic() - t0
                if time.monotonic() > deadline:
                    raise PairStartError(f"{inst.name} not healthy after its restart\n" + self.log_tails())
                time.sleep(0.5)

    def stop(self, grace_s: float = 15.0) -> None:
        """TERM each process group we started, KILL what is left after ``grace_s``."""
        self._stop_procs([self.prefill, self.decode], grace_s)
        self._ports.release()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    @staticmethod
    def _stop_procs(instances: list[Instance], grace_s: float) -> None:
        procs = [i.proc for i in instances if i.proc is not None]
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        for p in procs:
            # The group may outlive its leader (engine core, worker): kill the group either way.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)

    # -- inspection -----------------------------------------------------------------------

    def log_tails(self, lines: int = 40) -> str:
        out = []
        for inst in (self.prefill, self.decode):
            out.append(f"----- {inst.name} ({inst.log}), last {lines} lines -----\n{tail(inst.log, lines)}")
        return "\n".join(out)

    def _group_pids(self, inst: Instance) -> list[Path]:
        if inst.proc is None:
            return []
        found = []
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit():
                continue
            try:
                stat = (pid_dir / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[2]) == inst.proc.pid:
                    found.append(pid_dir)
            except (OSError, ValueError, IndexError):
                continue
        return found

    def rss_bytes(self) -> dict[str, int]:
        """Resident memory of each instance's whole process group (from /proc), in bytes."""
        out: dict[str, int] = {}
        for inst in (self.prefill, self.decode):
            total = 0
            for pid_dir in self._group_pids(inst):
                try:
                    for line in (pid_dir / "status").read_text().splitlines():
                        if line.startswith("VmRSS:"):
                            total += int(line.split()[1]) * 1024
                except (OSError, ValueError, IndexError):
                    continue
            out[inst.name] = total
        return out

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) used so far by each instance's live processes."""
        tick = os.sysconf("SC_CLK_TCK")
        out: dict[str, float] = {}
        for inst in (self.prefill, self.decode):
            total = 0
            for pid_dir in self._group_pids(inst):
                try:
                    fields = (pid_dir / "stat").read_text().rsplit(")", 1)[1].split()
                    total += int(fields[11]) + int(fields[12])
                except (OSError, ValueError, IndexError):
                    continue
            out[inst.name] = total / tick
        return out

    def _entry(self, inst: Instance) -> dict[str, Any]:
        entry: dict[str, Any] = {"name": inst.name, "url": inst.url, "labels": {"hw": "cpu"}}
        if inst.kv_events_endpoint:
            entry["kv_events_endpoint"] = inst.kv_events_endpoint
            entry["kv_events_replay_endpoint"] = inst.kv_events_replay_endpoint
        return entry

    def config_dict(self, **sections: Any) -> dict[str, Any]:
        """A pdscope config for this pair; ``sections`` are merged in at the top level."""
        cfg: dict[str, Any] = {
            "model": {"name": MODEL_NAME, "kv_bytes_per_token": KV_BYTES_PER_TOKEN},
            "pools": {
                "prefill": {
                    "role": "prefill",
                    "handoff": self.handoff,
                    "instances": [self._entry(self.prefill)],
                },
                "decode": {
                    "role": "decode",
                    "handoff": self.handoff,
                    "instances": [self._entry(self.decode)],
                },
            },
        }
        cfg.update(sections)
        return cfg

    def config_yaml(self, **sections: Any) -> str:
        """:meth:`config_dict` as the YAML text of a pdscope.yaml."""
        return yaml.safe_dump(self.config_dict(**sections), sort_keys=False)

    def write_config(self, path: Path, **sections: Any) -> Path:
        path.write_text(yaml.safe_dump(self.config_dict(**sections), sort_keys=False))
        return path
