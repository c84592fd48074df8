"""Goodput under faults: five contenders per cell, cells = fleet x load x fault, all in one run.

Contenders (each gets a fresh simulated fleet, proxy and store per cell):
- ``round_robin``  pdscope's proxy with ``policy: round-robin`` and no admission limit (the toy
                   proxy's behaviour), no controller;
- ``static``       pdscope's proxy, weighted policy, no controller (it never reaches one: equal
                   weights, config admission defaults, its own outlier detection and limits);
- ``controller``   pdscope's proxy following ``pdscope control`` (enforce, 1 s ticks, 10 s window)
                   over ``pdscope collect`` (1 s scrapes, spans from the proxy);
- ``oracle``       pdscope's proxy following a hand-set table per fault (``oracle.py``);
- ``killed``       as ``controller``, but the controller process is SIGKILLed at the fault's onset:
                   the proxy runs on alone (fail-static for ``--fail-static-s``, then fallback).

Fleets 2P+4D and 3P+6D; loads 75% and 90% of the fleet's capacity, measured in the same run (the
highest step at which the static proxy kept SLO attainment >= 90% on a healthy fleet); faults
(``catalogue.py``), at ``--warm`` seconds: a D's NIC 10x slower, a P 3x slower, 30% failed transfers
on a D, a D that stops pulling, one P x D link 10x slower, a D down and back, a D's KV capacity cut to
10%, a 1.5x capacity burst. Figures come from the client over the measured phase; the controller's
reaction and cuts of healthy instances from its stored decisions (``decisions.py``); ratios and
PASS/MISS per target (``report.py``). Each contender runs in its own worker process
(``worker.py``), ``--jobs`` at a time. Writes ``bench/results/goodput.json`` and prints a table.

``--healthy``: the false-positive rate instead: the controller contender alone on healthy fleets,
``--healthy-duration`` seconds per run, both loads, two seeds, both fleets; counts weight cuts below
0.9 and limit cuts; ``--save-decisions DIR`` keeps every run's decisions as JSON.

    .venv/bin/python -m bench.goodput.run                              # the whole matrix
    .venv/bin/python -m bench.goodput.run --cells 2p4d:75:slow_prefill,3p6d:90:burst
    .venv/bin/python -m bench.goodput.run --fleets 2p4d --faults 'stuck*,bad_pair' \\
        --contenders static,controller
    .venv/bin/python -m bench.goodput.run --healthy --save-decisions bench/results/healthy-decisions
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.goodput.catalogue import (  # noqa: E402
    CHAT,
    FLEETS,
    HEALTHY,
    MIXES,
    RUN_ORDER,
    Cell,
    fault_plan,
    select_cells,
    select_contenders,
)
from bench.goodput.report import (  # noqa: E402
    budget_s,
    combine_seeds,
    contender_line,
    healthy_table,
    run_seconds,
    summary,
    table,
)
from bench.goodput.stack import (  # noqa: E402
    CONTROLLER_WINDOW_S,
    INTERVAL_S,
    SIM,
    SLO_TPOT_S,
    SLO_TTFT_S,
    STARTUP_HOLD_S,
)

CAPACITY_WARM_S = 2.0
DOWN_STEPS = (0.8, 0.6, 0.4)  # of the first capacity step, tried in turn when the fleet does not sustain it


@dataclass
class Job:
    key: str
    spec: dict[str, Any]
    result: dict[str, Any] = field(default_factory=dict)


class Progress:
    """One line per finished job: what it measured, how long it took, elapsed and ETA."""

    def __init__(self, total: int, jobs: int, est_each: list[float]) -> None:
        self.total, self.jobs = total, jobs
        self.done = 0
        self.left_s = sum(est_each)
        self.t0 = time.monotonic()
        self.lock = threading.Lock()

    def finished(self, line: str, took_s: float, est_s: float) -> None:
        with self.lock:
            self.done += 1
            self.left_s -= est_s
            elapsed = time.monotonic() - self.t0
            eta = self.left_s / max(1, self.jobs)
            print(
                f"[{self.done:3d}/{self.total}] {line}  | {took_s:4.0f} s, elapsed {_mmss(elapsed)}, "
                f"ETA {_mmss(eta)}",
                file=sys.stderr,
                flush=True,
            )


def _mmss(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s"


def run_job(job: Job, work: Path) -> dict[str, Any]:
    spec_path, out_path, log_path = (work / f"{job.key}.{x}" for x in ("spec.json", "out.json", "log"))
    spec_path.write_text(json.dumps(job.spec))
    limit = (
        float(job.spec["warm_s"]) + float(job.spec["measure_s"]) + float(job.spec["client_timeout_s"]) + 180
    )
    with log_path.open("wb") as log:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "bench.goodput.worker", str(spec_path), str(out_path)],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=limit,
                check=False,
            )
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {limit:.0f} s"
    if rc == 0 and out_path.exists():
        return dict(json.loads(out_path.read_text()))
    tail = log_path.read_text(errors="replace").strip().splitlines()[-6:]
    print(
        f"  {job.key} failed ({rc}); log {log_path}:\n    " + "\n    ".join(tail), file=sys.stderr, flush=True
    )
    return {"error": f"worker exit {rc}: {tail[-1] if tail else ''}", "log": str(log_path)}


def run_all(jobs: list[Job], parallel: int, work: Path, describe: Any, retry_starved: int = 0) -> None:
    """Run ``jobs``, ``parallel`` at a time; then rerun the starved ones (``worker.starved``) one at a
    time, up to ``retry_starved`` rounds, keeping the least starved attempt."""
    est = [run_seconds(j.spec["contender"], j.spec["warm_s"], j.spec["measure_s"]) for j in jobs]
    progress = Progress(len(jobs), parallel, est)

    def one(i: int) -> None:
        t0 = time.monotonic()
        jobs[i].result = run_job(jobs[i], work)
        progress.finished(describe(jobs[i]), time.monotonic() - t0, est[i])

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        list(pool.map(one, range(len(jobs))))
    for round_ in range(retry_starved):
        again = [j for j in jobs if j.result.get("starved")]
        if not again:
            return
        print(
            f"rerunning {len(again)} starved run(s) one at a time (round {round_ + 1})",
            file=sys.stderr,
            flush=True,
        )
        progress = Progress(
            len(again),
            1,
            [run_seconds(j.spec["contender"], j.spec["warm_s"], j.spec["measure_s"]) for j in again],
        )
        for j in again:
            t0 = time.monotonic()
            first = j.result
            r = run_job(j, work)
            if "error" in r or _lag(r) >= _lag(first):
                first.setdefault("retries", []).append(
                    {k: r.get(k) for k in ("goodput_rps", "sim_lag", "client_lag", "error")}
                )
            else:
                r["retries"] = [
                    *first.get("retries", []),
                    {k: first.get(k) for k in ("goodput_rps", "sim_lag", "client_lag")},
                ]
                j.result = r
            progress.finished(
                describe(j),
                time.monotonic() - t0,
                run_seconds(j.spec["contender"], j.spec["warm_s"], j.spec["measure_s"]),
            )


def _lag(r: dict[str, Any]) -> float:
    return max(
        float((r.get("sim_lag") or {}).get("loop_lag_p99_s") or 0.0),
        float((r.get("client_lag") or {}).get("loop_lag_p99_s") or 0.0),
    )


def base_spec(
    a: argparse.Namespace,
    fleet: str,
    contender: str,
    fault: str,
    rate: float,
    capacity: float,
    warm: float,
    measure: float,
    seed: int,
    sim_seed: int,
    mix: str | None = None,
) -> dict[str, Any]:
    """A worker's spec; ``mix`` overrides the fault's workload mix (a capacity step's)."""
    return {
        "mix": mix,
        "fleet": fleet,
        "contender": contender,
        "fault": fault,
        "rate_rps": rate,
        "capacity_rps": capacity,
        "warm_s": warm,
        "measure_s": measure,
        "seed": seed,
        "sim_seed": sim_seed,
        "client_timeout_s": a.client_timeout,
        "fail_static_s": a.fail_static_s,
        "handoff": a.handoff,
        "keep_tmp": a.keep_tmp,
    }


def capacity_key(fleet: str, mix: str) -> str:
    """The capacity's key: the fleet for the chat mix, ``FLEET/MIX`` for another."""
    return fleet if mix == CHAT else f"{fleet}/{mix}"


def _split_key(key: str) -> tuple[str, str]:
    fleet, _, mix = key.partition("/")
    return fleet, mix or CHAT


def _capacity_step(a: argparse.Namespace, key: str, rate: float, work: Path) -> dict[str, Any]:
    fleet, mix = _split_key(key)
    job = Job(
        f"capacity-{key.replace('/', '-')}-{rate:g}",
        base_spec(
            a, fleet, "static", HEALTHY, rate, rate, CAPACITY_WARM_S, a.capacity_s, a.seed, a.sim_seed, mix
        ),
    )
    r = run_job(job, work)
    if "error" in r:
        raise SystemExit(f"capacity step {key} {rate:g} req/s failed: {r['error']}")
    ok = r["slo_attainment"] >= 0.9 and r["completed"] >= 0.9 * r["requests"]
    print(
        f"  capacity {key} {rate:5.1f} req/s: attainment {r['slo_attainment'] * 100:5.1f}%  p99 TTFT "
        f"{r['ttft_p99_s'] or 0:5.2f}s  {'ok' if ok else 'over'}",
        file=sys.stderr,
        flush=True,
    )
    return {
        "offered_rps": rate,
        "goodput_rps": r["goodput_rps"],
        "slo_attainment": r["slo_attainment"],
        "ttft_p99_s": r["ttft_p99_s"],
        "sustained": ok,
        "sim_lag": r.get("sim_lag"),
    }


def _one_capacity(a: argparse.Namespace, key: str, work: Path) -> dict[str, Any]:
    """``key``'s steps in order, stopping at the first it does not sustain; where that is the first,
    ``DOWN_STEPS`` of it in turn, down to the first it sustains."""
    fleet, mix = _split_key(key)
    steps: list[dict[str, Any]] = []
    best = 0.0
    for per_p in a.rates_per_p:
        rate = round(per_p * FLEETS[fleet].n_p * MIXES[mix].rate_scale, 2)
        steps.append(_capacity_step(a, key, rate, work))
        if not steps[-1]["sustained"]:
            break
        best = rate
    first = steps[0]["offered_rps"]
    for frac in DOWN_STEPS if best <= 0 else ():  # the first step was over: try below it
        steps.append(_capacity_step(a, key, round(first * frac, 2), work))
        if steps[-1]["sustained"]:
            best = steps[-1]["offered_rps"]
            break
    if best <= 0:
        raise SystemExit(
            f"{key}: the healthy fleet sustained none of the capacity steps {a.rates_per_p} per P"
        )
    if all(x["sustained"] for x in steps):
        print(
            f"  capacity {key}: the last step was sustained too; the capacity may be higher (--rates-per-p)",
            file=sys.stderr,
            flush=True,
        )
    return {
        "capacity_rps": best,
        "capacity_steps": steps,
        "given": False,
        "at_last_step": steps[-1]["sustained"],
    }


def measure_capacity(a: argparse.Namespace, keys: list[str], work: Path) -> dict[str, dict[str, Any]]:
    """Per fleet and mix (``capacity_key``): the highest offered rate (``--rates-per-p`` x P count x the
    mix's ``rate_scale``) at which the static proxy keeps >= 90% SLO attainment and completes >= 90%
    of a healthy fleet's requests. Keys run side by side when ``--jobs`` allows."""
    out: dict[str, dict[str, Any]] = {
        k: {"capacity_rps": a.capacity[k], "capacity_steps": [], "given": True}
        for k in keys
        if k in a.capacity
    }
    todo = [k for k in keys if k not in out]

    def one(key: str) -> None:
        out[key] = _one_capacity(a, key, work)

    with ThreadPoolExecutor(max_workers=max(1, min(a.jobs, len(todo) or 1))) as pool:
        list(pool.map(one, todo))
    return {k: out[k] for k in keys}


def capacity_estimate_s(a: argparse.Namespace, keys: list[str]) -> float:
    todo = [k for k in keys if k not in a.capacity]
    if not todo:
        return 0.0
    # the steps stop at the first the fleet does not sustain: about six of the default eight here
    steps = min(len(a.rates_per_p), 6)
    per_key = steps * run_seconds("static", CAPACITY_WARM_S, float(a.capacity_s))
    return float(per_key * len(todo) / max(1, min(int(a.jobs), len(todo))))


def _announce_budget(
    a: argparse.Namespace, runs: list[tuple[str, float, float]], keys: list[str], what: str
) -> float:
    """The estimated wall seconds of ``runs`` after the capacity steps of ``keys``, said on stderr after
    ``what`` (the runs in words)."""
    est = budget_s(runs, a.jobs, capacity_estimate_s(a, keys))
    print(f"{what}, {a.jobs} at a time: about {est / 60:.0f} min", file=sys.stderr, flush=True)
    return est


def header(a: argparse.Namespace) -> dict[str, Any]:
    return {
        "bench": "goodput",
        "format": 2,
        "generated_at": time.time(),
        "argv": sys.argv[1:],
        "simulator": {**SIM, "seed": a.sim_seed},
        "mixes": {m.name: {"prompt": m.prompt, "output": m.output} for m in MIXES.values()},
        "seeds": a.seeds,
        "slo": {"ttft_s": SLO_TTFT_S, "tpot_s": SLO_TPOT_S},
        "warm_s": a.warm,
        "seed": a.seed,
        "controller_interval_s": INTERVAL_S,
        "controller_window_s": CONTROLLER_WINDOW_S,
        "client_timeout_s": a.client_timeout,
        "fail_static_s": a.fail_static_s,
        "handoff": a.handoff,
        "jobs": a.jobs,
    }


def _cell_keys(cells: list[Cell], measure_s: float) -> dict[Cell, str]:
    """Each cell's capacity key (its fleet and its fault's workload mix)."""
    return {c: capacity_key(c.fleet, fault_plan(c.fault, FLEETS[c.fleet], measure_s).mix) for c in cells}


def _matrix_jobs(
    a: argparse.Namespace,
    cells: list[Cell],
    contenders: list[str],
    caps: dict[str, Any],
    keys: dict[Cell, str],
) -> list[Job]:
    """One job per cell, seed and contender; seed i runs the simulator at ``--sim-seed`` + i."""
    jobs: list[Job] = []
    for cell in cells:
        cap = caps[keys[cell]]["capacity_rps"]
        for i, seed in enumerate(a.seeds):
            for c in sorted(contenders, key=RUN_ORDER.index):
                spec = base_spec(
                    a,
                    cell.fleet,
                    c,
                    cell.fault,
                    round(cap * cell.load / 100, 3),
                    cap,
                    a.warm,
                    a.measure,
                    seed,
                    a.sim_seed + i,
                )
                tag = f"{cell.name.replace(':', '-')}-s{seed}-{c}"
                spec["cell"] = cell.name
                if a.save_decisions and c in ("controller", "killed"):
                    spec["save_decisions"] = str(Path(a.save_decisions) / f"{tag}.json")
                jobs.append(Job(tag, spec))
    return jobs


def _matrix_cells(
    a: argparse.Namespace, cells: list[Cell], contenders: list[str], jobs: list[Job]
) -> dict[str, Any]:
    """Each cell's figures over its seeds (``report.combine_seeds``)."""
    out: dict[str, Any] = {}
    for cell in cells:
        mine = [j for j in jobs if j.spec["cell"] == cell.name]
        by_seed: dict[str, dict[str, dict[str, Any]]] = {}
        for j in sorted(mine, key=lambda j: contenders.index(j.spec["contender"])):
            by_seed.setdefault(str(j.spec["seed"]), {})[j.spec["contender"]] = j.result
        for res in by_seed.values():
            rr = res.get("round_robin", {}).get("goodput_rps")
            orc = res.get("oracle", {}).get("goodput_rps")
            for r in res.values():
                if "goodput_rps" in r:
                    r["goodput_ratio_vs_round_robin"] = r["goodput_rps"] / rr if rr else None
                    r["goodput_ratio_vs_oracle"] = r["goodput_rps"] / orc if orc else None
        plan = fault_plan(cell.fault, FLEETS[cell.fleet], a.measure)
        combined = combine_seeds(cell.fault, by_seed, SLO_TTFT_S)
        out[cell.name] = {
            "fleet": cell.fleet,
            "load_pct": cell.load,
            "fault": cell.fault,
            "mix": plan.mix,
            "about": plan.about,
            "injections": list(plan.injections),
            "faulty": sorted(plan.faulty),
            "offered_rps": mine[0].spec["rate_rps"],
            **combined,
            "reaction_ticks": combined["contenders"].get("controller", {}).get("reaction_ticks"),
        }
    return out


def matrix(a: argparse.Namespace) -> dict[str, Any]:
    cells = select_cells(a.cells, a.fleets, a.loads, a.faults)
    contenders = select_contenders(a.contenders)
    keys = _cell_keys(cells, a.measure)
    cap_keys = list(dict.fromkeys(sorted(keys.values(), key=lambda k: list(FLEETS).index(k.split("/")[0]))))
    runs = [(c, a.warm, a.measure) for _ in cells for _ in a.seeds for c in contenders]
    est = _announce_budget(
        a,
        runs,
        cap_keys,
        f"{len(cells)} cells x {len(a.seeds)} seed(s) x {len(contenders)} contenders = {len(runs)} runs of "
        f"{a.warm:g} + {a.measure:g} s",
    )
    if a.dry_run:
        print("\n".join(c.name for c in cells))
        raise SystemExit(0)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="goodput-bench-") as tmp:
        work = Path(tmp)
        caps = measure_capacity(a, cap_keys, work)
        for k, v in caps.items():
            print(f"capacity {k}: {v['capacity_rps']:g} req/s", file=sys.stderr, flush=True)
        jobs = _matrix_jobs(a, cells, contenders, caps, keys)
        run_all(
            jobs,
            a.jobs,
            work,
            lambda j: contender_line(f"{j.spec['cell']} s{j.spec['seed']}", j.spec["contender"], j.result),
            a.retry_starved,
        )
    out = header(a) | {"measured_s": a.measure, "fleets": {}, "cells": {}}
    for k, v in caps.items():
        fleet, mix = _split_key(k)
        out["fleets"][k] = {"fleet": f"{FLEETS[fleet].label} simulated", "mix": mix, **v}
    out["cells"] = _matrix_cells(a, cells, contenders, jobs)
    out["summary"] = summary(out["cells"])
    out["wall_s"] = round(time.monotonic() - t0, 1)
    out["estimated_s"] = round(est, 1)
    return out


