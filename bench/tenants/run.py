"""Tenants: fair shares, priority and per-tenant SLOs on one simulated P/D fleet (issue 31), all in one run.

Each scenario (``scenarios.py``) runs on a fresh simulated 2P+4D fleet behind pdscope's proxy
(bench/goodput's fleet and ``static`` proxy, ``stack.py``) twice: ``fair``, the ``tenants`` section on,
and ``unfair``, the same section with ``enabled: false`` (the proxy ignores it: the same fleet without
tenant fairness); and each well-behaved tenant once more ``alone`` (its own schedule, nothing else, the
section on): the reference its attainment is held against.

- ``flood``: equal weights; two tenants at 3/4 of their share, one at 5x its share in bursts;
- ``priority``: an interactive tenant (TTFT SLO 1.5 s) at 0.3x capacity beside a batch tenant at 1.5x;
- ``longprompt``: a tenant of long prompts (about 4,000 tokens) within its share beside a bursty flood;
- ``shapes``: on a fleet whose D slots are the bottleneck, a tenant of long prompts and short answers
  beside one of short prompts and long answers past D's slots: each pool shared in its own tokens;
- ``mixed``: weights 3:1:1:1 and three TTFT SLOs (1.5 s, 3 s, the fleet's 2 s for the flood, 10 s for
  batch): two interactive tenants within their share beside a batch tenant and a bursty flood;
- ``backlog``: weights 2:1:1, every tenant offering 3/4 of capacity (all past their share: Jain's index).

``--repeat N`` runs each scenario's contested arms (fair, unfair, priority) N times, interleaved (fair,
unfair, fair, unfair, ...: a slow spell of the machine falls on both sides), the alone runs once; each
target is then the median over the repeats, judged on the median, with its range beside it. One pair of
runs cannot tell goodput on from off here: an A/A run (the same code twice) spread 0.72-1.18, and the
well-behaved tenants' attainment beside the flood moved 0.50-0.92 between runs of the same code.

``--priority`` adds a third arm to every scenario, ``priority``: the fair run on a fleet vLLM schedules
by priority (every pool's ``scheduling`` and the simulator's ``scheduling_policy``), so that the proxy
sets each request's ``priority`` from its tenant's class and share (``proxy.priority``).

Loads are multiples of the fleet's capacity, measured first in the same run (the highest of the capacity
steps at which one tenant's load of this mix keeps >= 90 % of its requests within the fleet SLO, 429s
counted as misses) or given (``--capacity``). The client (``client.py``) sends every tenant's seeded
schedule open loop with its ``x-pdscope-tenant`` header and reads a rejection's reason from the proxy's
error body; figures are over the requests sent in the measured phase (``--measure`` s after ``--warm``
s), per tenant (``figures.py``). Last, the proxy's per-core ceiling with tenants on against off
(``ceiling.py``, bench/proxy's measurement). Prints the tables and writes ``bench/results/tenants.json``.

    .venv/bin/python -m bench.tenants                 # 10 to 13 minutes
    .venv/bin/python -m bench.tenants --quick         # a smoke run (no result): about 3 minutes
    .venv/bin/python -m bench.tenants --proxy-tree /tmp/wt-tenants   # another checkout's proxy
    .venv/bin/python -m bench.tenants --scenarios flood,priority --priority --capacity 24.3 \
        --ceiling-rounds 0 --out bench/results/tenants-priority.json    # fcfs against priority, 7 min
    .venv/bin/python -m bench.tenants --scenarios flood --capacity 24.3 --ceiling-rounds 0 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.goodput.catalogue import FLEETS
from bench.goodput.run import CAPACITY_WARM_S, DOWN_STEPS
from bench.goodput.stack import MODEL, SIM, StackSpec
from bench.goodput.worker import LagProbe, starved
from bench.tenants.ceiling import measure_ceiling
from bench.tenants.client import run_tenants
from bench.tenants.figures import combine, run_figures, summary
from bench.tenants.report import derived, tables
from bench.tenants.scenarios import (
    MEAN_PROMPT_TOKENS,
    OUTPUT,
    PROMPT,
    SCENARIOS,
    Scenario,
    TenantLoad,
    schedule,
    tenants_section,
)
from bench.tenants.stack import TenantStack

REPO = Path(__file__).resolve().parents[2]
FLEET = FLEETS["2p4d"]
CAPACITY_PROBE = Scenario("capacity", "one tenant at the step's rate", (TenantLoad("probe", 1.0),))
CHAT_PER_P = 7.0  # bench/goodput's capacity for its 2,048-token chat mix, req/s per P (about)


@dataclass(frozen=True)
class RunSpec:
    scenario: Scenario
    arm: str  # fair, unfair, priority (fair on a priority-scheduled fleet), alone:<tenant>
    capacity_rps: float
    warm_s: float
    measure_s: float

    @property
    def enabled(self) -> bool:
        return self.arm != "unfair"

    @property
    def scheduling(self) -> str:
        return "priority" if self.arm == "priority" else "fcfs"

    @property
    def only(self) -> str | None:
        return self.arm.partition(":")[2] or None


async def _load(stack: TenantStack, spec: RunSpec, a: argparse.Namespace) -> dict[str, Any]:
    """Send the run's schedule through ``stack``; its figures over the measured phase and its checks."""
    planned = schedule(spec.scenario, spec.capacity_rps, spec.warm_s + spec.measure_s, a.seed, spec.only)
    probe = LagProbe()
    stack.reset_sim_lag()
    probe.start()
    sent = await run_tenants(stack.proxy_url, planned, model=MODEL, timeout_s=a.client_timeout)
    measured = [s for s in sent if s.result.scheduled_s >= spec.warm_s]
    out = run_figures(measured, spec.scenario, spec.measure_s, spec.only)
    lag = stack.sim_lag() or {}
    out["sim_lag"] = {k: lag.get(k) for k in ("loop_lag_p99_s", "loop_lag_max_s")}
    out["client_lag"] = probe.stop()
    out["starved"] = starved(out["sim_lag"], out["client_lag"])
    out["offered_rps"] = {
        t.id: round(t.of_capacity * spec.capacity_rps, 2)
        for t in spec.scenario.tenants
        if spec.only in (None, t.id)
    }
    return out


