"""Fleet benchmark: 3 proxies, 2 controllers and 2 collectors on PostgreSQL, against a simulated
8P+16D fleet (``--quick``: 2P+4D), under a seeded open-loop burst at 1.5x the pools' limit.

Three contenders, the same workload, each on a fresh database (``tests/support/fleet.py`` runs the
processes):

- ``apportioned``: the fleet as deployed; the leader controller is killed (-9) in the middle of the
  burst, and the standby's takeover is timed (kill to its ``/healthz`` saying leader with a tick).
- ``naive``: 3 proxies and no controller (they poll a dead address, ``expected_replicas: 1``):
  each admits the config's whole limit, the behaviour before apportioning; the baseline.
- ``one_proxy``: the same fleet behind 1 proxy: the goodput the 3 proxies are compared with.

Measured: the largest sum across proxies of ``pdscope_proxy_pool_inflight_requests{pool}``
(sampled every 50 ms, all proxies read at once) against each pool's limit; outcomes (ok, 429,
other failures); goodput (requests ok within ``slo_e2e_s`` per second of the burst); records lost
(client requests answered 200 whose request record is not in the store once the collectors have
drained). The burst rate comes from a calibration in the same run (Little's law on the median
unqueued latency of a few requests one at a time). Prints a table, writes
``bench/results/fleet.json`` (``--quick``: ``fleet-quick.json``).

PostgreSQL: ``$PDSCOPE_TEST_PG_URL`` (an admin URL), else a private server started with
``scripts/pg-test.sh`` on a free port and stopped at the end.

Run: ``.venv/bin/python -m bench.fleet.run`` (about 4 minutes on 2 cores) or ``--quick`` (~1.5).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: the repository's packages (bench, tests) by name
    sys.path.insert(0, str(REPO))

from bench.fleet.report import (  # noqa: E402
    FULL,
    QUICK,
    Plan,
    RunResult,
    burst_rate,
    median,
    percentiles,
    summary,
    table,
)
from tests.support.fleet import Fleet, FleetShape, InflightSampler, Load, Sent  # noqa: E402
from tests.support.sockets import free_port  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402

# Long engine steps and few tokens: a request takes ~1-2 s as on a GPU, for a tenth of the simulator's
# CPU (it runs 24 instances in one process on a 2-core machine shared with the rest of the fleet)
SIM = {"step_overhead_s": 0.08, "decode_per_seq_s": 0.002}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@contextmanager
def postgres() -> Iterator[str]:
    url = os.environ.get("PDSCOPE_TEST_PG_URL")
    if url:
        yield url.replace("postgresql+psycopg://", "postgresql://")
        return
    folder = Path(tempfile.mkdtemp(prefix="pdscope-bench-pg-"))
    folder.chmod(0o755)
    env = {**os.environ, "PDSCOPE_PG_PORT": str(free_port()), "PDSCOPE_PG_DIR": str(folder / "cluster")}
    script = [str(REPO / "scripts" / "pg-test.sh")]
    out = subprocess.run([*script, "start"], env=env, capture_output=True, text=True, timeout=120, check=True)
    try:
        yield out.stdout.strip()
    finally:
        subprocess.run([*script, "stop"], env=env, capture_output=True, timeout=60, check=False)
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def database(admin: str) -> Iterator[str]:
    import psycopg

    name = f"pdscope_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{admin.rsplit('/', 1)[0]}/{name}"
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def shape_for(plan: Plan, contender: str) -> FleetShape:
    base = FleetShape(
        prefill=plan.prefill,
        decode=plan.decode,
        proxies=1 if contender == "one_proxy" else 3,
        interval_s=1.0,
        scrape_interval_s=1.0,
        routing_poll_s=0.25,
        max_inflight_requests=plan.limit,
        queue_timeout_s=0.5,
        seed=plan.seed,
        simulator=SIM,
        controller={"window_s": 10.0, "proxy_ttl_s": 1.0, "proxy_share_window_s": 5.0},
    )
    if contender == "naive":
        return replace(base, controllers=0, naive=True)
    return base


def calibrate(f: Fleet, plan: Plan) -> float:
    """The median latency of a few requests with the fleet otherwise idle (a quarter of the limit in
    flight at most, so none queues): a request's service time."""
    lat: list[float] = []
    wave = max(1, min(8, plan.limit // 4))
    for _ in range(max(1, plan.calibrate_requests // wave)):
        with Load(
            f.proxy_urls,
            rate=1000,
            max_requests=wave,
            duration_s=5,
            prompt_tokens=plan.prompt_tokens,
            max_tokens=plan.max_tokens,
        ) as batch:
            pass
        lat += [r.ended - r.sent for r in batch.results if r.ok]
    if len(lat) < plan.calibrate_requests // 2:
        raise RuntimeError(f"calibration: only {len(lat)} of {plan.calibrate_requests} requests succeeded")
    return median(lat)


def records_of(f: Fleet, results: list[Sent]) -> tuple[int, int]:
    """Requests answered 200 with a request id, and how many of those have a stored record once the
    collectors have drained (the stored count stops growing)."""
    rids = [r.request_id for r in results if r.ok and r.request_id]
    if not rids:
        return 0, 0

    def stored() -> int:
        rows = f.query("SELECT count(*) FROM request_records WHERE request_id = ANY(:ids)", ids=rids)
        return int(rows[0][0])

    last = [-1]

    def settled() -> bool:
        now = stored()
        done = now == len(rids) or now == last[0]
        last[0] = now
        return done

    wait_until("the collectors to store the records", settled, timeout_s=60, every_s=2.0)
    return len(rids), stored()


def kill_leader_mid_burst(f: Fleet, contender: str, plan: Plan, t0: float) -> float:
    """Kill the leader controller (-9) half-way through the burst; seconds until the standby leads."""
    wait_until("half the burst", time.monotonic, done=lambda t: t >= t0 + plan.burst_s / 2, every_s=0.1)
    leader = f.wait_for_leader()
    standby = next(c for c in f.controllers if c is not leader)
    t_kill = time.monotonic()
    leader.kill9()
    wait_until(
        "the standby to take over",
        standby.health,
        done=lambda h: h["role"] == "leader" and h["last_success"] is not None,
        timeout_s=60,
        every_s=0.05,
        ignore=(OSError, ValueError, Exception),
    )
    takeover = time.monotonic() - t_kill
    log(f"{contender}: leader takeover {takeover:.2f}s after kill -9")
    return takeover


def run_result(
    plan: Plan,
    contender: str,
    f: Fleet,
    rate: float,
    wall: float,
    results: list[Sent],
    sampler: InflightSampler,
    takeover: float | None,
) -> RunResult:
    """One contender's figures, once its burst is over."""
    sim_stats = httpx.get(f.admin_url + "/stats", timeout=5).json()
    reasons: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = f"{r.status}:{reason_of(r.error)}"
            reasons[key] = reasons.get(key, 0) + 1
    expected, stored = records_of(f, results) if f.collectors else (0, 0)
    ok = [r for r in results if r.ok]
    return RunResult(
        contender=contender,
        proxies=len(f.proxies),
        rate=rate,
        sent=len(results),
        ok=len(ok),
        rejected=sum(1 for r in results if r.status == 429),
        failed=sum(1 for r in results if not r.ok and r.status != 429),
        good=sum(1 for r in ok if r.ended - r.sent <= plan.slo_e2e_s),
        wall_s=wall,
        burst_s=plan.burst_s,
        not_ok=reasons,
        sim_loop_lag_max_s=float(sim_stats.get("loop_lag_max_s", 0.0)),
        e2e_ok_s=percentiles([r.ended - r.sent for r in ok]),
        peak_inflight={pool: sampler.peak(pool) for pool in ("prefill", "decode")},
        samples=len(sampler.samples),
        takeover_s=takeover,
        records_expected=expected if contender == "apportioned" else None,
        records_stored=stored if contender == "apportioned" else None,
    )


def one_run(
    plan: Plan, contender: str, admin: str, workdir: Path, rate: float | None
) -> tuple[RunResult, float]:
    with database(admin) as store, Fleet(shape_for(plan, contender), store, workdir / contender) as f:
        log(f"{contender}: fleet up ({len(f.proxies)} proxies, {len(f.controllers)} controllers)")
        service_s = calibrate(f, plan)
        if rate is None:
            rate = burst_rate(plan.limit, service_s, plan.factor)
        log(f"{contender}: service {service_s * 1000:.0f} ms; burst {rate:.1f} req/s for {plan.burst_s:g}s")
        takeover: float | None = None
        t0 = time.monotonic()
        with (
            InflightSampler(f.proxies) as sampler,
            Load(
                f.proxy_urls,
                rate=rate,
                max_requests=int(rate * plan.burst_s * 1.2) + 10,
                duration_s=plan.burst_s,
                prompt_tokens=plan.prompt_tokens,
                max_tokens=plan.max_tokens,
                seed=plan.seed,
            ) as load,
        ):
            if f.controllers:  # the same fault for the fleet and for one proxy: the leader killed mid-burst
                takeover = kill_leader_mid_burst(f, contender, plan, t0)
        wall = time.monotonic() - t0
        res = run_result(plan, contender, f, rate, wall, load.results, sampler, takeover)
        log(
            f"{contender}: {res.ok}/{res.sent} ok, peaks {dict(res.peak_inflight)}, "
            f"e2e of the ok {res.e2e_ok_s}"
        )
        return res, service_s


def reason_of(error: str | None) -> str:
    """The proxy's reason for a failure (its error body's type or code), else the error's first word."""
    if not error:
        return ""
    try:
        body = json.loads(error)
    except ValueError:
        return error.split(":", 1)[0][:40]
    err = body.get("error", body) if isinstance(body, dict) else {}
    if not isinstance(err, dict):
        return str(err)[:40]
    return str(err.get("code") or err.get("type") or "")[:40]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2P+4D, a 6 s burst")
    ap.add_argument(
        "--out", default=None, help="where the JSON goes (default bench/results/fleet[-quick].json)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the fleets' configs and logs (printed)")
    a = ap.parse_args()
    plan = QUICK if a.quick else FULL
    out = Path(a.out or REPO / "bench" / "results" / ("fleet-quick.json" if a.quick else "fleet.json"))
    workdir = Path(tempfile.mkdtemp(prefix="pdscope-bench-fleet-"))
    runs: dict[str, RunResult] = {}
    started = time.monotonic()
    load_start = list(os.getloadavg())
    log(f"load average at the start: {load_start} ({os.cpu_count()} CPUs)")
    try:
        with postgres() as admin:
            first, service_s = one_run(plan, "apportioned", admin, workdir, None)
            runs["apportioned"] = first
            for contender in ("naive", "one_proxy"):  # the same arrivals: the same rate and seed
                runs[contender], _ = one_run(plan, contender, admin, workdir, first.rate)
    finally:
        if a.keep:
            print(f"configs and logs: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    doc = summary(plan, runs, service_s)
    doc["wall_s"] = time.monotonic() - started
    doc["load_average"] = {"start": load_start, "end": list(os.getloadavg())}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    print(table(plan, runs))
    print(json.dumps(doc["figures"], indent=2))
    print(f"wrote {out} ({doc['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
