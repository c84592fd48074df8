"""Prefix-aware routing on a simulated 4P+4D fleet: six contenders, four seeded workloads, one run.

    .venv/bin/python -m bench.prefix                          # everything (~11 min on 2 cores)
    .venv/bin/python -m bench.prefix --workloads system_prompts --contenders load_only,precise,oracle
    .venv/bin/python -m bench.prefix --quick                  # the smoke: one workload, short, low load
    .venv/bin/python -m bench.prefix --sweep --workloads live_chat --decodes 8   # the load sweep (sweep.py)

Contenders (each gets a fresh fleet -- caches empty -- per workload, ``stack.py``):
- ``round_robin``  pdscope's proxy, ``policy: round-robin``, no admission limit (the toy proxy);
- ``load_only``    pdscope's proxy as it was before KV awareness (weighted, ``kv_aware`` off);
- ``approximate``  ``proxy.kv_aware.mode: approximate`` (a tree of the prompts it routed);
- ``precise``      ``mode: precise``, ``model.tokenizer: pdscope-sim``, the fleet publishing KV events;
- ``vllm_router``  PyPI ``vllm-router --vllm-pd-disaggregation``: ``--policy kv_aware`` fed by the same
                   events (``--pd-kv-events``) when it can use them, else ``--policy cache_aware`` (its
                   approximate prefix tree over the prompt text), the reason in the results: one probe
                   request first, and kv_aware is kept only if the router keyed it (its
                   ``vllm_router_kv_routing_inputs_total`` counts ``result="render"``: the simulator's
                   ``/v1/*/render`` answered with the token ids it caches, and no ``*_unavailable``);
                   the results keep its KV counters (placement hits, credited prefix tokens) and the
                   count of KV event batches its log says it could not decode;
- ``oracle``       pdscope's KV-aware proxy whose view is the simulator's true cache (``oracle.py``).

Workloads (``workloads.py``): shared system prompts (Zipf), multi-turn chats, unique prompts (the
control), the hot prefix (one system prompt carrying half the traffic), and live chats (each turn
carries the answer the fleet returned, closed loop per conversation: ``client.run_conversations``).
``--decodes`` sets the fleet's D count (4P+nD), ``--kv-set KEY=VALUE`` a ``proxy.kv_aware`` setting
of the approximate and precise contenders (e.g. the defaults an operator left), ``--sweep`` runs the
declared load sweep instead (``sweep.py``). Load, in multiples of
the fleet's prefill capacity with nothing cached (P count x prefill tokens/s / mean prompt tokens):
for each shared workload, calibrated in the same run (``calibrate``: the load at which load_only's
P pool is 95 % busy given the reuse it gets by chance, i.e. the load it can almost sustain), or
``--load``; the control at ``--load-unique`` (0.8: below the limit, where routing should cost
nothing). Each run: ``--warm`` seconds
(caches fill), then ``--measure`` seconds measured: goodput (requests/s meeting TTFT and TPOT
SLOs, ``stack.py``), TTFT p50/p99 from the client, the P prefix hit rate from the simulated P's
own counters, decode-only share from the proxy's routes metric, and P queue waits over the TTFT
budget. Ratios against load_only and the oracle measured in the same run; PASS/MISS against the
issue's targets (``report.py``). Writes ``bench/results/prefix.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.goodput.stack import http_json  # noqa: E402
from bench.prefix import report  # noqa: E402
from bench.prefix.client import run_conversations, run_open_loop  # noqa: E402
from bench.prefix.measure import figures, phase, snapshot  # noqa: E402
from bench.prefix.stack import (  # noqa: E402
    CONTENDERS,
    D_COUNT,
    MODEL,
    OUTPUT_TOKENS,
    P_COUNT,
    PREFILL_TOKENS_PER_S,
    SLO_TPOT_S,
    SLO_TTFT_S,
    Missing,
    Stack,
    StackSpec,
)
from bench.prefix.workloads import WORKLOADS, Conversation, Plan, mean_prompt_tokens, request_tokens  # noqa: E402
from simulator.workload import RequestResult  # noqa: E402

OUT = REPO / "bench" / "results" / "prefix.json"
SWEEP_OUT = REPO / "bench" / "results" / "prefix-sweep.json"
SWEEP_LOADS = (0.85, 1.0, 1.3, 1.6)  # x load_only's capacity: declared before any run (issue 33)
HOT_CONTENDERS = ("load_only", "approximate", "precise", "oracle")
CALIBRATED_BUSY = 0.95  # load_only's P pool this busy, at the reuse it gets
MAX_CALIBRATED_REUSE = 0.8  # the load stays within 4.75 x the no-cache capacity (2 CPU cores)
CLIENT_TIMEOUT_S = 30.0


def capacity_rps(workload: str, seed: int) -> float:
    """Requests/s the P pool prefills with nothing cached, for this workload's mean prompt."""
    sample = WORKLOADS[workload](2.0, 120.0, seed)
    return P_COUNT * PREFILL_TOKENS_PER_S / mean_prompt_tokens(sample)


