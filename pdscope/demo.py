"""``pdscope demo``: the whole stack on one machine, with a fault to watch.

A supervisor of child processes, each a ``pdscope`` subcommand with a config written
into the demo's work folder: the simulated fleet (or, with ``--real-vllm``, a real CPU
vLLM 1P1D pair), the collector, the controller, the proxy and the dashboard, then a
steady open-loop load through the proxy. After ``--fault-after`` seconds one decode
link is made 10x slower; the supervisor prints every routing-weight change the
controller makes, so the reaction is visible in the terminal as well as the dashboard.

Every child runs in its own process group and is stopped by PID (TERM, then KILL) on
Ctrl-C, on SIGTERM, when ``--duration`` ends or when a child dies; nothing is left
behind. This module only orchestrates: it imports no service package.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pdscope.config import Settings, load_config, parse_config, resolve_config_path

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--real-vllm", action="store_true",
                        help="run against a real CPU vLLM 1P1D pair with NIXL (needs `make vllm-cpu`)")
    parser.add_argument("--workdir", default=".demo", help="store, generated config and logs (default .demo)")
    parser.add_argument("--rate", type=float, default=None, help="requests per second (default 4, 1 with --real-vllm)")
    parser.add_argument("--fault-after", type=float, default=60.0,
                        help="seconds before one decode link is made 10x slower (default 60; <0 = never)")
    parser.add_argument("--duration", type=float, default=3600.0,
                        help="stop everything after this many seconds (default 3600)")
    parser.add_argument("--no-dashboard", action="store_true", help="do not start the Streamlit dashboard")
    parser.add_argument("--vllm-env", default=".vllm-cpu", help="CPU vLLM environment for --real-vllm")


@dataclass
class Child:
    name: str
    argv: list[str]
    health_url: str | None
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = self.log_path.open("ab")
        self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=REPO, start_new_session=True)
        out.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # say so, and let the stack stop the others
                print(f"{self.name} (pid {self.proc.pid}) still runs after SIGKILL", file=sys.stderr, flush=True)

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class Stack:
    children: list[Child] = field(default_factory=list)

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop()


def _http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            status: int = resp.status
            return 200 <= status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _http_json(url: str, timeout_s: float = 2.0) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _wait_healthy(child: Child, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not child.alive():
            raise RuntimeError(f"{child.name} exited during start-up:\n{child.tail()}")
        if child.health_url is None or _http_ok(child.health_url):
            return
        time.sleep(0.5)
    raise RuntimeError(f"{child.name} not healthy at {child.health_url} after {timeout_s:.0f}s:\n{child.tail()}")


def demo_config(base: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """The user's config with the store moved into the work folder."""
    cfg = dict(base)
    cfg["store"] = dict(cfg.get("store") or {}, url=f"sqlite:///{(workdir / 'pdscope.db').resolve()}")
    return cfg


def real_vllm_config(workdir: Path, ports: dict[str, int]) -> dict[str, Any]:
    """A config for the real CPU pair (tiny Llama: 2 layers x 2 KV heads x 32 dims x K,V x bf16)."""
    return {
        "model": {"name": "tiny", "kv_bytes_per_token": 2 * 2 * 32 * 2 * 2},
        "pools": {
            "prefill": {"role": "prefill", "instances": [{"name": "real-p0", "url": f"http://127.0.0.1:{ports['p']}"}]},
            "decode": {"role": "decode", "instances": [{"name": "real-d0", "url": f"http://127.0.0.1:{ports['d']}"}]},
        },
        "slo": {"ttft": {"target_ms": 2000}, "tpot": {"target_ms": 200}},
        "store": {"url": f"sqlite:///{(workdir / 'pdscope.db').resolve()}"},
    }