def one_run(spec: RunSpec, a: argparse.Namespace) -> dict[str, Any]:
    """A fresh fleet and proxy for one run of one scenario's arm; its figures (``wall_s`` included)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"tenants-{spec.scenario.name}-{spec.arm.replace(':', '-')}-"))
    section = tenants_section(spec.scenario, spec.enabled)
    stack_spec = StackSpec(FLEET, "static", a.sim_seed, spec.measure_s)
    stack = TenantStack(stack_spec, tmp, section, a.proxy_tree, spec.scheduling, spec.scenario.fleet)
    t0 = time.monotonic()
    ok = False
    try:
        with stack:
            out = asyncio.run(_load(stack, spec, a))
        ok = True
    finally:
        if ok and not a.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"  logs kept in {tmp}", file=sys.stderr, flush=True)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _step(a: argparse.Namespace, rate: float) -> dict[str, Any]:
    r = one_run(RunSpec(CAPACITY_PROBE, "unfair", rate, CAPACITY_WARM_S, a.capacity_s), a)
    f = r["tenants"]["probe"]
    ok = (f["attainment"] or 0.0) >= 0.9
    _say(
        f"  capacity step {rate:5.1f} req/s: attainment {100 * (f['attainment'] or 0):5.1f}%, p99 TTFT "
        f"{f['ttft_p99_s'] or 0:.2f} s, 429s {f['rejected_429']}: {'sustained' if ok else 'over'}"
        f"{' (starved of CPU)' if r['starved'] else ''}"
    )
    return {"offered_rps": rate, "sustained": ok, "starved": r["starved"], **f}


def measure_capacity(a: argparse.Namespace) -> dict[str, Any]:
    """The steps (``--steps`` x a guess from bench/goodput's chat capacity scaled to this mix's prompts)
    in order up to the first not sustained; where that is the first, ``DOWN_STEPS`` of it in turn."""
    if a.capacity:
        return {"capacity_rps": a.capacity, "given": True, "steps": []}
    guess = CHAT_PER_P * FLEET.n_p * 2048 / MEAN_PROMPT_TOKENS
    steps: list[dict[str, Any]] = []
    best = 0.0
    for frac in a.steps:
        steps.append(_step(a, round(guess * frac, 1)))
        if not steps[-1]["sustained"]:
            break
        best = steps[-1]["offered_rps"]
    for frac in DOWN_STEPS if best <= 0 else ():
        steps.append(_step(a, round(guess * a.steps[0] * frac, 1)))
        if steps[-1]["sustained"]:
            best = steps[-1]["offered_rps"]
            break
    if best <= 0:
        raise SystemExit("the fleet sustained none of the capacity steps")
    return {"capacity_rps": best, "given": False, "steps": steps, "at_last_step": steps[-1]["sustained"]}


def run_scenario(sc: Scenario, capacity: float, a: argparse.Namespace) -> list[dict[str, Any]]:
    """The scenario's contested runs (fair, unfair, and priority with ``--priority``) ``--repeat`` times,
    interleaved so that a slow spell of the machine falls on both sides of a pair; then each well-behaved
    tenant's run alone, once (its reference). One dict of runs by arm per repeat, the alone runs in each."""
    contested = ["fair", "unfair", *(["priority"] if a.priority else [])]
    repeats: list[dict[str, Any]] = []
    for i in range(a.repeat):
        got: dict[str, Any] = {}
        for arm in contested:
            got[arm] = one_run(RunSpec(sc, arm, capacity, a.warm, a.measure), a)
            _say(f"  {sc.name} {arm}{f' #{i + 1}' if a.repeat > 1 else ''}: {_brief(got[arm])}")
        repeats.append(got)
    for t in sc.behaved():
        arm = f"alone:{t.id}"
        alone = one_run(RunSpec(sc, arm, capacity, a.warm, a.measure), a)
        _say(f"  {sc.name} {arm}: {_brief(alone)}")
        for got in repeats:
            got[arm] = alone
    return repeats