def _healthy_jobs(a: argparse.Namespace, cells: list[Cell], caps: dict[str, Any]) -> list[Job]:
    """One controller job per healthy cell and seed; seed i runs the simulator at ``--sim-seed`` + i."""
    jobs = []
    for cell in cells:
        cap = caps[cell.fleet]["capacity_rps"]
        for i, seed in enumerate(a.seeds):
            name = f"{cell.fleet}-{cell.load}-s{seed}"
            spec = base_spec(
                a,
                cell.fleet,
                "controller",
                HEALTHY,
                round(cap * cell.load / 100, 3),
                cap,
                a.warm,
                a.healthy_duration,
                seed,
                a.sim_seed + i,
            )
            spec["cell"] = name
            if a.save_decisions:
                spec["save_decisions"] = str(Path(a.save_decisions) / f"healthy-{name}.json")
            jobs.append(Job(name, spec))
    return jobs


def _healthy_run(j: Job) -> dict[str, Any]:
    """A healthy job's result with what it ran: fleet, load, seeds and offered rate."""
    return {
        **j.result,
        "fleet": j.spec["fleet"],
        "load_pct": round(100 * j.spec["rate_rps"] / j.spec["capacity_rps"]),
        "seed": j.spec["seed"],
        "sim_seed": j.spec["sim_seed"],
        "offered_rps": j.spec["rate_rps"],
    }


