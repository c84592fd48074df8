"""One contender on one cell, in its own process: ``python -m bench.goodput.worker SPEC.json OUT.json``.

A fresh fleet and the contender's services (``stack.py``), a seeded open-loop Poisson schedule at
the cell's offered rate, the fault injected at ``warm_s`` (the killed contender's controller is
SIGKILLed at that moment; the oracle's table follows ``oracle_schedule``), then the client's
figures over the measured phase, the controller's decisions (``decisions.py``), expired leases,
CPU seconds per service and event-loop lag (of the simulator and of this client) as a check that
the run was not starved. Its own process so that parallel runs do not share an event loop.
"""

from __future__ import annotations

import asyncio
import json
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.goodput.catalogue import (
    CONTROLLED,
    FLEETS,
    HEALTHY,
    MIXES,
    FaultPlan,
    FleetShape,
    fault_plan,
)
from bench.goodput.decisions import analyse, jsonable, read_decisions
from bench.goodput.oracle import ORACLE_WAIT_S, StaticTable, oracle_schedule, oracle_table
from bench.goodput.predictor import prediction_error, read_predictions
from bench.goodput.stack import (
    INTERVAL_S,
    MODEL,
    SLO_TPOT_S,
    SLO_TTFT_S,
    Stack,
    StackSpec,
)
from pdscope.stats import percentile
from simulator.loadgen import LoadTarget, run_load
from simulator.workload import LengthDist, Planned, RequestResult, plan, summarize


def workload(
    rate: float, capacity: float, duration: float, warm: float, seed: int, fault: FaultPlan
) -> list[Planned]:
    """The cell's open-loop schedule in its mix; a burst's extra load from onset (``warm``)."""
    mix = MIXES[fault.mix]
    p, o = LengthDist.parse(mix.prompt), LengthDist.parse(mix.output)
    base = plan("poisson", rate, 10**7, duration, p, o, seed)
    if fault.burst is None:
        return base
    multiple, burst_s = fault.burst
    extra_rate = multiple * capacity - rate
    if extra_rate <= 0:
        return base
    extra = plan("poisson", extra_rate, 10**7, burst_s, p, o, seed + 1)
    return sorted(
        base + [Planned(x.at + warm, x.prompt_tokens, x.output_tokens) for x in extra], key=lambda x: x.at
    )


def meets_slo(r: RequestResult) -> bool:
    return (
        r.ok
        and r.ttft_s is not None
        and r.ttft_s <= SLO_TTFT_S
        and (r.tpot_s is None or r.tpot_s <= SLO_TPOT_S)
    )


def measure(results: list[RequestResult], warm: float, measured_s: float) -> dict[str, Any]:
    """The client's figures over the measured phase. ``admitted``: the requests not answered 429/503
    (a request the proxy let in and then failed counts against ``admitted_attainment``)."""
    phase = [r for r in results if r.scheduled_s >= warm]
    s = summarize(phase, measured_s, SLO_TTFT_S, SLO_TPOT_S)
    rejected = sum(1 for r in phase if r.status in (429, 503))
    admitted = [r for r in phase if r.status not in (429, 503)]
    return {
        "admitted": len(admitted),
        "admitted_attainment": (sum(1 for r in admitted if meets_slo(r)) / len(admitted))
        if admitted
        else None,
        "requests": s["requests"],
        "completed": s["completed"],
        "goodput_rps": s["goodput_rps"],
        "slo_attainment": s["slo_attainment"],
        "ttft_p99_s": s["ttft_s"]["p99"],
        "ttft_p50_s": s["ttft_s"]["p50"],
        "rejections": rejected,
        "failed_other": s["failed"] - rejected,
        "errors_total": s["failed"] - rejected,
        "errors": s["errors"],
    }


STARVED_LAG_S = 0.05  # the simulator's own loop_lag_threshold_s: past it, simulated timings stretch


def starved(sim: dict[str, Any], client: dict[str, float]) -> bool:
    """A run whose simulator or client loop woke late in more than 1% of its 20 ms sleeps was short of
    CPU: its latencies are the machine's, not the fleet's."""
    return float(sim.get("loop_lag_p99_s") or 0.0) > STARVED_LAG_S or client["loop_lag_p99_s"] > STARVED_LAG_S


