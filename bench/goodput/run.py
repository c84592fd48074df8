"""Goodput under faults: four contenders, three scenarios, one simulated 2P+4D fleet per run.

Contenders (each gets a fresh fleet, proxy and store per scenario):
- ``round_robin``  pdscope's proxy with ``policy: round-robin`` and no admission limit (the toy
                   proxy's behaviour), no controller;
- ``static``       pdscope's proxy, weighted policy, static equal weights, config admission defaults;
- ``controller``   pdscope's proxy following ``pdscope control`` (enforce, 1 s ticks, 10 s window)
                   over ``pdscope collect`` (1 s scrapes, spans from the proxy);
- ``oracle``       pdscope's proxy following a fixed table: weights and limits set by hand for the
                   fault from its first second.

Workload: one seeded open-loop Poisson schedule at 80% of the healthy fleet's capacity, measured
in the same run (the highest offered rate at which the static proxy kept SLO attainment >= 90%).
Scenarios, fault at ``--warm`` seconds: (a) ``degraded_decode_link``: decode-3's NIC 10x slower
(its leases expire); (b) ``burst``: 1.5x capacity for 30 s; (c) ``slow_prefill``: prefill-1 3x
slower. Figures come from the client over the measured phase: goodput (requests meeting TTFT and
TPOT SLOs per second), SLO attainment, p99 TTFT of served requests, rejections, and expired
leases from P's metrics; ``reaction_ticks`` is the controller's time from fault onset to its
first cut of the faulty instance's weight (for the burst: of a pool's request limit), in ticks. Ratios are against round robin and the
oracle measured in the same run. Writes ``bench/results/goodput.json`` and prints a table.

    .venv/bin/python -m bench.goodput.run [--measure 60] [--warm 10] [--scenarios a,b,c]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.goodput.oracle import StaticTable, oracle_table  # noqa: E402
from simulator.loadgen import Target, run_load  # noqa: E402
from simulator.workload import LengthDist, Planned, plan, summarize  # noqa: E402

PDSCOPE = str(Path(sys.executable).with_name("pdscope"))
N_P, N_D = 2, 4
SLO_TTFT_S, SLO_TPOT_S = 2.0, 0.1
PROMPT, OUTPUT = "fixed:2048", "fixed:32"
MODEL = "sim-llama-70b"
SIM = {"link_bandwidth_bytes_per_s": 2.5e9, "lease_duration_s": 3.0, "seed": 7}
INTERVAL_S = 1.0
CONTENDERS = ("round_robin", "static", "controller", "oracle")
SCENARIOS = {"a": "degraded_decode_link", "b": "burst", "c": "slow_prefill"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str, method: str = "GET", body: Any = None, timeout: float = 5.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def wait_http(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status < 500:
                    return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer in {timeout_s}s")


def metric_sum(url: str, name: str) -> float:
    total = 0.0
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
    return total


class Run:
    """One fleet + one contender's services, all subprocesses, stopped on exit."""

    def __init__(self, contender: str, tmp: Path, oracle_url: str | None, admission: int) -> None:
        self.contender = contender
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.ports = {k: free_port() for k in ("proxy", "collector", "controller", "admin")}
        self.inst = [(f"prefill-{i}", "prefill", "prefill", f"http://127.0.0.1:{free_port()}") for i in range(N_P)]
        self.inst += [(f"decode-{i}", "decode", "decode", f"http://127.0.0.1:{free_port()}") for i in range(N_D)]
        dead = f"http://127.0.0.1:{free_port()}"
        controller_url = {"controller": f"http://127.0.0.1:{self.ports['controller']}", "oracle": oracle_url}.get(
            contender) or dead
        cfg = {
            "model": {"name": MODEL, "kv_bytes_per_token": 327680},
            "pools": {pool: {"role": pool, "instances": [{"name": n, "url": u} for n, p, _, u in self.inst
                                                          if p == pool]} for pool in ("prefill", "decode")},
            "slo": {"ttft": {"target_ms": SLO_TTFT_S * 1000}, "tpot": {"target_ms": SLO_TPOT_S * 1000},
                    "window_s": 30},
            "store": {"url": f"sqlite:///{tmp / 'store.db'}"},
            "simulator": {**SIM, "admin_port": self.ports["admin"]},
            "collector": {"port": self.ports["collector"], "scrape_interval_s": INTERVAL_S,
                          "scrape_timeout_s": 0.8 * INTERVAL_S},
            "controller": {"port": self.ports["controller"], "interval_s": INTERVAL_S, "window_s": 10,
                           "mode": "enforce"},
            "proxy": {
                "port": self.ports["proxy"], "policy": "round-robin" if contender == "round_robin" else "weighted",
                "controller_url": controller_url, "routing_poll_s": 0.5, "tracing": contender == "controller",
                "otlp_endpoint": f"http://127.0.0.1:{self.ports['collector']}/v1/traces",
                "admission": {"max_inflight_requests": admission, "queue_timeout_s": 1.0},
                "timeouts": {"prefill_s": 30, "decode_first_token_s": 30, "decode_total_s": 60},
            },
        }
        self.config = tmp / "pdscope.yaml"
        self.config.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.proxy_url = f"http://127.0.0.1:{self.ports['proxy']}"
        self.admin_url = f"http://127.0.0.1:{self.ports['admin']}"
        self.controller_url = f"http://127.0.0.1:{self.ports['controller']}"

    def _start(self, name: str, *args: str) -> None:
        log = (self.tmp / f"{name}.log").open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.procs.append(subprocess.Popen([PDSCOPE, "--config", str(self.config), "--log-level", "WARNING",
                                            *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env))

    def __enter__(self) -> Run:
        from store.migrate import upgrade

        upgrade(f"sqlite:///{self.tmp / 'store.db'}")  # once, before the services that share the store
        self._start("sim", "sim")
        wait_http(self.admin_url + "/instances")
        if self.contender == "controller":
            self._start("collect", "collect")
            self._start("control", "control")
            wait_http(self.controller_url + "/healthz")
        self._start("proxy", "proxy")
        wait_http(self.proxy_url + "/healthz")
        return self

    def __exit__(self, *exc: object) -> None:
        for p in reversed(self.procs):
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)

    def inject(self, fault: dict[str, Any]) -> None:
        http_json(self.admin_url + "/faults", "POST", fault)

    def expired_leases(self) -> float:
        return sum(metric_sum(u, "vllm:nixl_num_kv_expired_reqs_total") for n, _, r, u in self.inst if r == "prefill")