def _brief(r: dict[str, Any]) -> str:
    per = ", ".join(
        f"{tid} {100 * (f['attainment'] or 0):.0f}% ({f['rejected_429']} x 429)"
        for tid, f in r["tenants"].items()
    )
    flag = " STARVED" if r["starved"] else ""
    return f"{per}; goodput {r['goodput_tok_s']:.0f} tok/s; {r['wall_s']:.0f} s{flag}"


def _tree_commit(tree: str | None) -> str | None:
    if tree is None:
        return None
    out = subprocess.run(["git", "-C", tree, "log", "-1", "--format=%H %s"], capture_output=True, text=True)
    return out.stdout.strip()[:200] or None


def header(a: argparse.Namespace) -> dict[str, Any]:
    return {
        "bench": "tenants",
        "format": 1,
        "generated_at": time.time(),
        "argv": sys.argv[1:],
        "fleet": f"{FLEET.label} simulated",
        "simulator": {**SIM, "seed": a.sim_seed},
        "proxy": "bench/goodput's static contender: weighted, admission defaults, no controller",
        "proxy_tree": a.proxy_tree,
        "proxy_tree_commit": _tree_commit(a.proxy_tree),
        "mix": {"prompt": "lognormal:1024,0.7 in [64, 6144]", "output": "lognormal:24,0.6 in [4, 128]"},
        "warm_s": a.warm,
        "measure_s": a.measure,
        "seed": a.seed,
        "client_timeout_s": a.client_timeout,
        "quick": a.quick,
        "priority_arm": a.priority,
    }


def scenario_about(sc: Scenario) -> dict[str, Any]:
    """The scenario as declared: each tenant's weight, class, SLO, load (x capacity and x its share)."""
    return {
        "about": sc.about,
        "fleet": None if sc.fleet is None else vars(sc.fleet),
        "tenants": {
            t.id: {
                **t.declared(),
                "of_capacity": round(t.of_capacity, 3),
                "of_share": round(t.of_capacity / sc.share(t), 2),
                "arrivals": t.pattern,
                "prompt": t.prompt,
                "output": t.output,
                "well_behaved": t.behaved,
            }
            for t in sc.tenants
        },
    }


