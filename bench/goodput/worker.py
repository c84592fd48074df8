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
from bench.goodput.decisions import REACTION_TICKS, analyse, jsonable, read_decisions
from bench.goodput.explained import top_reason
from bench.goodput.oracle import ORACLE_WAIT_S, StaticTable, oracle_schedule, oracle_table
from bench.goodput.pairs import fault_pair, pair_share, read_pair_counts
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


class _OracleTables:
    """The oracle's hand-set tables (``oracle_schedule``) served from ``table``: those from the start of
    the run at once, the rest ``at`` seconds after the fault's onset; nothing for the other contenders."""

    def __init__(
        self,
        spec: dict[str, Any],
        fleet: FleetShape,
        fault: FaultPlan,
        stack: Stack,
        table: StaticTable | None,
    ) -> None:
        self.stack, self.table = stack, table
        self.schedule = (
            oracle_schedule(fault, fleet, float(spec["capacity_rps"])) if table is not None else []
        )
        self.version = 0
        for at, weights, limits in self.schedule:
            if at is None:
                self.set(weights, limits)

    def set(self, weights: dict[str, float], limits: dict[str, int | None]) -> None:
        assert self.table is not None
        self.version += 1
        self.table.set(oracle_table(self.stack.inst, weights, limits, ORACLE_WAIT_S, self.version))

    def after_onset(self, loop: asyncio.AbstractEventLoop) -> None:
        for at, weights, limits in self.schedule:
            if at is not None:
                loop.call_later(at, self.set, weights, limits)


class _Onset:
    """The fault's onset on the client's loop, ``warm_s`` into the run: the injections (the killed
    contender's controller SIGKILLed first, the oracle's later tables scheduled), the leases expired so
    far, and the killed contender's proxy states sampled through the measured phase."""

    def __init__(self, contender: str, fault: FaultPlan, stack: Stack, oracle: _OracleTables) -> None:
        self.contender, self.fault, self.stack, self.oracle = contender, fault, stack, oracle
        self.at: float | None = None
        self.expired0 = 0.0
        # the instances the fault takes down: they answer no scrape
        self.gone = frozenset(str(f["instance"]) for f in fault.injections if f["kind"] == "down")
        self.proxy_states: list[tuple[float | None, str | None]] = []
        self.errors: list[str] = []

    def schedule(self, loop: asyncio.AbstractEventLoop, warm: float, measured: float) -> None:
        if self.fault.name != HEALTHY:
            loop.call_later(warm, self.inject, loop)
        if self.contender == "killed":
            for frac in (0.1, 0.5, 0.95):
                loop.call_later(warm + frac * measured, self.sample_state)

    def inject(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            self.at = time.time()
            if self.contender == "killed":
                self.stack.kill_controller()
            for f in self.fault.injections:
                self.stack.inject(f)
            self.oracle.after_onset(loop)
            self.expired0 = self.stack.expired_leases(self.gone)
        except Exception as exc:  # a callback's exception would only be logged: fail the run instead
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def sample_state(self) -> None:
        since = round(time.time() - self.at, 1) if self.at is not None else None
        self.proxy_states.append((since, self.stack.proxy_state()))

    def expired_leases(self) -> float:
        """The leases expired since the onset (on the instances the fault did not take down)."""
        return self.stack.expired_leases(self.gone) - self.expired0


def _run_checks(stack: Stack, probe: LagProbe, cpu0: resource.struct_rusage) -> dict[str, Any]:
    """Whether the run was starved (the simulator's and this client's loop lag) and the CPU seconds
    of each service and of this client since ``cpu0``."""
    out: dict[str, Any] = {"client_lag": probe.stop()}
    lag = stack.sim_lag() or {}
    out["sim_lag"] = {k: lag.get(k) for k in ("loop_lag_p99_s", "loop_lag_max_s", "trustworthy")}
    out["starved"] = starved(out["sim_lag"], out["client_lag"])
    out["cpu_s"] = {k: None if v is None else round(v, 2) for k, v in stack.cpu().items()}
    me = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"]["client"] = round(me.ru_utime + me.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 2)
    return out


async def load_phase(
    spec: dict[str, Any], fleet: FleetShape, fault: FaultPlan, stack: Stack, table: StaticTable | None
) -> tuple[dict[str, Any], float | None]:
    """Start the stack, run the schedule, inject the fault; the client's figures and the onset time."""
    contender = spec["contender"]
    warm, measured = float(spec["warm_s"]), float(spec["measure_s"])
    planned = workload(
        float(spec["rate_rps"]), float(spec["capacity_rps"]), warm + measured, warm, int(spec["seed"]), fault
    )
    onset = _Onset(contender, fault, stack, _OracleTables(spec, fleet, fault, stack, table))
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t_start = time.monotonic()
    with stack:
        t_ready = time.monotonic()
        probe = LagProbe()
        onset.schedule(asyncio.get_running_loop(), warm, measured)
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
        if onset.errors:
            raise RuntimeError(f"the fault could not be injected: {onset.errors[0]}")
        out = measure(results, warm, measured)
        out["expired_leases"] = onset.expired_leases()
        out |= _run_checks(stack, probe, cpu0)
        out["load_wall_s"] = round(time.monotonic() - t_ready, 2)
        if contender == "killed":
            out["proxy_states"] = onset.proxy_states
    out["setup_s"] = round(t_ready - t_start, 2)
    out["load_from"] = load_from
    return out, onset.at


def _blame_figures(
    spec: dict[str, Any],
    fleet: FleetShape,
    fault: FaultPlan,
    stack: Stack,
    onset: float | None,
    load_from: float,
) -> dict[str, Any]:
    """A controlled run's figures from its store besides its decisions: the predictor's error, a pair
    fault's traffic through the pair (:mod:`bench.goodput.pairs`) and explain's top reason over the
    faulty phase (:mod:`bench.goodput.explained`)."""
    since = onset if onset is not None else load_from
    out: dict[str, Any] = {"prediction_error": prediction_error(read_predictions(stack.store_url, since))}
    pair = fault_pair(fault.injections)
    if pair is not None and onset is not None:
        counts = read_pair_counts(stack.store_url, onset + REACTION_TICKS * INTERVAL_S)
        out["pair_share"] = pair_share(counts, pair, fleet.n_p * fleet.n_d)
    if onset is not None:
        out["explain_top"] = top_reason(
            stack.store_url, stack.config, onset, onset + float(spec["measure_s"])
        )
    return out


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
            str(spec.get("handoff") or "pull"),
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
            out.update(_blame_figures(spec, fleet, fault, stack, onset, out["load_from"]))
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