def workload(scenario: str, capacity: float, duration: float, warm: float, seed: int) -> list[Planned]:
    p, o = LengthDist.parse(PROMPT), LengthDist.parse(OUTPUT)
    base = plan("poisson", 0.8 * capacity, 10**6, duration, p, o, seed)
    if scenario != "burst":
        return base
    extra = plan("poisson", 0.7 * capacity, 10**6, 30.0, p, o, seed + 1)  # 0.8 + 0.7 = 1.5x for 30 s
    return sorted(base + [Planned(x.at + warm, x.prompt_tokens, x.output_tokens) for x in extra], key=lambda x: x.at)


def fault_for(scenario: str) -> dict[str, Any] | None:
    return {"degraded_decode_link": {"kind": "slow_nic", "decode": "decode-3", "factor": 10},
            "slow_prefill": {"kind": "slow", "instance": "prefill-1", "factor": 3}}.get(scenario)


REACTION = {"degraded_decode_link": ("weight", "decode-3"), "slow_prefill": ("weight", "prefill-1")}


ORACLE_WAIT_S = 0.5  # hand-set: the TTFT target (2 s) minus the healthy fleet's p99 TTFT at capacity (~1.5 s)


def oracle_for(scenario: str, capacity: float) -> tuple[dict[str, float], dict[str, int | None]]:
    """Hand-set for the fault: no work to the broken D; P weights by speed; P in-flight = 1 s of capacity
    (and where a pool has a limit, a request waits at most ``ORACLE_WAIT_S`` for a slot)."""
    if scenario == "degraded_decode_link":
        return {"decode-3": 0.0}, {"prefill": None, "decode": None}
    if scenario == "slow_prefill":
        return {"prefill-1": 1 / 3}, {"prefill": max(2, round(capacity * (1 + 1 / 3) / 2 * 1.0)), "decode": None}
    return {}, {"prefill": max(2, round(capacity * 1.0)), "decode": None}