def plan_for(workload: str, load: float, duration_s: float, seed: int) -> tuple[Plan, float]:
    rate = load * capacity_rps(workload, seed)
    return WORKLOADS[workload](rate, duration_s, seed), rate


class RouterChoice:
    """vllm-router's policy: kv_aware with the fleet's events if it starts and serves, else cache_aware."""

    def __init__(self) -> None:
        self.policy: str | None = None
        self.why = ""

    def probe(self, stack: Stack, planned: Plan) -> bool:
        """With kv_aware up: one request from the workload must come back 200."""
        p = planned[0]
        try:
            body = {**p.body, "model": MODEL, "max_tokens": 2, "stream": False}
            http_json(stack.proxy_url + p.endpoint, "POST", body, timeout=15)
        except (OSError, ValueError) as exc:
            self.why = f"kv_aware answered {type(exc).__name__}: {exc}"
            return False
        got = router_kv_metrics(stack)
        unavailable = {k: v for k, v in got.items() if "unavailable" in k and v}
        rendered = sum(v for k, v in got.items() if k.startswith(ROUTER_INPUTS) and "result=render," in k)
        if unavailable or not rendered:
            self.why = (
                "kv_aware could not key the prompt (it asks the worker's /v1/completions/render and "
                f"/v1/chat/completions/render for token ids): {unavailable or got}; ran cache_aware instead"
            )
            return False
        return True


ROUTER_INPUTS = "vllm_router_kv_routing_inputs_total"
ROUTER_METRIC_PREFIXES = (
    "vllm_router_kv",
    "vllm_router_cache",
    "vllm_router_policy",
    "vllm_router_prefix",
    "vllm_router_pd_credited",
)
EVENT_DECODE_WARNING = "kv_index decode batch"  # vllm-router's log line for a KV event it cannot read


def router_event_warnings(stack: Stack) -> int:
    """Lines in vllm-router's log saying it could not decode a KV event batch (0: it read them all)."""
    try:
        text = (stack.tmp / "proxy.log").read_text(errors="replace")
    except OSError:
        return -1
    return sum(EVENT_DECODE_WARNING in line for line in text.splitlines())


def router_kv_metrics(stack: Stack) -> dict[str, float]:
    """vllm-router's own counters of its KV-aware work (did it use the events?), by name and labels."""
    from bench.prefix.measure import scrape

    out: dict[str, float] = {}
    try:
        samples = scrape(f"http://127.0.0.1:{stack.ports['router_metrics']}")
    except OSError as exc:
        return {f"unavailable: {exc}": 0.0}
    for name, rows in samples.items():
        if name.startswith(ROUTER_METRIC_PREFIXES):
            for labels, v in rows:
                key = name + "{" + ",".join(f"{k}={x}" for k, x in sorted(labels.items())) + "}"
                out[key] = out.get(key, 0.0) + v
    return out


