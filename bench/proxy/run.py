"""Proxy benchmark: direct to D, a toy-equivalent proxy, vLLM's Rust router and pdscope's proxy.

All in one run: the ratios are between contenders measured side by side.

Layout on a 2-core machine: each proxy is pinned to core 0 (``taskset -c 0``); the
zero-latency fleet (``bench/proxy/fleet.py``: P, D, OTLP sink, routing table) and the load
generator share core 1. pdscope's proxy runs as ``pdscope proxy`` with tracing on
(spans exported over OTLP/HTTP to the sink) and polling the fleet's routing table, twice:
``pdscope`` at ``trace_sample_ratio`` 1.0 (every span exported) and ``pdscope-sampled`` at
``--sample-ratio`` (default 0.05, a fleet-scale ratio: every request still gets its root
span, hence its record; child spans for the sampled share and failed, retried or slow requests).

Two measurements per contender and round, every loop bounded:
- **ceiling** (requests/s one core can carry): a closed loop at ``--concurrency`` for
  ``--duration`` s; the proxy's own CPU seconds are read from ``/proc/<pid>/stat`` before
  and after, and ``ceiling_rps = completed / proxy CPU seconds``. Measured on CPU time, not
  wall time, because the load generator and fleet share the other core and cannot drive a
  fast proxy to 100% of its core (``achieved_rps`` and ``proxy_cpu_util`` are reported too).
- **added latency**: ``--count`` requests one at a time (or an open Poisson loop with
  ``--rate``), the same against D directly; overhead = contender percentile - direct
  percentile (same round). One at a time by default because on a shared machine an open
  loop at any fixed rate can exceed a slow contender's share of its core, and then it
  measures a queue, not the proxy.

Rounds alternate the order of the contenders; the figures are medians over rounds.
Writes ``bench/results/proxy.json`` and prints a table.

Run: ``.venv/bin/python -m bench.proxy.run`` (about 6 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pin(core: int) -> list[str]:
    return ["taskset", "-c", str(core)] if os.cpu_count() and os.cpu_count() > 1 else []  # type: ignore[operator]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime, all threads


def _wait_http(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not come up in {timeout_s}s")


def loadgen(url: str, path: str, *, mode: str, core: int, timeout_s: float, **kw: Any) -> dict[str, Any]:
    cmd = [*_pin(core), PY, "-m", "bench.proxy.loadgen", "--url", url, "--path", path, "--mode", mode]
    for key, value in kw.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


class Contender:
    def __init__(self, name: str, url: str, proc: subprocess.Popen[bytes] | None) -> None:
        self.name, self.url, self.proc = name, url, proc


def closed_loop(
    c: Contender, path: str, a: argparse.Namespace, common: dict[str, Any]
) -> tuple[dict[str, Any], float]:
    """One closed-loop run against a started contender (``a.concurrency`` clients for ``a.duration``
    seconds, the load generator pinned to core 1): the load generator's result and the CPU seconds
    the contender's process spent meanwhile."""
    assert c.proc is not None
    cpu0 = cpu_seconds(c.proc.pid)
    res = loadgen(
        c.url,
        path,
        mode="closed",
        core=1,
        timeout_s=a.duration + 60,
        concurrency=a.concurrency,
        duration=a.duration,
        **common,
    )
    return res, cpu_seconds(c.proc.pid) - cpu0


def start_toy(fleet: dict[str, Any], log: Path) -> Contender:
    port = _free_port()
    cmd = [
        *_pin(0),
        PY,
        "-m",
        "bench.proxy.toy_proxy",
        "--port",
        str(port),
        "--prefill",
        *fleet["prefill"],
        "--decode",
        *fleet["decode"],
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + "/healthcheck")
    return Contender("toy", url, proc)