def measure(results: list[Any], warm: float, measured_s: float) -> dict[str, Any]:
    phase = [r for r in results if r.scheduled_s >= warm]
    s = summarize(phase, measured_s, SLO_TTFT_S, SLO_TPOT_S)
    rejected = sum(1 for r in phase if r.status in (429, 503))
    return {"requests": s["requests"], "completed": s["completed"], "goodput_rps": s["goodput_rps"],
            "slo_attainment": s["slo_attainment"], "ttft_p99_s": s["ttft_s"]["p99"], "rejections": rejected,
            "failed_other": s["failed"] - rejected, "errors": s["errors"]}


async def one_run(contender: str, scenario: str, capacity: float, a: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix=f"goodput-{scenario}-{contender}-"))
    duration = a.warm + a.measure
    planned = workload(scenario, capacity, duration, a.warm, a.seed)
    fault = fault_for(scenario)
    admission = 10**6 if contender == "round_robin" else 256
    static = StaticTable() if contender == "oracle" else None
    run = Run(contender, tmp, None if static is None else static.url, admission)
    if static is not None:
        weights, limits = oracle_for(scenario, capacity)
        static.set(oracle_table(run.inst, weights, limits, ORACLE_WAIT_S))
        static.__enter__()
    onset: list[float] = []
    try:
        with run:
            expired0 = 0.0
            loop = asyncio.get_running_loop()

            def inject() -> None:
                nonlocal expired0
                expired0 = run.expired_leases()
                onset.append(time.time())
                if fault is not None:
                    run.inject(fault)

            loop.call_later(a.warm, inject)
            results, _ = await run_load(Target(url=run.proxy_url, model=MODEL), planned, timeout_s=30.0,
                                        max_inflight=2048, seed=a.seed)
            out = measure(results, a.warm, a.measure)
            out["expired_leases"] = run.expired_leases() - expired0
            if contender == "controller" and onset:
                # The first change that answers the fault: the faulty instance's weight going down, or for
                # the burst a pool's request limit being cut (a limit still growing back is not a reaction).
                field, subject = REACTION.get(scenario, ("max_inflight_requests", None))
                query = f"field={field}&since={onset[0]}&limit=1000" + (f"&subject={subject}" if subject else "")
                decisions = http_json(f"{run.controller_url}/v1/decisions?{query}")
                first = min((d["ts"] for d in decisions if d["old_value"] is not None and d["new_value"] is not None
                             and d["new_value"] < d["old_value"]), default=None)
                out["reaction_s"] = None if first is None else first - onset[0]
                out["reaction_ticks"] = None if first is None else math.ceil((first - onset[0]) / INTERVAL_S)
    finally:
        if static is not None:
            static.__exit__()
    print(f"  {scenario:22s} {contender:12s} goodput {out['goodput_rps']:6.2f}/s  attainment "
          f"{out['slo_attainment'] * 100:5.1f}%  p99 TTFT {fmt_s(out['ttft_p99_s'])}  rejected {out['rejections']:4d}"
          f"  expired {out['expired_leases']:.0f}" + (f"  reaction {out.get('reaction_ticks')} ticks"
                                                       if contender == "controller" else ""), file=sys.stderr,
          flush=True)
    return out


def fmt_s(v: float | None) -> str:
    return "    -" if v is None else f"{v:5.2f}s"


async def capacity(a: argparse.Namespace) -> tuple[float, list[dict[str, Any]]]:
    """Highest offered rate at which the static proxy keeps >= 90% SLO attainment on a healthy fleet."""
    steps = []
    best = 0.0
    for rate in a.rates:
        tmp = Path(tempfile.mkdtemp(prefix=f"goodput-capacity-{rate}-"))
        p, o = LengthDist.parse(PROMPT), LengthDist.parse(OUTPUT)
        planned = plan("poisson", rate, 10**6, a.capacity_s, p, o, a.seed)
        with Run("static", tmp, None, 256) as run:
            results, _ = await run_load(Target(url=run.proxy_url, model=MODEL), planned, timeout_s=30.0,
                                           max_inflight=2048, seed=a.seed)
        s = summarize(results, a.capacity_s, SLO_TTFT_S, SLO_TPOT_S)
        ok = s["slo_attainment"] >= 0.9 and s["completed"] >= 0.9 * len(planned)
        steps.append({"offered_rps": rate, "goodput_rps": s["goodput_rps"], "slo_attainment": s["slo_attainment"],
                      "ttft_p99_s": s["ttft_s"]["p99"], "sustained": ok})
        print(f"  capacity step {rate:5.1f} req/s: attainment {s['slo_attainment'] * 100:5.1f}%  p99 TTFT "
              f"{fmt_s(s['ttft_s']['p99'])}  {'ok' if ok else 'over'}", file=sys.stderr, flush=True)
        if not ok:
            break
        best = rate
    return best, steps