def run_one(
    workload: str,
    contender: str,
    planned: Plan,
    warm_s: float,
    measure_s: float,
    seed: int,
    router: RouterChoice,
    fleet: Fleet | None = None,
) -> dict[str, Any]:
    """One contender on one workload; a lost port race (a free port taken before the fleet bound it)
    is tried once more on fresh ports."""
    cell = _Cell(workload, contender, planned, warm_s, measure_s, fleet or Fleet())
    out = _run_one(cell, seed, router)
    logs = out.get("logs")
    if logs and "Address already in use" in "".join(
        p.read_text(errors="replace") for p in Path(logs).glob("*.log")
    ):
        out = _run_one(cell, seed, router)
        out["retried"] = "a port race on the first try"
    return out


@dataclass(frozen=True)
class Fleet:
    """The fleet's shape and the KV-aware settings' overrides (``--decodes``, ``--kv-set``)."""

    decodes: int = D_COUNT
    kv_set: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class _Cell:
    """One contender's run of one workload: what its helpers share."""

    workload: str
    contender: str
    planned: Plan
    warm_s: float
    measure_s: float
    fleet: Fleet = Fleet()


def _start(stack: Stack, contender: str, policy: str, router: RouterChoice) -> bool:
    """Start the stack; False when vllm-router's kv_aware did not start (cache_aware is chosen then)."""
    try:
        stack.__enter__()
    except (RuntimeError, TimeoutError) as exc:
        if contender != "vllm_router" or policy != "kv_aware" or isinstance(exc, Missing):
            raise
        router.policy, router.why = (
            "cache_aware",
            f"kv_aware did not start: {exc}; {stack.log_tail('proxy', 5)}",
        )
        return False
    return True


def _keep_policy(stack: Stack, cell: _Cell, router: RouterChoice) -> bool:
    """vllm-router's first run settles its policy by a probe; False: kv_aware failed it (now cache_aware)."""
    if cell.contender == "vllm_router" and router.policy is None:
        if not router.probe(stack, cell.planned):
            router.policy = "cache_aware"
            return False
        router.policy = "kv_aware"
    return True


def _drive(stack: Stack, cell: _Cell) -> tuple[list[RequestResult], dict[str, Any]]:
    """The workload against the stack, with snapshots at the measured phase's start and end."""
    prefills = {e["name"]: e["url"] for e in stack.inst if e["role"] == "prefill"}
    decodes = {e["name"]: e["url"] for e in stack.inst if e["role"] == "decode"}
    proxy_metrics = None if cell.contender == "vllm_router" else stack.proxy_url
    snaps: dict[str, Any] = {}

    def take(key: str) -> None:
        snaps[key] = snapshot(prefills, proxy_metrics, decodes)
        if key == "start":
            http_json(stack.admin_url + "/stats/reset", "POST", {})

    warm_s, measure_s = cell.warm_s, cell.measure_s
    hooks = [(warm_s, lambda: take("start")), (warm_s + measure_s, lambda: take("end"))]
    tag = f"{cell.workload}-{cell.contender}"
    plan = cell.planned
    if plan and isinstance(plan[0], Conversation):
        convs = [c for c in plan if isinstance(c, Conversation)]
        run = run_conversations(
            stack.proxy_url,
            convs,
            model=MODEL,
            duration_s=warm_s + measure_s,
            timeout_s=CLIENT_TIMEOUT_S,
            hooks=hooks,
            tag=tag,
        )
    else:
        run = run_open_loop(
            stack.proxy_url,
            [p for p in plan if not isinstance(p, Conversation)],
            model=MODEL,
            max_tokens=OUTPUT_TOKENS,
            timeout_s=CLIENT_TIMEOUT_S,
            hooks=hooks,
            tag=tag,
        )
    return asyncio.run(run), snaps