class LagProbe:
    """How late this process's event loop wakes a 20 ms sleeper (a starved client inflates TTFT)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while len(self.samples) < 200_000:
            t0 = time.perf_counter()
            await asyncio.sleep(0.02)
            self.samples.append(max(0.0, time.perf_counter() - t0 - 0.02))

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> dict[str, float]:
        if self.task is not None:
            self.task.cancel()
        s = self.samples or [0.0]
        return {"loop_lag_p99_s": round(percentile(s, 99) or 0.0, 4), "loop_lag_max_s": round(max(s), 4)}


async def load_phase(
    spec: dict[str, Any], fleet: FleetShape, fault: FaultPlan, stack: Stack, table: StaticTable | None
) -> tuple[dict[str, Any], float | None]:
    """Start the stack, run the schedule, inject the fault; the client's figures and the onset time."""
    contender = spec["contender"]
    warm, measured = float(spec["warm_s"]), float(spec["measure_s"])
    planned = workload(
        float(spec["rate_rps"]), float(spec["capacity_rps"]), warm + measured, warm, int(spec["seed"]), fault
    )
    schedule = oracle_schedule(fault, fleet, float(spec["capacity_rps"])) if table is not None else []
    version = [0]

    def set_table(weights: dict[str, float], limits: dict[str, int | None]) -> None:
        assert table is not None
        version[0] += 1
        table.set(oracle_table(stack.inst, weights, limits, ORACLE_WAIT_S, version[0]))

    for at, weights, limits in schedule:
        if at is None:
            set_table(weights, limits)
    onset: list[float] = []
    expired0 = [0.0]
    gone = frozenset(str(f["instance"]) for f in fault.injections if f["kind"] == "down")  # answer no scrape
    proxy_states: list[tuple[float | None, str | None]] = []
    inject_errors: list[str] = []
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t_start = time.monotonic()
    with stack:
        t_ready = time.monotonic()
        loop = asyncio.get_running_loop()
        probe = LagProbe()

        def inject() -> None:
            try:
                onset.append(time.time())
                if contender == "killed":
                    stack.kill_controller()
                for f in fault.injections:
                    stack.inject(f)
                for at, weights, limits in schedule:
                    if at is not None:
                        loop.call_later(at, set_table, weights, limits)
                expired0[0] = stack.expired_leases(gone)
            except Exception as exc:  # a callback's exception would only be logged: fail the run instead
                inject_errors.append(f"{type(exc).__name__}: {exc}")

        def sample_state() -> None:
            since = round(time.time() - onset[0], 1) if onset else None
            proxy_states.append((since, stack.proxy_state()))

        if fault.name != HEALTHY:
            loop.call_later(warm, inject)
        if contender == "killed":
            for frac in (0.1, 0.5, 0.95):
                loop.call_later(warm + frac * measured, sample_state)
        stack.reset_sim_lag()
        probe.start()
        load_from = time.time()
        results, _ = await run_load(
            LoadTarget(url=stack.proxy_url, model=MODEL),
            planned,
            timeout_s=float(spec["client_timeout_s"]),
            max_inflight=4096,
            seed=int(spec["seed"]),
        )
        if inject_errors:
            raise RuntimeError(f"the fault could not be injected: {inject_errors[0]}")
        out = measure(results, warm, measured)
        out["expired_leases"] = stack.expired_leases(gone) - expired0[0]
        out["client_lag"] = probe.stop()
        lag = stack.sim_lag() or {}
        out["sim_lag"] = {k: lag.get(k) for k in ("loop_lag_p99_s", "loop_lag_max_s", "trustworthy")}
        out["starved"] = starved(out["sim_lag"], out["client_lag"])
        out["cpu_s"] = {k: None if v is None else round(v, 2) for k, v in stack.cpu().items()}
        me = resource.getrusage(resource.RUSAGE_SELF)
        out["cpu_s"]["client"] = round(me.ru_utime + me.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 2)
        out["load_wall_s"] = round(time.monotonic() - t_ready, 2)
        if contender == "killed":
            out["proxy_states"] = proxy_states
    out["setup_s"] = round(t_ready - t_start, 2)
    out["load_from"] = load_from
    return out, onset[0] if onset else None


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    fleet = FLEETS[spec["fleet"]]
    contender = spec["contender"]
    fault = fault_plan(spec["fault"], fleet, float(spec["measure_s"]))
    fault = replace(fault, mix=str(spec.get("mix") or fault.mix))  # a capacity step's mix
    tmp = Path(tempfile.mkdtemp(prefix=f"goodput-{spec['fleet']}-{spec['fault']}-{contender}-"))
    table: StaticTable | None = StaticTable() if contender == "oracle" else None
    stack = Stack(
        StackSpec(
            fleet,
            contender,
            int(spec["sim_seed"]),
            float(spec["fail_static_s"]),
            None if table is None else table.url,
        ),
        tmp,
    )
    t_start = time.monotonic()
    ok = False
    out: dict[str, Any] = {}
    try:
        if table is not None:
            table.__enter__()
        out, onset = asyncio.run(load_phase(spec, fleet, fault, stack, table))
        if contender in CONTROLLED:
            decisions = read_decisions(stack.store_url)
            out.update(analyse(decisions, fault, onset, INTERVAL_S, out["load_from"]))
            since = onset if onset is not None else out["load_from"]
            out["prediction_error"] = prediction_error(read_predictions(stack.store_url, since))
            if spec.get("save_decisions"):
                path = Path(spec["save_decisions"])
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(
                    json.dumps(
                        {
                            "spec": spec,
                            "onset": onset,
                            "load_from": out["load_from"],
                            "fault": fault.about,
                            "decisions": jsonable(decisions),
                        },
                        indent=1,
                    )
                    + "\n"
                )
                out["decisions_file"] = str(path)
        out["wall_s"] = round(time.monotonic() - t_start, 2)
        ok = True
    finally:
        if table is not None and table.thread.is_alive():
            table.__exit__()
        if ok and not spec.get("keep_tmp"):
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            out["tmp"] = str(tmp)
            print(f"logs and store kept in {tmp}", file=sys.stderr)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m bench.goodput.worker SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    result = run_one(spec)
    Path(argv[1]).write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