async def main(a: argparse.Namespace) -> dict[str, Any]:
    cap, steps = (a.capacity, []) if a.capacity else await capacity(a)
    if cap <= 0:
        raise SystemExit("the healthy fleet sustained none of the capacity steps")
    print(f"capacity {cap} req/s; workload at {0.8 * cap:.1f} req/s", file=sys.stderr)
    out: dict[str, Any] = {
        "fleet": f"{N_P}P+{N_D}D simulated", "simulator": SIM, "prompt": PROMPT, "output": OUTPUT,
        "slo": {"ttft_s": SLO_TTFT_S, "tpot_s": SLO_TPOT_S}, "capacity_rps": cap, "capacity_steps": steps,
        "offered_rps": 0.8 * cap, "warm_s": a.warm, "measured_s": a.measure, "seed": a.seed,
        "controller_interval_s": INTERVAL_S, "scenarios": {},
    }
    for key in a.scenarios:
        scenario = SCENARIOS[key]
        res = {c: await one_run(c, scenario, cap, a) for c in a.contenders}
        rr = res["round_robin"]["goodput_rps"] if "round_robin" in res else None
        orc = res["oracle"]["goodput_rps"] if "oracle" in res else None
        for r in res.values():
            r["goodput_ratio_vs_round_robin"] = r["goodput_rps"] / rr if rr else None
            r["goodput_ratio_vs_oracle"] = r["goodput_rps"] / orc if orc else None
        out["scenarios"][scenario] = {"contenders": res,
                                      "reaction_ticks": res.get("controller", {}).get("reaction_ticks")}
    return out


def table(out: dict[str, Any]) -> str:
    lines = [f"capacity {out['capacity_rps']} req/s, offered {out['offered_rps']:.1f} req/s; SLO TTFT "
             f"{out['slo']['ttft_s']} s, TPOT {out['slo']['tpot_s']} s",
             f"{'scenario':22s} {'contender':12s} {'goodput/s':>9s} {'vs RR':>6s} {'vs oracle':>9s} {'SLO %':>6s} "
             f"{'p99 TTFT':>9s} {'rejected':>8s} {'expired':>7s}"]
    for scenario, s in out["scenarios"].items():
        for c, r in s["contenders"].items():
            ratio_rr = r["goodput_ratio_vs_round_robin"]
            ratio_or = r["goodput_ratio_vs_oracle"]
            lines.append(f"{scenario:22s} {c:12s} {r['goodput_rps']:9.2f} "
                         f"{'-' if ratio_rr is None else f'{ratio_rr:.2f}':>6s} "
                         f"{'-' if ratio_or is None else f'{ratio_or:.2f}':>9s} {r['slo_attainment'] * 100:6.1f} "
                         f"{fmt_s(r['ttft_p99_s']):>9s} {r['rejections']:8d} {r['expired_leases']:7.0f}")
        lines.append(f"{scenario:22s} controller reaction: {s['reaction_ticks']} ticks")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measure", type=float, default=60.0, help="measured seconds after the fault")
    ap.add_argument("--warm", type=float, default=10.0, help="seconds before the fault")
    ap.add_argument("--capacity-s", type=float, default=15.0, help="seconds per capacity step")
    ap.add_argument("--rates", default="8,10,12,14,16", help="capacity steps, req/s")
    ap.add_argument("--scenarios", default="a,b,c")
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help="a subset, for tuning runs")
    ap.add_argument("--capacity", type=float, default=0.0,
                    help="skip the capacity steps and use this rate (req/s); for tuning runs only")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "goodput.json"))
    a = ap.parse_args(argv)
    a.rates = [float(x) for x in a.rates.split(",")]
    a.scenarios = [x.strip() for x in a.scenarios.split(",") if x.strip()]
    a.contenders = [x.strip() for x in a.contenders.split(",") if x.strip() in CONTENDERS]
    return a


if __name__ == "__main__":
    args = parse()
    result = asyncio.run(main(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