def _measure(out: dict[str, Any], stack: Stack, cell: _Cell, router: RouterChoice) -> None:
    """Run the cell on the started stack; its figures into ``out``."""
    warm_s, measure_s = cell.warm_s, cell.measure_s
    if cell.contender == "vllm_router":
        out["router_policy"] = router.policy
        out["router_note"] = router.why
    results, snaps = _drive(stack, cell)
    out.update(figures(results, warm_s, measure_s, SLO_TTFT_S, SLO_TPOT_S))
    if "start" in snaps and "end" in snaps:
        # the requests whose first token came in the phase: vLLM counts prompt sources then
        tokens = sum(
            r.prompt_tokens
            for r in results
            if r.ttft_s is not None and warm_s <= r.sent_s + r.ttft_s < warm_s + measure_s
        )
        out.update(phase(snaps["start"], snaps["end"], SLO_TTFT_S, tokens))
    if cell.contender == "vllm_router":
        out["router_kv_metrics"] = router_kv_metrics(stack)
        out["router_event_decode_warnings"] = router_event_warnings(stack)
    lag = http_json(stack.admin_url + "/stats", timeout=5)
    out["sim_loop_lag_p99_s"] = lag.get("loop_lag_p99_s")
    out["sim_trustworthy"] = lag.get("trustworthy")


def _run_one(cell: _Cell, seed: int, router: RouterChoice) -> dict[str, Any]:
    contender = cell.contender
    tmp = Path(tempfile.mkdtemp(prefix=f"prefix-{cell.workload}-{contender}-"))
    out: dict[str, Any] = {}
    policy = router.policy or "kv_aware"
    t0 = time.monotonic()
    ok = False
    try:
        spec = StackSpec(contender, seed, policy, cell.fleet.decodes, cell.fleet.kv_set)
        stack = Stack(spec, tmp)
        if not _start(stack, contender, policy, router):
            return _run_one(cell, seed, router)
        try:
            if not _keep_policy(stack, cell, router):
                stack.__exit__()
                return _run_one(cell, seed, router)
            _measure(out, stack, cell, router)
            ok = True
        finally:
            stack.__exit__()
    except Missing as exc:
        out = {"missing": str(exc)}
        ok = True
    except Exception as exc:  # one contender's failure is its own row, not the run's end
        out = {"error": f"{type(exc).__name__}: {exc}", "logs": str(tmp)}
    out["wall_s"] = round(time.monotonic() - t0, 1)
    if ok:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def calibrate(
    workload: str, args: argparse.Namespace, router: RouterChoice, t0: float
) -> tuple[float, dict[str, Any]]:
    """The shared workloads' load: load_only's P pool 95 % busy at the reuse load_only gets.

    One load_only run at ``--calibration-load`` measures its reuse ``r``; a P then prefills
    ``1 - r`` of each prompt, so load_only's P capacity is the no-cache capacity / (1 - r), and the
    offered load is :data:`CALIBRATED_BUSY` of that: the load load_only can almost sustain."""
    planned, rate = plan_for(workload, args.calibration_load, args.warm + args.measure, args.seed)
    r = run_one(workload, "load_only", planned, args.warm, args.measure, args.seed, router, args.fleet)
    reuse = r.get("reuse")
    if reuse is None:
        raise SystemExit(f"calibration of {workload} failed: {report.progress_line('load_only', r)}")
    reuse = min(float(reuse), MAX_CALIBRATED_REUSE)
    load = CALIBRATED_BUSY / (1.0 - reuse)
    print(
        f"== {workload}: calibration: load_only at {rate:.2f}/s reused {reuse:.2f} -> load {load:.2f} "
        f"[{time.monotonic() - t0:5.0f}s]",
        flush=True,
    )
    return load, {"load": args.calibration_load, "rate_rps": round(rate, 2), "reuse": reuse, "run": r}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.prefix", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--workloads", default=None, help="comma-separated (default: all; with --quick: system_prompts)"
    )
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated (default: all)")
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--warm", type=float, default=8.0, help="seconds before the measured phase")
    ap.add_argument("--measure", type=float, default=14.0, help="seconds measured")
    ap.add_argument(
        "--load",
        type=float,
        default=None,
        help="shared workloads: x no-cache P capacity (default: calibrated, see calibrate())",
    )
    ap.add_argument("--calibration-load", type=float, default=1.25, help="load of the calibration run")
    ap.add_argument("--load-unique", type=float, default=0.8, help="the control: x no-cache P capacity")
    ap.add_argument(
        "--quick", action="store_true", help="smoke: 2 s warm, 4 s measured, half the load, one workload"
    )
    ap.add_argument("--out", type=Path, default=None, help=f"default {OUT} ({SWEEP_OUT} with --sweep)")
    ap.add_argument("--decodes", type=int, default=D_COUNT, help=f"D instances (default {D_COUNT})")
    ap.add_argument(
        "--kv-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a proxy.kv_aware setting for approximate and precise (VALUE as JSON, else a string)",
    )
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="the declared load sweep: every shared workload at "
        + ", ".join(f"{x}" for x in SWEEP_LOADS)
        + " x load_only's capacity (see bench/prefix/sweep.py)",
    )
    ap.add_argument(
        "--max-wall", type=float, default=None, help="--sweep: seconds; cells past it are not run"
    )
    return ap