def _healthy_summary(runs: dict[str, dict[str, Any]]) -> dict[str, int]:
    """The healthy runs' counts: PASS (no cut of a healthy instance), MISS, failed runs, and the cuts."""
    ok = [r for r in runs.values() if "error" not in r]
    return {
        "pass": sum(1 for r in ok if r["healthy_cuts"] == 0),
        "miss": sum(1 for r in ok if r["healthy_cuts"] != 0),
        "failed": len(runs) - len(ok),
        "weight_cuts": sum(r["healthy_weight_cuts"] for r in ok),
        "limit_cuts": sum(r["unexpected_limit_cuts"] for r in ok),
        "startup_cuts": sum(r.get("startup_cuts", 0) for r in ok),
        "starved": sum(1 for r in ok if r.get("starved")),
    }


def healthy(a: argparse.Namespace) -> dict[str, Any]:
    cells = [Cell(c.fleet, c.load, HEALTHY) for c in select_cells(None, a.fleets, a.loads, "burst")]
    fleets = sorted({c.fleet for c in cells}, key=list(FLEETS).index)
    runs = [("controller", a.warm, a.healthy_duration) for _ in cells for _ in a.seeds]
    est = _announce_budget(
        a, runs, fleets, f"{len(runs)} healthy runs of {a.warm:g} + {a.healthy_duration:g} s"
    )
    if a.dry_run:
        raise SystemExit(0)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="goodput-healthy-") as tmp:
        work = Path(tmp)
        caps = measure_capacity(a, fleets, work)
        jobs = _healthy_jobs(a, cells, caps)
        run_all(
            jobs,
            a.jobs,
            work,
            lambda j: contender_line(j.spec["cell"], "controller", j.result),
            a.retry_starved,
        )
    out = header(a) | {
        "mode": "healthy",
        "measured_s": a.healthy_duration,
        "seeds": a.seeds,
        "fleets": {f: {"fleet": f"{FLEETS[f].label} simulated", **v} for f, v in caps.items()},
        "runs": {j.key: _healthy_run(j) for j in jobs},
    }
    out["summary"] = _healthy_summary(out["runs"])
    out["wall_s"] = round(time.monotonic() - t0, 1)
    out["estimated_s"] = round(est, 1)
    return out