def start_pdscope(
    fleet: dict[str, Any],
    log: Path,
    tmp: Path,
    client: str = "lean",
    *,
    ratio: float = 1.0,
    name: str | None = None,
    wrap: list[str] | None = None,
    kv_aware: str = "off",
    tree: str | None = None,
) -> Contender:
    """``pdscope proxy`` with tracing on at ``proxy.trace_sample_ratio`` = ``ratio`` (every request's
    root span is exported whatever the ratio; children for the sampled share). ``wrap`` goes before
    the command (a profiler). ``tree``: run another checkout's code (its path first on PYTHONPATH)."""
    port = _free_port()
    name = name or ("pdscope" if client == "lean" else f"pdscope-{client}")
    config = {
        "model": {"name": "bench", "kv_bytes_per_token": 327680},
        "pools": {
            "prefill": {
                "role": "prefill",
                "instances": [{"name": f"prefill-{i}", "url": u} for i, u in enumerate(fleet["prefill"])],
            },
            "decode": {
                "role": "decode",
                "instances": [{"name": f"decode-{i}", "url": u} for i, u in enumerate(fleet["decode"])],
            },
        },
        "proxy": {
            "port": port,
            "controller_url": fleet["controller"],
            "tracing": True,
            "otlp_endpoint": fleet["otlp"] + "/v1/traces",
            "trace_sample_ratio": ratio,
            "kv_aware": {"mode": kv_aware},
        },
    }
    if kv_aware == "precise":  # the simulator's tokenizer; no instance publishes events, so every
        config["model"]["tokenizer"] = "pdscope-sim"  # request pays tokenize, key, match and choose
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    pdscope = str(Path(PY).with_name("pdscope"))
    cmd = [
        *_pin(0),
        *(wrap or []),
        pdscope,
        "--config",
        str(path),
        "--log-level",
        "WARNING",
        "proxy",
        "--upstream-client",
        client,
    ]
    env = None if tree is None else {**os.environ, "PYTHONPATH": tree}
    proc = subprocess.Popen(cmd, cwd=tree or REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + "/healthz")
    return Contender(name, url, proc)


SAMPLED = "pdscope-sampled"  # pdscope at the fleet-scale trace_sample_ratio (--sample-ratio)
BASE = "pdscope-base"  # pdscope-sampled's config run from --baseline-tree (another checkout's code)
VLLM_ROUTER = "vllm-router"  # PyPI vllm-router (vLLM's Rust router), a dev dependency: .venv/bin/vllm-router


def vllm_router_binary() -> str | None:
    here = Path(PY).with_name(VLLM_ROUTER)
    return str(here) if here.exists() else shutil.which(VLLM_ROUTER)


