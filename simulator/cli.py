"""``pdscope sim``: run a simulated fleet; ``pdscope sim fault ...``: inject faults live.

Import-light on purpose (argparse and pdscope.config only); the fleet is imported in
``run``. The fleet comes from the config's pools (each instance bound to the port of its
URL) or from ``--prefill/--decode`` (consecutive ports from ``--port``). Prints one line
per instance (role, name, URL) and the admin URL, then serves until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pdscope.config import ConfigError, Settings, load_config, resolve_config_path
from pdscope.simconfig import DEFAULT_ADMIN_PORT
from simulator.faults import FaultKind

FAULT_KINDS: tuple[str, ...] = typing.get_args(FaultKind)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill", type=int, help="number of prefill instances (default: the config's pools)"
    )
    parser.add_argument("--decode", type=int, help="number of decode instances (default: the config's pools)")
    parser.add_argument(
        "--port", type=int, default=8100, help="first port with --prefill/--decode (default 8100)"
    )
    parser.add_argument(
        "--model", default=None, help="served model name without a config (default sim-llama-70b)"
    )
    parser.add_argument("--scenario", help="fault scenario file (YAML/JSON with 'faults:')")
    parser.add_argument("--seed", type=int, help="override simulator.seed")
    parser.add_argument(
        "--latency-scale", type=float, help="override simulator.latency_scale (0 = zero latency)"
    )
    parser.add_argument(
        "--admin-port",
        type=int,
        help=f"admin API port (default simulator.admin_port or {DEFAULT_ADMIN_PORT})",
    )
    parser.add_argument("--admin-url", help="with 'fault': the running simulator's admin URL")
    sub = parser.add_subparsers(dest="sim_action", metavar="ACTION")
    fault = sub.add_parser("fault", help="inject, list or clear faults in a running simulator")
    fsub = fault.add_subparsers(dest="fault_action", metavar="FAULT_ACTION", required=True)
    add = fsub.add_parser("add", help="inject a fault now (or after --at seconds)")
    add.add_argument("kind", choices=FAULT_KINDS, help="see simulator/faults.py for the fields of each kind")
    add.add_argument(
        "--instance", help="down, kv_capacity, slow, lease_stall (and slow_nic, stop_pulling): the instance"
    )
    add.add_argument(
        "--prefill",
        help="slow_link, stale_peer, slow_nic (a P's NIC; optionally transfer_failure): the P side",
    )
    add.add_argument(
        "--decode",
        help="slow_link, stale_peer, slow_nic, stop_pulling (optionally transfer_failure): the D side",
    )
    add.add_argument("--factor", type=float, help="slow_link, slow_nic, slow: how many times slower")
    add.add_argument("--rate", type=float, help="transfer_failure: share of NIXL reads that fail (0..1)")
    add.add_argument("--blocks", type=int, help="kv_capacity: the instance's KV blocks")
    add.add_argument("--fraction", type=float, help="kv_capacity: share of the configured blocks (0..1)")
    add.add_argument("--at", type=float, help="start after this many seconds (default now)")
    add.add_argument("--duration", type=float, help="end after this many seconds (default: until cleared)")
    fsub.add_parser("list", help="list active and scheduled faults")
    fsub.add_parser("clear", help="remove every fault")
    rm = fsub.add_parser("rm", help="remove one fault by id")
    rm.add_argument("id", type=int)


def _settings(args: argparse.Namespace) -> Settings | None:
    path = resolve_config_path(getattr(args, "config", None))
    if getattr(args, "config", None) or path.exists():
        return load_config(path)
    return None


def _admin_url(args: argparse.Namespace, settings: Settings | None) -> str:
    if args.admin_url:
        return str(args.admin_url).rstrip("/")
    port = args.admin_port or (settings.simulator.admin_port if settings else None) or DEFAULT_ADMIN_PORT
    return f"http://127.0.0.1:{port}"


def _admin_call(url: str, method: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def run_fault(args: argparse.Namespace) -> int:
    base = _admin_url(args, _settings(args))
    try:
        if args.fault_action == "add":
            spec = {
                k: getattr(args, k)
                for k in (
                    "kind",
                    "instance",
                    "prefill",
                    "decode",
                    "factor",
                    "rate",
                    "fraction",
                    "blocks",
                    "at",
                    "duration",
                )
            }
            status, out = _admin_call(
                f"{base}/faults", "POST", {k: v for k, v in spec.items() if v is not None}
            )
        elif args.fault_action == "list":
            status, out = _admin_call(f"{base}/faults", "GET")
        elif args.fault_action == "clear":
            status, out = _admin_call(f"{base}/faults", "DELETE")
        else:
            status, out = _admin_call(f"{base}/faults/{args.id}", "DELETE")
    except (urllib.error.URLError, OSError) as exc:
        print(f"pdscope sim fault: cannot reach the simulator's admin API at {base}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=2))
    return 0 if status == 200 else 1


def _local_zmq(pool: str, name: str, key: str, endpoint: str | None) -> str | None:
    """An instance's KV events endpoint as the simulator binds it: tcp on 127.0.0.1 only (localhost is
    spelled out, ZMQ binds addresses), or ipc."""
    if endpoint is None or endpoint.startswith("ipc://"):
        return endpoint
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or parts.hostname not in ("127.0.0.1", "localhost") or parts.port is None:
        raise ConfigError(
            [f"pools.{pool}: {name}: {key}: the simulator binds tcp://127.0.0.1:<port> only, not {endpoint}"]
        )
    return f"tcp://127.0.0.1:{parts.port}"


_Spec = tuple[
    str, str, str, int, str | None, str | None, str
]  # role, name, host, port, kv events, replay, topic


def _flag_specs(args: argparse.Namespace) -> list[_Spec]:
    """``--prefill``/``--decode`` instances on consecutive ports from ``--port`` (0: free ports)."""
    specs: list[_Spec] = []
    n_p = args.prefill if args.prefill is not None else 1
    n_d = args.decode if args.decode is not None else 1
    port = args.port
    for role, count in (("prefill", n_p), ("decode", n_d)):
        for i in range(count):
            specs.append(
                (
                    role,
                    f"{role}-{i}",
                    "127.0.0.1",
                    port if port == 0 else port + len(specs),
                    None,
                    None,
                    "",
                )
            )
    return specs


def _config_specs(settings: Settings) -> list[_Spec]:
    """The config's instances, which must be on 127.0.0.1."""
    specs: list[_Spec] = []
    for pool_name, inst in settings.instances():
        parts = urlsplit(inst.url)
        if parts.hostname not in ("127.0.0.1", "localhost"):
            raise ConfigError(
                [f"pools.{pool_name}: {inst.name}: the simulator binds 127.0.0.1 only, not {parts.hostname}"]
            )
        specs.append(
            (
                settings.pools[pool_name].role,
                inst.name,
                "127.0.0.1",
                parts.port or 80,
                _local_zmq(pool_name, inst.name, "kv_events_endpoint", inst.kv_events_endpoint),
                _local_zmq(pool_name, inst.name, "kv_events_replay_endpoint", inst.kv_events_replay_endpoint),
                inst.kv_events_topic,
            )
        )
    return specs