def _kv_set(items: list[str]) -> tuple[tuple[str, Any], ...]:
    out = []
    for item in items:
        key, _, raw = item.partition("=")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        out.append((key, value))
    return tuple(out)


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str], list[str]]:
    """The arguments (``--quick`` applied), the workloads and the contenders; exits on an unknown name."""
    ap = _parser()
    args = ap.parse_args(argv)
    args.fleet = Fleet(args.decodes, _kv_set(args.kv_set))
    if args.out is None:
        args.out = SWEEP_OUT if args.sweep else OUT
    if args.sweep and args.workloads is None:
        args.workloads = ",".join(w for w in WORKLOADS if w != "unique")
    if args.quick:
        args.warm, args.measure, args.load_unique = 2.0, 4.0, 0.4
        args.load = 0.5 if args.load is None else args.load
    if args.workloads is None:
        args.workloads = "system_prompts" if args.quick else ",".join(WORKLOADS)
    workloads = [w for w in args.workloads.split(",") if w]
    contenders = [c for c in args.contenders.split(",") if c]
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r} (known: {', '.join(WORKLOADS)})")
    for c in contenders:
        if c not in CONTENDERS:
            ap.error(f"unknown contender {c!r} (known: {', '.join(CONTENDERS)})")
    return args, workloads, contenders


def _plan_workload(
    w: str, args: argparse.Namespace, router: RouterChoice, t0: float
) -> tuple[Plan, dict[str, Any]]:
    """Workload ``w``'s load (calibrated if need be), its plan and its entry in the results."""
    cal: dict[str, Any] | None = None
    if w == "unique":
        load = args.load_unique
    elif args.load is not None:
        load = args.load
    else:
        load, cal = calibrate(w, args, router, t0)
    planned, rate = plan_for(w, load, args.warm + args.measure, args.seed)
    meta: dict[str, Any] = {
        "rate_rps": round(rate, 2),
        "load": round(load, 3),
        "requests": len(request_tokens(planned)),
        "mean_prompt_tokens": round(mean_prompt_tokens(planned), 1),
    }
    if cal is not None:
        meta["calibration"] = cal
    print(
        f"== {w}: {meta['requests']} requests at {rate:.2f}/s ({load:.2f} x no-cache P capacity), "
        f"mean prompt {meta['mean_prompt_tokens']:.0f} tokens",
        flush=True,
    )
    return planned, meta


def main(argv: list[str] | None = None) -> int:
    args, workloads, contenders = _parse(argv)
    if args.sweep:
        from bench.prefix.sweep import sweep

        return sweep(args, workloads, contenders, argv)
    router = RouterChoice()
    cells: dict[str, dict[str, Any]] = {}
    meta: dict[str, Any] = {}
    t0 = time.monotonic()
    for w in workloads:
        planned, meta[w] = _plan_workload(w, args, router, t0)
        cells[w] = {}
        for c in contenders:
            if w == "hot_prefix" and c not in HOT_CONTENDERS:
                continue
            r = run_one(w, c, planned, args.warm, args.measure, args.seed, router, args.fleet)
            cells[w][c] = r
            print(f"   {report.progress_line(c, r)}  [{time.monotonic() - t0:5.0f}s]", flush=True)
    result = {
        "command": "python -m bench.prefix " + " ".join(argv if argv is not None else sys.argv[1:]),
        "settings": report.settings(args),
        "workloads": meta,
        "cells": cells,
    }
    result["summary"] = report.summarize(cells)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=float) + "\n")
    print()
    print(report.table(result))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