def bench(a: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    chosen = {n: SCENARIOS[n] for n in a.scenarios}
    n_runs = sum((2 + a.priority) * a.repeat + len(sc.behaved()) for sc in chosen.values())
    est = n_runs * (a.warm + a.measure + 12) + (0 if a.capacity else 3 * (a.capacity_s + 12)) + 60
    _say(f"{n_runs} runs of {a.warm:g} + {a.measure:g} s after the capacity steps: about {est / 60:.0f} min")
    out = header(a) | {"scenarios": {n: scenario_about(sc) for n, sc in chosen.items()}}
    out["capacity"] = measure_capacity(a)
    cap = out["capacity"]["capacity_rps"]
    _say(f"capacity {cap:g} req/s (prompt {PROMPT.kind} {PROMPT.a:g}, output {OUTPUT.kind} {OUTPUT.a:g})")
    per_scenario = {n: run_scenario(sc, cap, a) for n, sc in chosen.items()}
    repeats = [{n: r[i] for n, r in per_scenario.items()} for i in range(a.repeat)]
    ceiling = None
    if a.ceiling_rounds > 0:
        ceiling = measure_ceiling(SCENARIOS["flood"], a.ceiling_rounds, a.ceiling_duration, tree=a.proxy_tree)
    ratio = None if ceiling is None else ceiling["ratio_on_vs_off"]
    out["runs"] = repeats[0]
    out["repeat_runs"] = [{n: _contested(r) for n, r in rep.items()} for rep in repeats[1:]]
    out["derived"] = derived(repeats[0], chosen)
    out["ceiling"] = ceiling
    out["summary"] = combine([summary(rep, chosen, ratio) for rep in repeats])
    out["starved_runs"] = [
        f"{n}:{arm}{f'#{i + 1}' if i else ''}"
        for i, rep in enumerate(repeats)
        for n, r in rep.items()
        for arm, x in r.items()
        if x["starved"] and (i == 0 or not arm.startswith("alone:"))
    ]
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


def _contested(runs: dict[str, Any]) -> dict[str, Any]:
    """A repeat's runs without the alone ones (stored once, in the first repeat's)."""
    return {arm: r for arm, r in runs.items() if not arm.startswith("alone:")}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run: short phases, one ceiling round")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"some of {', '.join(SCENARIOS)}")
    ap.add_argument("--warm", type=float, default=None, help="seconds before the measured phase (default 5)")
    ap.add_argument("--measure", type=float, default=None, help="measured seconds per run (default 20)")
    ap.add_argument("--capacity", type=float, default=None, help="req/s: skip the capacity steps")
    ap.add_argument("--steps", default="0.9,1.0,1.1,1.2,1.3", help="capacity steps, fractions of the guess")
    ap.add_argument("--capacity-s", type=float, default=None, help="measured seconds per capacity step")
    ap.add_argument("--client-timeout", type=float, default=10.0, help="per request, s (default 10)")
    ap.add_argument("--ceiling-rounds", type=int, default=None, help="0: no ceiling (default 3; quick 1)")
    ap.add_argument("--ceiling-duration", type=float, default=None, help="s per ceiling loop (default 5)")
    ap.add_argument("--proxy-tree", default=None, help="run the proxy from this checkout (a worktree)")
    ap.add_argument("--seed", type=int, default=1, help="workload seed (default 1)")
    ap.add_argument("--sim-seed", type=int, default=7, help="simulator seed (default 7)")
    ap.add_argument("--priority", action="store_true", help="and each scenario on a priority-scheduled fleet")
    ap.add_argument("--repeat", type=int, default=1, help="fair/unfair pairs per scenario (default 1)")
    ap.add_argument("--keep-tmp", action="store_true", help="keep every run's logs")
    ap.add_argument("--out", default=None, help="default bench/results/tenants.json (quick: tenants-quick)")
    a = ap.parse_args(argv)
    quick = a.quick
    for name, full, short in (
        ("warm", 5.0, 3.0),
        ("measure", 20.0, 8.0),
        ("capacity_s", 10.0, 6.0),
        ("ceiling_rounds", 3, 1),
        ("ceiling_duration", 5.0, 2.0),
    ):
        if getattr(a, name) is None:
            setattr(a, name, short if quick else full)
    a.scenarios = [s.strip() for s in a.scenarios.split(",") if s.strip()]
    a.steps = [float(x) for x in a.steps.split(",") if x.strip()]
    if not a.scenarios or any(s not in SCENARIOS for s in a.scenarios) or not a.steps:
        ap.error(f"--scenarios: some of {', '.join(SCENARIOS)}; --steps: not empty")
    if not 1 <= a.repeat <= 20:
        ap.error("--repeat: 1 to 20")
    name = "tenants-quick.json" if quick else "tenants.json"
    a.out = a.out or str(REPO / "bench" / "results" / name)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    result = bench(a)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(tables(result))
    _say(f"wrote {a.out} ({result['wall_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