def _sim_section(args: argparse.Namespace, settings: Settings | None) -> dict[str, Any]:
    """The config's ``simulator:`` section with the command line's overrides and the admin port."""
    overrides: dict[str, Any] = {}
    if args.seed is not None:
        overrides["seed"] = args.seed
    if args.latency_scale is not None:
        overrides["latency_scale"] = args.latency_scale
    if args.scenario:
        overrides["scenario"] = args.scenario
    sim_section = settings.simulator.model_dump(exclude_defaults=True) if settings else {}
    scenario = sim_section.get("scenario")
    if isinstance(scenario, str) and not Path(scenario).is_absolute():
        # a scenario named in the config is relative to the config file
        sim_section["scenario"] = str(resolve_config_path(getattr(args, "config", None)).parent / scenario)
    sim_section.update(overrides)
    admin_port = (
        args.admin_port
        if args.admin_port is not None
        else (sim_section.get("admin_port") or DEFAULT_ADMIN_PORT)
    )
    sim_section["admin_port"] = admin_port
    return sim_section


def run(args: argparse.Namespace) -> int:
    if getattr(args, "sim_action", None) == "fault":
        return run_fault(args)
    from simulator.runtime import serve_fleet

    settings = _settings(args)
    if args.prefill is not None or args.decode is not None or settings is None:
        specs = _flag_specs(args)
    else:
        specs = _config_specs(settings)
    sim_section = _sim_section(args, settings)
    model = args.model or (settings.model.name if settings else "sim-llama-70b")
    kv_bytes = settings.model.kv_bytes_per_token if settings else None
    otlp = f"{settings.collector_url}/v1/traces" if settings else None
    return serve_fleet(specs, sim_section, model_name=model, kv_bytes_per_token=kv_bytes, otlp_endpoint=otlp)
