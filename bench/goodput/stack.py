"""One contender's services for one run: a simulated fleet, pdscope's proxy, and for the controlled
contenders ``pdscope collect`` + ``pdscope control``; all subprocesses of the worker, driven through
their CLIs and one generated pdscope.yaml, stopped on exit (SIGTERM, then SIGKILL after 15 s).
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.goodput.catalogue import CONTROLLED, FleetShape
from pdscope.stack import Child, ChildGroup, free_ports, loopback_url, pdscope_argv, write_config

REPO = Path(__file__).resolve().parents[2]
SLO_TTFT_S, SLO_TPOT_S = 2.0, 0.1
MODEL = "sim-llama-70b"
SIM = {"link_bandwidth_bytes_per_s": 2.5e9, "lease_duration_s": 3.0}
INTERVAL_S = 1.0
CONTROLLER_WINDOW_S = 10.0
STARTUP_HOLD_S = 2 * CONTROLLER_WINDOW_S  # controller.noise.startup_s's default: no latency cuts before it
CLK_TCK = os.sysconf("SC_CLK_TCK")


def http_json(url: str, method: str = "GET", body: Any = None, timeout: float = 5.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def metric_sum(url: str, name: str) -> float:
    total = 0.0
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
    return total


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a live (or not yet reaped) process, from /proc (Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


@dataclass(frozen=True)
class StackSpec:
    fleet: FleetShape
    contender: str
    sim_seed: int
    fail_static_s: float
    oracle_url: str | None = None
    handoff: str = "pull"  # pull, push, or push_early (push with proxy.push_early)


class Stack:
    """``with Stack(spec, tmp) as s:`` starts everything and waits until it answers."""

    def __init__(self, spec: StackSpec, tmp: Path) -> None:
        self.spec = spec
        self.contender = spec.contender
        self.tmp = tmp
        self.children = ChildGroup(grace_s=15.0)
        self.cpu_at_kill: dict[str, float | None] = {}
        names = [
            *((n, "prefill") for n in spec.fleet.prefills()),
            *((n, "decode") for n in spec.fleet.decodes()),
        ]
        ports = iter(free_ports(len(names) + 5))
        self.ports = {k: next(ports) for k in ("proxy", "collector", "controller", "admin")}
        self.inst = [(n, role, role, loopback_url(next(ports))) for n, role in names]
        self.store_url = f"sqlite:///{tmp / 'store.db'}"
        dead = loopback_url(next(ports))  # no controller: the proxy never reaches one
        self.config = write_config(tmp / "pdscope.yaml", self._config(dead))
        self.proxy_url = f"http://127.0.0.1:{self.ports['proxy']}"
        self.admin_url = f"http://127.0.0.1:{self.ports['admin']}"
        self.controller_url = f"http://127.0.0.1:{self.ports['controller']}"

    def _controller_url(self, dead: str) -> str | None:
        """The controller the proxy follows: ``pdscope control``, the oracle's table, or ``dead``."""
        if self.contender in CONTROLLED:
            return loopback_url(self.ports["controller"])
        return self.spec.oracle_url if self.contender == "oracle" else dead

    def _config(self, dead: str) -> dict[str, Any]:
        """The run's pdscope.yaml: the fleet and its store, then each service's section."""
        controlled = self.contender in CONTROLLED
        return {
            "model": {"name": MODEL, "kv_bytes_per_token": 327680},
            "pools": {
                pool: {
                    "role": pool,
                    "handoff": self._mode,
                    "instances": [{"name": n, "url": u} for n, p, _, u in self.inst if p == pool],
                }
                for pool in ("prefill", "decode")
            },
            "slo": {
                "ttft": {"target_ms": SLO_TTFT_S * 1000},
                "tpot": {"target_ms": SLO_TPOT_S * 1000},
                "window_s": 30,
            },
            "store": {"url": self.store_url},
            # Controlled runs: the simulated vLLMs send their request spans to the collector, as vLLM does
            # with --otlp-traces-endpoint (P's queue time is in them); the others have no collector.
            "simulator": {
                **SIM,
                "seed": self.spec.sim_seed,
                "admin_port": self.ports["admin"],
                "tracing": controlled,
                "transfer_mode": self._mode,
            },
            "collector": {
                "port": self.ports["collector"],
                "scrape_interval_s": INTERVAL_S,
                "scrape_timeout_s": 0.8 * INTERVAL_S,
                # the run's own folder, not the default <temp dir>/pdscope-spool/<hash> that outlives it
                "spool_dir": str(self.tmp / "collector-spool"),
            },
            "controller": {
                "port": self.ports["controller"],
                "interval_s": INTERVAL_S,
                "window_s": CONTROLLER_WINDOW_S,
                "mode": "enforce",
                "kv_lease_s": SIM["lease_duration_s"],
            },  # the simulated fleet's lease
            "proxy": self._proxy_config(self._controller_url(dead), controlled),
        }

    def _proxy_config(self, controller_url: str | None, controlled: bool) -> dict[str, Any]:
        """The proxy's section, following ``controller_url`` (tracing on for the controlled runs)."""
        round_robin = self.contender == "round_robin"
        return {
            "port": self.ports["proxy"],
            "policy": "round-robin" if round_robin else "weighted",
            "controller_url": controller_url,
            "routing_poll_s": 0.5,
            "tracing": controlled,
            "fail_static_s": self.spec.fail_static_s,
            "otlp_endpoint": f"http://127.0.0.1:{self.ports['collector']}/v1/traces",
            # round robin: the toy proxy's behaviour, no admission limit; the others: config defaults
            "admission": {"max_inflight_requests": 10**6 if round_robin else 256, "queue_timeout_s": 1.0},
            "timeouts": {"prefill_s": 30, "decode_first_token_s": 30, "decode_total_s": 60},
            "push_early": self.spec.handoff == "push_early",
        }

    @property
    def _mode(self) -> str:
        """The pools' and the simulated instances' handoff mode."""
        return "pull" if self.spec.handoff == "pull" else "push"

    def _start(self, command: str, ready_url: str | None = None) -> None:
        argv = pdscope_argv(self.config, command, log_level="WARNING")
        self.children.start(Child(command, argv, self.tmp / f"{command}.log", ready_url=ready_url, cwd=REPO))

    def __enter__(self) -> Stack:
        from store.migrate import upgrade

        with self.children.starting():
            upgrade(self.store_url)  # once, before the services that share the store
            self._start("sim", self.admin_url + "/instances")
            if self.contender in CONTROLLED:
                self._start("collect")
                self._start("control", self.controller_url + "/healthz")
            self._start("proxy", self.proxy_url + "/healthz")
        return self

    def __exit__(self, *exc: object) -> None:
        self.children.stop()

    def inject(self, fault: dict[str, Any]) -> None:
        http_json(self.admin_url + "/faults", "POST", fault)

    def kill_controller(self) -> None:
        """SIGKILL ``pdscope control``: no clean shutdown, the proxy finds out by its polls failing."""
        control = self.children["control"]
        self.cpu_at_kill["control"] = cpu_seconds(control.pid)
        control.signal(signal.SIGKILL)

    def expired_leases(self, without: frozenset[str] = frozenset()) -> float:
        """P's expired KV leases so far, over the Ps not in ``without`` (a P that is down answers no
        scrape: leave it out of both ends of a difference)."""
        return sum(
            metric_sum(u, "vllm:nixl_num_kv_expired_reqs_total")
            for n, _, r, u in self.inst
            if r == "prefill" and n not in without
        )

    def cpu(self) -> dict[str, float | None]:
        """CPU seconds each service has used so far (the killed controller: up to its kill)."""
        return {
            c.name: self.cpu_at_kill.get(c.name) if c.name in self.cpu_at_kill else cpu_seconds(c.pid)
            for c in self.children
        }

    def proxy_state(self) -> str | None:
        try:
            return str(http_json(self.proxy_url + "/healthz", timeout=2).get("routing"))
        except (OSError, ValueError):
            return None

    def sim_lag(self) -> dict[str, Any] | None:
        try:
            return dict(http_json(self.admin_url + "/stats", timeout=2))
        except (OSError, ValueError):
            return None

    def reset_sim_lag(self) -> None:
        http_json(self.admin_url + "/stats/reset", "POST", {})