def _capacities(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in [x.strip() for x in text.split(",") if x.strip()]:
        name, sep, value = item.partition("=")
        fleet, _, mix = name.partition("/")
        try:
            rate = float(value)
        except ValueError:
            rate = math.nan
        if not sep or fleet not in FLEETS or (mix and mix not in MIXES) or not 0 < rate < 1e6:
            raise argparse.ArgumentTypeError(
                f"--capacity: {item!r} is not FLEET[/MIX]=REQ_PER_S, 0 < REQ_PER_S < 1e6 "
                f"(fleets {', '.join(FLEETS)}; mixes {', '.join(MIXES)})"
            )
        out[capacity_key(fleet, mix or CHAT)] = rate
    return out


def _selection_args(ap: argparse.ArgumentParser) -> None:
    """Which cells and contenders run."""
    ap.add_argument(
        "--cells", help="FLEET:LOAD:FAULT patterns, globs allowed (2p4d:75:slow_prefill,*:90:burst)"
    )
    ap.add_argument("--fleets", help="2p4d, 3p6d, 4p2d, 3p3d (default all)")
    ap.add_argument("--loads", help="75, 90 (default both; percent of the measured capacity)")
    ap.add_argument("--faults", help="names or globs (default all); a, b, c = the old scenarios")
    ap.add_argument("--contenders", help="round_robin, static, controller, oracle, killed (default all)")


def _timing_args(ap: argparse.ArgumentParser) -> None:
    """How long each run warms and measures, and how many run at a time."""
    ap.add_argument(
        "--warm",
        type=float,
        default=None,
        help="seconds before the fault (default: the controller's start-up hold, 2 windows, + 2 s = "
        f"{STARTUP_HOLD_S + 2:g}; --warm 8 puts the fault inside it, as on a first deployment)",
    )
    ap.add_argument(
        "--measure", type=float, default=20.0, help="measured seconds from the fault (default 20)"
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=None,
        help=(
            "runs at a time (default 3; --healthy: 2, its long 3P+6D runs need more CPU; "
            "see docs/benchmarks.md)"
        ),
    )
    ap.add_argument(
        "--retry-starved",
        type=int,
        default=1,
        help="rounds of rerunning, one at a time, the runs starved of CPU (default 1; 0: none)",
    )


def _capacity_args(ap: argparse.ArgumentParser) -> None:
    """The capacity steps (or the capacities given instead)."""
    ap.add_argument("--capacity-s", type=float, default=10.0, help="seconds per capacity step (default 10)")
    ap.add_argument(
        "--rates-per-p",
        default="6,6.5,7,7.5,8,8.5,9,9.5",
        help="capacity steps, req/s per prefill instance, tried in order up to the first the fleet "
        "does not sustain (default 6,6.5,7,7.5,8,8.5,9,9.5)",
    )
    ap.add_argument(
        "--capacity",
        type=_capacities,
        default={},
        help="skip the capacity steps for these fleets (and mixes): 2p4d=14,3p6d=21,2p4d/prefill_heavy=5 "
        "(tuning runs only)",
    )


def _run_args(ap: argparse.ArgumentParser) -> None:
    """Each run's client, proxy and seeds."""
    ap.add_argument(
        "--client-timeout",
        type=float,
        default=10.0,
        help="client timeout per request, seconds (default 10; 5x the TTFT SLO)",
    )
    ap.add_argument(
        "--fail-static-s",
        type=float,
        default=None,
        help="proxy.fail_static_s of every contender (default a third of --measure, so that the "
        "killed contender runs fail-static, then fallback, within the measured phase)",
    )
    ap.add_argument(
        "--handoff",
        choices=("pull", "push", "push_early"),
        default="pull",
        help="how the fleet hands KV off (default pull; push: NixlPushConnector, D's leg after P's answer; "
        "push_early: D's leg with P's, proxy.push_early)",
    )
    ap.add_argument("--seed", type=int, default=1, help="workload seed (default 1)")
    ap.add_argument("--sim-seed", type=int, default=7, help="simulator seed (default 7)")


def _mode_args(ap: argparse.ArgumentParser) -> None:
    """The healthy mode and the seeds each cell runs under."""
    ap.add_argument(
        "--healthy", action="store_true", help="the quiet-when-healthy runs instead of the matrix"
    )
    ap.add_argument(
        "--healthy-duration", type=float, default=600.0, help="seconds per healthy run (default 600)"
    )
    ap.add_argument(
        "--seeds",
        default=None,
        help="workload seeds, each cell run once per seed, the report over them (mean, min); default "
        "--seed alone (the issue's targets ask for three: 1,2,3); --healthy: default 1,2. The simulator's "
        "seed is --sim-seed + the seed's index",
    )


def _output_args(ap: argparse.ArgumentParser) -> None:
    """What is kept and written (or, with --dry-run, only planned)."""
    ap.add_argument("--save-decisions", help="directory: write each controlled run's decisions there as JSON")
    ap.add_argument(
        "--keep-tmp", action="store_true", help="keep each run's logs and store (paths in the JSON)"
    )
    ap.add_argument(
        "--dry-run", action="store_true", help="print the cells and the time estimate, run nothing"
    )
    ap.add_argument("--out", help="default bench/results/goodput.json (--healthy: goodput-healthy.json)")


def _settle(ap: argparse.ArgumentParser, a: argparse.Namespace) -> argparse.Namespace:
    """``a`` with its lists parsed, its defaults that depend on other flags set, and its values checked
    (``ap.error`` on a bad one)."""
    try:
        a.rates_per_p = [float(x) for x in a.rates_per_p.split(",") if x.strip()]
        if a.seeds is None:
            a.seeds = "1,2" if a.healthy else str(a.seed)
        a.seeds = [int(x) for x in a.seeds.split(",") if x.strip()]
        if len(set(a.seeds)) != len(a.seeds) or len(a.seeds) > 10:
            raise ValueError(f"--seeds: at most 10, each once (got {a.seeds})")
        select_cells(a.cells, a.fleets, a.loads, a.faults)
        select_contenders(a.contenders)
    except ValueError as exc:
        ap.error(str(exc))
    if a.jobs is None:
        a.jobs = 2 if a.healthy else 3
    if a.warm is None:
        # A fleet meets the controller's start-up hold (controller.noise.startup_s) only when pdscope is
        # first deployed; faults on a running fleet come after it.
        a.warm = STARTUP_HOLD_S + 2.0
    if (
        a.jobs < 1
        or a.warm < 0
        or a.measure <= 0
        or a.healthy_duration <= 0
        or not a.rates_per_p
        or not a.seeds
    ):
        ap.error(
            "--jobs >= 1, --warm >= 0, --measure/--healthy-duration > 0, --rates-per-p and --seeds non-empty"
        )
    if a.fail_static_s is None:
        a.fail_static_s = round(a.measure / 3, 1)
    name = "goodput-healthy.json" if a.healthy else "goodput.json"
    a.out = a.out or str(REPO / "bench" / "results" / name)
    return a


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for declare in (_selection_args, _timing_args, _capacity_args, _run_args, _mode_args, _output_args):
        declare(ap)
    return _settle(ap, ap.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    result = healthy(a) if a.healthy else matrix(a)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(healthy_table(result) if a.healthy else table(result))
    print(f"wrote {a.out} ({result['wall_s'] / 60:.1f} min)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