def _services(settings: Settings, cfg_path: Path, workdir: Path, args: argparse.Namespace,
              vllm_ports: dict[str, int] | None) -> list[Child]:
    py = sys.executable
    base = [py, "-m", "pdscope.cli", "--config", str(cfg_path)]
    logs = workdir / "logs"
    children: list[Child] = []
    if vllm_ports is None:
        admin_port = int(settings.simulator.get("admin_port", 8399))
        children.append(Child("simulator", [*base, "sim", "--admin-port", str(admin_port)],
                              f"http://127.0.0.1:{admin_port}/instances", logs / "simulator.log"))
    else:
        launch = str(REPO / "deploy" / "vllm" / "launch-cpu.sh")
        otlp = f"{settings.collector_url}/v1/traces"
        for role, key, side, core, name in (("prefill", "p", "ps", 0, "real-p0"), ("decode", "d", "ds", 1, "real-d0")):
            children.append(Child(
                name, ["bash", launch, "--role", role, "--port", str(vllm_ports[key]), "--side-port",
                       str(vllm_ports[side]), "--core", str(core), "--name", name, "--otlp", otlp,
                       "--env", str(Path(args.vllm_env).resolve())],
                f"http://127.0.0.1:{vllm_ports[key]}/health", logs / f"{name}.log"))
    c, ctl, px, db = settings.collector, settings.controller, settings.proxy, settings.dashboard
    children.append(Child("collector", [*base, "collect"], f"http://{c.host}:{c.port}/healthz", logs / "collector.log"))
    children.append(Child("controller", [*base, "control"], f"http://{ctl.host}:{ctl.port}/healthz",
                          logs / "controller.log"))
    children.append(Child("proxy", [*base, "proxy"], f"http://{px.host}:{px.port}/healthz", logs / "proxy.log"))
    if not args.no_dashboard:
        children.append(Child("dashboard", [*base, "dashboard"], f"http://{db.host}:{db.port}/_stcore/health",
                              logs / "dashboard.log"))
    return children


def _weights(controller_url: str) -> dict[str, tuple[float, str]]:
    table = _http_json(f"{controller_url}/v1/routing")
    if not isinstance(table, dict):
        return {}
    return {i["name"]: (float(i.get("weight", 0.0)), str(i.get("reason", ""))) for i in table.get("instances", [])}


