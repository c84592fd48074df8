"""One contender's services for one run of the prefix benchmark: a simulated 4P+4D fleet (or 4P+nD) with
prefix caching, and in front of it the contender (pdscope's proxy in one of its modes, the
oracle's proxy, or vLLM's Rust router), all subprocesses started from one generated
pdscope.yaml and stopped on exit (SIGTERM, then SIGKILL after 15 s).

The simulated fleet: KV capacity of :data:`KV_CAPACITY_BLOCKS` 16-token blocks per instance,
about five of the sixteen 2,000-token system prompts (plus the requests in flight); prefill at
:data:`PREFILL_TOKENS_PER_S` per P, so prefill dominates TTFT and a cache hit saves most of it.
A contender that needs a feature this checkout lacks fails before anything starts, with a
:class:`Missing` naming it (the config key, the build argument or the admin endpoint).
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.goodput.stack import REPO, http_json
from bench.proxy.run import vllm_router_binary
from pdscope.stack import Child, ChildGroup, free_ports, loopback_url, pdscope_argv, write_config

MODEL = "sim-llama-8b"
P_COUNT, D_COUNT = 4, 4
BLOCK_SIZE = 16
KV_CAPACITY_BLOCKS = 720  # 11,520 tokens: ~5 of the 16 system prompts, minus what is in flight
PREFILL_TOKENS_PER_S = 3000.0
KV_BYTES_PER_TOKEN = 131072  # an 8B model with GQA: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes
LINK_BYTES_PER_S = 10e9
SLO_TTFT_S, SLO_TPOT_S = 1.5, 0.1  # TTFT budget is a bucket edge of vllm:request_queue_time_seconds
OUTPUT_TOKENS = 16
SIM = {
    "prefill_tokens_per_s": PREFILL_TOKENS_PER_S,
    "block_size": BLOCK_SIZE,
    "kv_capacity_blocks": KV_CAPACITY_BLOCKS,
    "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
    "link_bandwidth_bytes_per_s": LINK_BYTES_PER_S,
    "lease_duration_s": 3.0,
    "prefix_caching": True,
}
CONTENDERS = ("round_robin", "load_only", "approximate", "precise", "vllm_router", "oracle")
EVENTS = {"precise", "vllm_router"}  # contenders whose fleet publishes KV events


class Missing(RuntimeError):
    """A contender needs something this checkout does not have."""


APPROX_CHARS_PER_TOKEN = 6.8  # the workloads' words: "w" + 0-49999 + a space


def kv_aware(mode: str) -> dict[str, Any]:
    """The KV-aware router's settings, told the fleet's true figures (as an operator would)."""
    return {
        "mode": mode,
        "prefill_tokens_per_s": PREFILL_TOKENS_PER_S,
        "transfer_tokens_per_s": LINK_BYTES_PER_S / KV_BYTES_PER_TOKEN,
        "approx_capacity_tokens": KV_CAPACITY_BLOCKS * BLOCK_SIZE,
        "approx_chars_per_token": APPROX_CHARS_PER_TOKEN,
        "decode_only": {"enabled": True},
    }


@dataclass(frozen=True)
class StackSpec:
    contender: str
    seed: int
    router_policy: str = "kv_aware"  # vllm_router only: kv_aware (with events) or cache_aware
    decodes: int = D_COUNT  # D instances (P_COUNT Ps)
    kv_set: tuple[tuple[str, Any], ...] = ()  # proxy.kv_aware overrides for approximate and precise


class Stack:
    """``with Stack(spec, tmp) as s:`` starts the fleet and the contender and waits until they answer."""

    def __init__(self, spec: StackSpec, tmp: Path) -> None:
        if spec.contender not in CONTENDERS:
            raise ValueError(f"unknown contender {spec.contender!r} (known: {', '.join(CONTENDERS)})")
        self.spec = spec
        self.tmp = tmp
        self.children = ChildGroup(grace_s=15.0)
        ports = iter(free_ports(4 + 2 * (P_COUNT + spec.decodes)))
        self.ports = {k: next(ports) for k in ("proxy", "admin", "router_metrics", "dead")}
        events = spec.contender in EVENTS
        self.inst: list[dict[str, Any]] = []
        for role, n in (("prefill", P_COUNT), ("decode", spec.decodes)):
            for i in range(n):
                entry: dict[str, Any] = {"name": f"{role[0]}{i}", "url": loopback_url(next(ports))}
                if events:
                    entry["kv_events_endpoint"] = f"tcp://127.0.0.1:{next(ports)}"
                self.inst.append({"role": role, **entry})
        self.cfg = self._config()
        self.config = write_config(tmp / "pdscope.yaml", self.cfg)
        self.proxy_url = f"http://127.0.0.1:{self.ports['proxy']}"
        self.admin_url = f"http://127.0.0.1:{self.ports['admin']}"

    def _config(self) -> dict[str, Any]:
        c = self.spec.contender
        model: dict[str, Any] = {"name": MODEL, "kv_bytes_per_token": KV_BYTES_PER_TOKEN}
        if c == "precise":
            model["tokenizer"] = "pdscope-sim"
        proxy: dict[str, Any] = {
            "port": self.ports["proxy"],
            "policy": "round-robin" if c == "round_robin" else "weighted",
            "controller_url": loopback_url(self.ports["dead"]),  # no controller: equal weights
            "tracing": False,
            "admission": {
                "max_inflight_requests": 10**6 if c == "round_robin" else 256,
                "queue_timeout_s": 1.0,
            },
            "timeouts": {"prefill_s": 30, "decode_first_token_s": 30, "decode_total_s": 60},
        }
        if c in ("approximate", "precise"):
            proxy["kv_aware"] = {**kv_aware(c), **dict(self.spec.kv_set)}
        elif c == "oracle":
            proxy["kv_aware"] = kv_aware("approximate")  # the view is replaced by the oracle's
        pools = {
            pool: {
                "role": pool,
                "instances": [
                    {k: v for k, v in e.items() if k != "role"} for e in self.inst if e["role"] == pool
                ],
            }
            for pool in ("prefill", "decode")
        }
        return {
            "model": model,
            "pools": pools,
            "slo": {"ttft": {"target_ms": SLO_TTFT_S * 1000}, "tpot": {"target_ms": SLO_TPOT_S * 1000}},
            "simulator": {**SIM, "seed": self.spec.seed, "admin_port": self.ports["admin"], "tracing": False},
            "proxy": proxy,
        }

    # -- what this checkout must have ------------------------------------------------------

    def check(self) -> None:
        """Raise :class:`Missing` when the contender needs a feature not in this checkout."""
        from pdscope.config import ConfigError, load_config

        try:
            load_config(self.config)
        except ConfigError as exc:
            first = (str(exc).splitlines() or [repr(exc)])[0].replace(str(self.config), "pdscope.yaml")
            raise Missing(f"{self.spec.contender}: the config is rejected ({first})") from exc
        if self.spec.contender == "oracle":
            from proxy.app import build

            if "cache_view" not in inspect.signature(build).parameters:
                raise Missing("oracle: proxy.app.build(..., cache_view=...) is not in this checkout")
        if self.spec.contender == "vllm_router" and vllm_router_binary() is None:
            raise Missing("vllm_router: no vllm-router binary (a dev dependency: make venv)")

    # -- life -------------------------------------------------------------------------------

    def _start(self, name: str, argv: list[str], ready_url: str, timeout_s: float = 60.0) -> None:
        self.children.start(
            Child(name, argv, self.tmp / f"{name}.log", ready_url=ready_url, cwd=REPO), timeout_s
        )

    def __enter__(self) -> Stack:
        self.check()
        try:
            self._start(
                "sim", pdscope_argv(self.config, "sim", log_level="WARNING"), self.admin_url + "/instances"
            )
            c = self.spec.contender
            if c == "vllm_router":
                self._start("proxy", self._router_argv(), self.proxy_url + "/health", timeout_s=30)
            elif c == "oracle":
                cmd = [sys.executable, "-m", "bench.prefix.oracle", str(self.config), self.admin_url]
                self._start("proxy", cmd, self.proxy_url + "/healthz")
            else:
                cmd = pdscope_argv(self.config, "proxy", log_level="WARNING")
                self._start("proxy", cmd, self.proxy_url + "/healthz")
        except BaseException:
            self.children.stop()
            raise
        return self

    def _router_argv(self) -> list[str]:
        """vLLM's router in front of the fleet (its own flags)."""
        cmd = [
            str(vllm_router_binary()),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.ports["proxy"]),
            "--vllm-pd-disaggregation",
            "--policy",
            self.spec.router_policy,
            "--prometheus-port",
            str(self.ports["router_metrics"]),
            "--worker-startup-check-interval",
            "1",
            "--log-level",
            "warning",
        ]
        for e in self.inst:
            cmd += ["--prefill", e["url"]] if e["role"] == "prefill" else ["--decode", e["url"]]
        if self.spec.router_policy == "kv_aware":
            for e in self.inst:
                if e["role"] == "prefill":
                    cmd += ["--pd-kv-events", f"{e['url']}={e['kv_events_endpoint']}"]
        return cmd

    def __exit__(self, *exc: object) -> None:
        self.children.stop()

    def log_tail(self, name: str, lines: int = 20) -> str:
        """The end of a service's log ("" for one that was never started)."""
        try:
            return self.children[name].tail(lines)
        except KeyError:
            return ""

    # -- what the fleet says --------------------------------------------------------------------

    def urls(self, role: str) -> list[str]:
        return [e["url"] for e in self.inst if e["role"] == role]

    def cached_tokens(self, token_ids: list[int]) -> dict[str, int]:
        got = http_json(self.admin_url + "/admin/cached_tokens", "POST", {"token_ids": token_ids})
        return {str(k): int(v) for k, v in dict(got["instances"]).items()}