def start_vllm_router(fleet: dict[str, Any], log: Path, binary: str) -> Contender:
    """vLLM's own Rust P/D router in its NIXL P/D mode (``--vllm-pd-disaggregation``), round robin on both
    pools, no tracing (it has none to turn on), pinned to the proxies' core like the others."""
    port = _free_port()
    cmd = [*_pin(0), binary, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation"]
    for u in fleet["prefill"]:
        cmd += ["--prefill", u]
    for u in fleet["decode"]:
        cmd += ["--decode", u]
    cmd += ["--policy", "round_robin", "--log-level", "warning", "--health-check-interval-secs", "60"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + "/health")
    return Contender(VLLM_ROUTER, url, proc)


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return float("nan")


def _start_base(
    a: argparse.Namespace, fleet: dict[str, Any], tmp: Path, procs: list[subprocess.Popen[Any]]
) -> Contender:
    base = start_pdscope(
        fleet, tmp / "pdscope-base.log", tmp, ratio=max(a.sample_ratio, 0.0), name=BASE, tree=a.baseline_tree
    )
    procs.append(base.proc)  # type: ignore[arg-type]
    return base


def _start_contenders(
    a: argparse.Namespace, fleet: dict[str, Any], tmp: Path, procs: list[subprocess.Popen[Any]]
) -> list[Contender]:
    """Every contender the flags ask for, started (their processes appended to ``procs``)."""
    toy = start_toy(fleet, tmp / "toy.log")
    procs.append(toy.proc)  # type: ignore[arg-type]
    pds = start_pdscope(fleet, tmp / "pdscope.log", tmp)
    procs.append(pds.proc)  # type: ignore[arg-type]
    contenders = [toy, pds]
    sampled: Contender | None = None
    if 0.0 <= a.sample_ratio < 1.0:
        sampled = start_pdscope(fleet, tmp / "pdscope-sampled.log", tmp, ratio=a.sample_ratio, name=SAMPLED)
        procs.append(sampled.proc)  # type: ignore[arg-type]
        contenders.append(sampled)
    if a.baseline_tree:  # the same proxy from another checkout (before a change), beside pdscope-sampled
        contenders.append(_start_base(a, fleet, tmp, procs))
    for mode in a.kv_aware:  # KV-aware routing's per-request cost, beside pdscope-sampled (load-only)
        kv = start_pdscope(
            fleet,
            tmp / f"pdscope-{mode}.log",
            tmp,
            ratio=max(a.sample_ratio, 0.0),
            name=f"pdscope-{mode}",
            kv_aware=mode,
        )
        procs.append(kv.proc)  # type: ignore[arg-type]
        contenders.append(kv)
    if a.with_httpx:
        pdx = start_pdscope(fleet, tmp / "pdscope-httpx.log", tmp, client="httpx")
        procs.append(pdx.proc)  # type: ignore[arg-type]
        contenders.append(pdx)
    if a.with_vllm_router:
        binary = vllm_router_binary()
        if binary is None:
            print(
                f"!! {VLLM_ROUTER} not found (make venv installs it): that contender is SKIPPED",
                file=sys.stderr,
                flush=True,
            )
        else:
            vr = start_vllm_router(fleet, tmp / "vllm-router.log", binary)
            procs.append(vr.proc)  # type: ignore[arg-type]
            contenders.append(vr)
    return contenders


def _start_fleet(a: argparse.Namespace) -> subprocess.Popen[str]:
    """The zero-latency 2 P + 2 D fleet on core 1; it prints its addresses as one JSON line."""
    return subprocess.Popen(
        [
            *_pin(1),
            PY,
            "-m",
            "bench.proxy.fleet",
            "--prefill",
            "2",
            "--decode",
            "2",
            "--chunks",
            str(a.tokens),
        ],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _latency(a: argparse.Namespace, common: dict[str, Any], url: str, seed: int) -> dict[str, Any]:
    """One latency run against ``url``: an open Poisson loop at ``a.rate``, else one request at a time."""
    if a.rate > 0:  # open loop, Poisson arrivals
        return loadgen(
            url,
            a.path,
            mode="open",
            core=1,
            timeout_s=a.count / a.rate * 3 + 60,
            rate=a.rate,
            max_requests=a.count,
            duration=a.count / a.rate * 2,
            seed=seed,
            **common,
        )
    # one request at a time: what a request sees with no queue in front of it
    return loadgen(
        url,
        a.path,
        mode="closed",
        core=1,
        timeout_s=180,
        concurrency=1,
        max_requests=a.count,
        duration=120,
        **common,
    )


def _one_round(
    a: argparse.Namespace, r: int, fleet: dict[str, Any], contenders: list[Contender], common: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Round ``r``: direct to D, then every contender's ceiling and latency (order reversed on odd
    rounds, so no contender always runs first)."""
    res: dict[str, dict[str, Any]] = {}
    res["direct"] = {"latency": _latency(a, common, fleet["decode"][0], r)}
    for c in contenders if r % 2 == 0 else contenders[::-1]:
        closed, cpu = closed_loop(c, a.path, a, common)
        # httpx as pdscope's client is only there to price the client: ceiling only
        lat = _latency(a, common, c.url, r) if c.name != "pdscope-httpx" else None
        res[c.name] = {
            "ceiling_rps": closed["ok"] / cpu if cpu > 0 else None,
            "achieved_rps": closed["ok"] / closed["wall_s"],
            "proxy_cpu_util": cpu / closed["wall_s"],
            "errors": closed["errors"],
            "latency": lat,
        }
    print(
        f"round {r + 1}/{a.rounds}: "
        + ", ".join(f"{k} ceiling {v['ceiling_rps']:.0f} rps" for k, v in res.items() if "ceiling_rps" in v),
        file=sys.stderr,
        flush=True,
    )
    return res


def _spans(contenders: list[Contender]) -> dict[str, dict[str, float]]:
    """Each pdscope contender's span counters (exported, dropped, unsampled) from its /metrics."""
    return {
        c.name: {
            key: _metric(c.url, f"pdscope_proxy_spans_{key}_total")
            for key in ("exported", "dropped", "unsampled")
        }
        for c in contenders
        if c.name.startswith("pdscope")
    }


def _stop(procs: list[subprocess.Popen[Any]], fleet_proc: subprocess.Popen[str]) -> None:
    """Stop every process, newest first: the fleet by closing its stdin (it then prints the sink's
    counts), the others by SIGTERM, then SIGKILL after 10 s."""
    for p in reversed(procs):
        if p is fleet_proc:
            assert fleet_proc.stdin is not None
            fleet_proc.stdin.close()
        else:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


def _sink(fleet_proc: subprocess.Popen[str]) -> dict[str, Any]:
    """The OTLP sink's counts, the fleet's last line once stopped ({} if it printed none)."""
    if fleet_proc.stdout is None:
        return {}
    tail = fleet_proc.stdout.read().strip().splitlines()
    return dict(json.loads(tail[-1])) if tail else {}


def run(a: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="pdscope-bench-"))
    fleet_proc = _start_fleet(a)
    procs: list[subprocess.Popen[Any]] = [fleet_proc]
    try:
        assert fleet_proc.stdout is not None
        fleet = json.loads(fleet_proc.stdout.readline())
        contenders = _start_contenders(a, fleet, tmp, procs)
        common = {"tokens": a.tokens, "request_timeout": 10, "prompt_words": a.prompt_words}
        for c in contenders:  # warm-up: connections, caches, lazy imports
            loadgen(c.url, a.path, mode="closed", core=1, timeout_s=60, concurrency=8, duration=1.5, **common)
        rounds = [_one_round(a, r, fleet, contenders, common) for r in range(a.rounds)]
        spans = _spans(contenders)
    finally:
        _stop(procs, fleet_proc)
    tracing = {
        "spans_exported": spans["pdscope"]["exported"],
        "spans_dropped": spans["pdscope"]["dropped"],
        "by_contender": spans,
        **_sink(fleet_proc),
    }
    return summarize(a, rounds, tracing)


def _med(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _latency_summary(per: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """The median over rounds of each latency percentile (rounds without a latency run left out)."""
    have = [p["latency"] is not None for p in per]
    return {
        m: {
            q: _med([p["latency"][m][q] for p, h in zip(per, have, strict=True) if h]) for q in ("p50", "p99")
        }
        for m in ("e2e_ms", "ttft_ms")
    }


def _overheads(per: list[dict[str, Any]], rounds: list[dict[str, dict[str, Any]]]) -> dict[str, float | None]:
    """The median over rounds of each percentile minus direct-to-D's in the same round."""
    over: dict[str, float | None] = {}
    for m in ("e2e_ms", "ttft_ms"):
        for q in ("p50", "p99"):
            diffs = [
                p["latency"][m][q] - r["direct"]["latency"][m][q]
                for p, r in zip(per, rounds, strict=True)
                if p["latency"] is not None
                and p["latency"][m][q] is not None
                and r["direct"]["latency"][m][q] is not None
            ]
            over[f"{m[:-3]}_{q}_overhead_ms"] = _med(diffs)
    return over


def _contender(name: str, rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """One contender's figures over the rounds: medians, overheads, errors, and each round's raw row."""
    per = [r[name] for r in rounds]
    over = _overheads(per, rounds)
    return {
        "ceiling_rps": _med([p.get("ceiling_rps") for p in per]),
        "achieved_rps": _med([p.get("achieved_rps") for p in per]),
        "proxy_cpu_util": _med([p.get("proxy_cpu_util") for p in per]),
        "p50_overhead_ms": over["e2e_p50_overhead_ms"],
        "p99_overhead_ms": over["e2e_p99_overhead_ms"],
        **over,
        "latency_ms": _latency_summary(per),
        "errors": sum(p.get("errors", 0) + (p["latency"]["errors"] if p["latency"] else 0) for p in per),
        "rounds": [{k: v for k, v in p.items() if k != "latency"} for p in per],
    }


def _setup(a: argparse.Namespace, sampled: bool) -> dict[str, Any]:
    """The run's setup as the result states it."""
    return {
        "proxy_core": 0,
        "fleet_and_load_core": 1,
        "fleet": "bench/proxy/fleet.py, 2 P + 2 D, zero latency",
        "request": f"{a.path}, stream, {a.tokens} output chunks",
        "concurrency": a.concurrency,
        "duration_s": a.duration,
        "latency_runs": f"open loop at {a.rate} req/s" if a.rate > 0 else "one request at a time",
        "latency_requests": a.count,
        "rounds": a.rounds,
        "pdscope": "tracing on (OTLP/HTTP to a sink), routing table polled; trace_sample_ratio 1.0",
        SAMPLED: None
        if not sampled
        else f"the same at trace_sample_ratio {a.sample_ratio} (every request's root span and record, "
        "children for the sampled share and failed/retried/slow requests)",
    }


def _ratio(num: dict[str, Any] | None, den: dict[str, Any] | None) -> float | None:
    """``num``'s ceiling over ``den``'s (None when either is missing or has none)."""
    if num is None or den is None or not den["ceiling_rps"] or not num["ceiling_rps"]:
        return None
    ratio: float = num["ceiling_rps"] / den["ceiling_rps"]
    return ratio


def _ratios(out: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The ceiling ratios and the overhead gap between contenders, with their targets."""
    toy, pds, vr, smp = out["toy"], out["pdscope"], out.get(VLLM_ROUTER), out.get(SAMPLED)
    ratio = pds["ceiling_rps"] / toy["ceiling_rps"] if toy["ceiling_rps"] else None
    vs_vr = pds["ceiling_rps"] / vr["ceiling_rps"] if vr is not None and vr["ceiling_rps"] else None
    smp_vs_vr = _ratio(smp, vr)
    return {
        "ceiling_ratio_vs_toy": ratio,
        "p99_overhead_vs_toy_ms": (pds["p99_overhead_ms"] - toy["p99_overhead_ms"])
        if pds["p99_overhead_ms"] is not None and toy["p99_overhead_ms"] is not None
        else None,
        "ceiling_ratio_vs_vllm_router": vs_vr,
        "sampled_ceiling_ratio_vs_vllm_router": smp_vs_vr,
        # KV-aware routing's cost per request: its ceiling against load-only's at the same sample ratio
        "kv_aware_ceiling_ratio_vs_load_only": {
            name[len("pdscope-") :]: _ratio(c, smp)
            for name, c in out.items()
            if name in ("pdscope-precise", "pdscope-approximate")
        },
        "target_met": bool(ratio and ratio >= 1.5 and pds["p99_overhead_ms"] <= toy["p99_overhead_ms"]),
        "vllm_router_target_met": None if vs_vr is None else vs_vr >= 0.5,
        "sampled_vllm_router_target_met": None if smp_vs_vr is None else smp_vs_vr >= 0.5,
    }


def summarize(
    a: argparse.Namespace, rounds: list[dict[str, dict[str, Any]]], tracing: dict[str, Any]
) -> dict[str, Any]:
    out = {name: _contender(name, rounds) for name in rounds[0]}
    out["direct"]["ceiling_rps"] = None  # no proxy: nothing to pin
    out["direct"]["achieved_rps"] = out["direct"]["proxy_cpu_util"] = None
    ratios = _ratios(out)
    return {
        "benchmark": "proxy",
        "setup": _setup(a, SAMPLED in out),
        "contenders": out,
        "ceiling_ratio_vs_toy": ratios["ceiling_ratio_vs_toy"],
        "p99_overhead_vs_toy_ms": ratios["p99_overhead_vs_toy_ms"],
        "ceiling_ratio_vs_vllm_router": ratios["ceiling_ratio_vs_vllm_router"],
        "sampled_ceiling_ratio_vs_vllm_router": ratios["sampled_ceiling_ratio_vs_vllm_router"],
        "kv_aware_ceiling_ratio_vs_load_only": ratios["kv_aware_ceiling_ratio_vs_load_only"],
        "prompt_words": a.prompt_words,
        "target": {
            "ceiling_ratio_vs_toy": ">= 1.5",
            "p99_overhead": "<= toy's",
            "ceiling_ratio_vs_vllm_router": ">= 0.5 (tracing on; issue 16)",
        },
        "target_met": ratios["target_met"],
        "vllm_router_target_met": ratios["vllm_router_target_met"],
        "sampled_vllm_router_target_met": ratios["sampled_vllm_router_target_met"],
        "tracing": tracing,
        "machine": {"cpus": os.cpu_count(), "loadavg_at_end": Path("/proc/loadavg").read_text().split()[:3]},
    }


def table(result: dict[str, Any]) -> str:
    def f(v: float | None, d: int = 1) -> str:
        return "-" if v is None else f"{v:.{d}f}"

    rows = [
        "| contender | ceiling on 1 core (req/s) | vs toy | achieved (req/s) | proxy CPU "
        "| e2e p50 / p99 (ms) | added p50 / p99 (ms) | added TTFT p99 (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    toy = result["contenders"]["toy"]["ceiling_rps"]
    for name, c in result["contenders"].items():
        lat = c["latency_ms"]["e2e_ms"]
        vs = f(c["ceiling_rps"] / toy, 2) + "x" if c["ceiling_rps"] and toy else "-"
        rows.append(
            f"| {name} | {f(c['ceiling_rps'], 0)} | {vs} | {f(c['achieved_rps'], 0)} | "
            f"{f(c['proxy_cpu_util'] * 100 if c['proxy_cpu_util'] is not None else None, 0)}% | "
            f"{f(lat['p50'])} / {f(lat['p99'])} | {f(c['p50_overhead_ms'])} / {f(c['p99_overhead_ms'])} | "
            f"{f(c['ttft_p99_overhead_ms'])} |"
        )
    return "\n".join(rows)


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="latency runs: open-loop Poisson rate; 0 (default) sends one request at a time",
    )
    ap.add_argument("--count", type=int, default=600, help="requests per latency run")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--path", default="/v1/completions")
    ap.add_argument(
        "--with-httpx",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run pdscope's proxy with httpx as its upstream client",
    )
    ap.add_argument(
        "--with-vllm-router",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run vLLM's Rust P/D router (PyPI vllm-router) as a contender",
    )
    ap.add_argument(
        "--sample-ratio",
        type=float,
        default=0.05,
        help=f"also run pdscope at this trace_sample_ratio (the {SAMPLED!r} row; >= 1 or < 0: not run)",
    )
    ap.add_argument(
        "--kv-aware",
        action="append",
        default=[],
        choices=["approximate", "precise"],
        help="also run pdscope at --sample-ratio with proxy.kv_aware.mode MODE (the pdscope-MODE row; "
        "its ceiling against pdscope-sampled's is KV-aware routing's per-request CPU cost)",
    )
    ap.add_argument(
        "--baseline-tree",
        default=None,
        help="also run pdscope-sampled's config from this checkout (e.g. a git worktree of the commit "
        "before a change): the pdscope-base row; its ceiling against pdscope-sampled's is the change's cost",
    )
    ap.add_argument("--prompt-words", type=int, default=120, help="prompt length in words (~tokens)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "proxy.json"))
    return ap.parse_args()


def _verdict(result: dict[str, Any], out: Path) -> str:
    """The closing line: the ceiling ratios against their targets, the spans exported and dropped."""
    ratio = result["ceiling_ratio_vs_toy"]
    tracing = result["tracing"]
    return (
        f"\nceiling_ratio_vs_toy = {ratio if ratio is None else round(ratio, 2)}; "
        f"target met: {result['target_met']}; pdscope / vllm-router ceiling = "
        f"{_round(result['ceiling_ratio_vs_vllm_router'])} "
        f"(target >= 0.5: {result['vllm_router_target_met']}); at the sampled ratio "
        f"{_round(result['sampled_ceiling_ratio_vs_vllm_router'])} "
        f"(target met: {result['sampled_vllm_router_target_met']}); "
        f"spans exported {tracing.get('spans_exported')}, "
        f"dropped {tracing.get('spans_dropped')}; wrote {out}"
    )


def main() -> int:
    a = _parse()
    load_start = Path("/proc/loadavg").read_text().split()[:3]
    result = run(a)
    result["machine"]["loadavg_at_start"] = load_start
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(_verdict(result, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