def run(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    vllm_ports: dict[str, int] | None = None
    if args.real_vllm:
        env_python = Path(args.vllm_env) / "bin" / "python"
        if not env_python.exists():
            print(f"pdscope demo --real-vllm: no CPU vLLM environment at {args.vllm_env}; run `make vllm-cpu` first",
                  file=sys.stderr)
            return 1
        vllm_ports = {"p": 8100, "d": 8200, "ps": 5600, "ds": 5601}
        cfg = real_vllm_config(workdir, vllm_ports)
    else:
        src = resolve_config_path(args.config or str(REPO / "examples" / "pdscope.yaml"))
        load_config(src)  # validate the user's file first: its errors name its lines
        cfg = demo_config(yaml.safe_load(src.read_text()), workdir)
    cfg_path = workdir / "pdscope.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    settings = parse_config(cfg_path.read_text(), str(cfg_path))

    from store import migrate

    migrate.upgrade(settings.store.url)

    env = dict(os.environ)
    token_var = settings.controller.api_token_env
    if not env.get(token_var):
        env[token_var] = secrets.token_urlsafe(18)
    env["PYTHONUNBUFFERED"] = "1"

    stack = Stack()
    stopping = {"signal": False}

    def on_signal(signum: int, _frame: object) -> None:
        stopping["signal"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    t0 = time.monotonic()
    try:
        for child in _services(settings, cfg_path, workdir, args, vllm_ports):
            print(f"starting {child.name:<11} (log: {child.log_path})", flush=True)
            child.start(env)
            stack.children.append(child)
            _wait_healthy(child, 240.0 if args.real_vllm and child.name.startswith("real-") else 60.0)
            if stopping["signal"]:
                return 130
        proxy_url = f"http://{settings.proxy.host}:{settings.proxy.port}"
        rate = args.rate if args.rate is not None else (1.0 if args.real_vllm else 4.0)
        remaining = max(1.0, args.duration - (time.monotonic() - t0))
        load_argv = [sys.executable, "-m", "pdscope.cli", "--config", str(cfg_path), "load", "--url", proxy_url,
                     "--rate", str(rate), "--duration", str(remaining), "-n", str(int(rate * remaining) + 1),
                     "--no-progress", "--output", str(workdir / "load-results.json")]
        if args.real_vllm:
            load_argv += ["--prompt-len", "uniform:16:200", "--output-len", "fixed:16"]
        load = Child("load", load_argv, None, workdir / "logs" / "load.log")
        load.start(env)
        stack.children.append(load)

        print("\npdscope demo is running:", flush=True)
        for name, url in (("proxy (OpenAI API)", proxy_url),
                          ("controller API", settings.controller_url),
                          ("collector (OTLP, /metrics)", settings.collector_url),
                          *([] if args.no_dashboard else
                            [("dashboard", f"http://{settings.dashboard.host}:{settings.dashboard.port}")])):
            print(f"  {name:<28} {url}", flush=True)
        for pool_name, inst in settings.instances():
            print(f"  {pool_name + ' / ' + inst.name:<28} {inst.url}", flush=True)
        print(f"  API token ({token_var})      {env[token_var]}", flush=True)
        fault_at = t0 + args.fault_after if args.fault_after >= 0 else None
        print(f"load: {rate:g} req/s through the proxy; "
              + (f"fault in {args.fault_after:.0f}s; " if fault_at else "")
              + "Ctrl-C stops everything.\n", flush=True)

        last: dict[str, tuple[float, str]] = {}
        injected = False
        while not stopping["signal"] and time.monotonic() - t0 < args.duration:
            time.sleep(1.0)
            dead = [c for c in stack.children if c.name != "load" and not c.alive()]
            if dead:
                print(f"{dead[0].name} exited unexpectedly:\n{dead[0].tail()}", file=sys.stderr, flush=True)
                return 1
            if fault_at is not None and not injected and time.monotonic() >= fault_at:
                injected = _inject_fault(settings, cfg_path, env, args, workdir)
            now = _weights(settings.controller_url)
            for name, (w, reason) in sorted(now.items()):
                old = last.get(name)
                if old is None or abs(old[0] - w) >= 0.01:
                    print(f"[{time.monotonic() - t0:6.1f}s] weight {name}: "
                          f"{'-' if old is None else f'{old[0]:.2f}'} -> {w:.2f}  {reason}", flush=True)
            if now:
                last = now
        return 0
    except RuntimeError as exc:
        print(f"pdscope demo: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        print("stopping the demo...", flush=True)
        stack.stop()
        print("stopped.", flush=True)


def _inject_fault(settings: Settings, cfg_path: Path, env: dict[str, str], args: argparse.Namespace,
                  workdir: Path) -> bool:
    decodes = [inst.name for _, inst in settings.instances("decode")]
    if args.real_vllm or not decodes:
        print("(no fault is injected into a real vLLM pair; watch the live figures instead)", flush=True)
        return True
    target = decodes[0]
    admin_port = int(settings.simulator.get("admin_port", 8399))
    argv: Sequence[str] = [sys.executable, "-m", "pdscope.cli", "--config", str(cfg_path), "sim",
                           "--admin-url", f"http://127.0.0.1:{admin_port}", "fault", "add", "slow_nic",
                           "--decode", target, "--factor", "10"]
    out = subprocess.run(list(argv), env=env, cwd=REPO, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        print(f"fault injection failed: {out.stderr.strip() or out.stdout.strip()}", file=sys.stderr, flush=True)
        return True
    print(f"FAULT: {target}'s NIC is now 10x slower (KV pulls take 10x longer); "
          "watch its weight fall on the Controller page.", flush=True)
    (workdir / "fault.json").write_text(json.dumps({"instance": target, "kind": "slow_nic", "factor": 10,
                                                    "at": time.time()}))
    return True
