"""Push against pull: TTFT and goodput through ``pdscope proxy`` on the simulated fleet, three loads.

For each handoff mode -- ``pull`` (NixlConnector: D reads P's blocks after P answered), ``push``
(NixlPushConnector: P writes into D's blocks, D's leg sent after P's answer) and ``push_early``
(push with ``proxy.push_early``: D's leg sent with P's) -- and each load (a share of the fleet's
prefill capacity: P instances x ``prefill_tokens_per_s`` / mean prompt tokens), this starts
``pdscope sim`` (2 P + 2 D, real time) and ``pdscope proxy`` (no controller: the config's weights),
sends the same open-loop Poisson workload through the proxy for ``--measure`` seconds and reads
TTFT p50/p99, the share of requests that met the SLO and goodput (SLO-meeting requests per second).
Every figure of push and push_early is also given as a ratio to pull's at the same load, measured
in the same run. Prints a table, writes bench/results/handoff.json.

What the simulator can and cannot show: it models a write and a read of the same blocks as the
same time on the link, so push gains here only what sending D's leg early saves (the proxy's round
trip after P's answer and D's admission, overlapped with P's prefill). The 1.2-3x its authors
report for push on GPUs is not something this simulator models.

    .venv/bin/python bench/handoff.py [--loads 0.5,0.75,0.9] [--measure 20] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdscope.stack import Child, ChildGroup, free_ports, loopback_url, pdscope_argv, write_config  # noqa: E402
from simulator.loadgen import LoadTarget, run_load  # noqa: E402
from simulator.workload import LengthDist, plan, summarize  # noqa: E402

MODES = ("pull", "push", "push_early")
MODEL = "sim-llama-70b"
PREFILL_TOKENS_PER_S = 16000.0
PROMPT = "lognormal:1024,0.5"
OUTPUT = "uniform:16,64"
SLO_TTFT_S, SLO_TPOT_S = 1.0, 0.1
N_P, N_D = 2, 2


def _config(tmp: Path, mode: str, ports: list[int]) -> Path:
    """One run's pdscope.yaml: 2 P + 2 D simulated in ``mode``, the proxy in front, no controller."""
    p_ports, d_ports, (admin, proxy, dead) = ports[:N_P], ports[N_P : N_P + N_D], ports[N_P + N_D :]
    push = "pull" if mode == "pull" else "push"

    def pool(role: str, ports: list[int]) -> dict[str, Any]:
        names = [f"{role}-{i}" for i in range(len(ports))]
        instances = [{"name": n, "url": loopback_url(p)} for n, p in zip(names, ports, strict=True)]
        return {"role": role, "handoff": push, "instances": instances}

    return write_config(
        tmp / "pdscope.yaml",
        {
            "model": {"name": MODEL, "kv_bytes_per_token": 327680},
            "pools": {"prefill": pool("prefill", p_ports), "decode": pool("decode", d_ports)},
            "slo": {"ttft": {"target_ms": SLO_TTFT_S * 1000}, "tpot": {"target_ms": SLO_TPOT_S * 1000}},
            "simulator": {"transfer_mode": push, "admin_port": admin, "seed": 7},
            "proxy": {
                "port": proxy,
                "controller_url": loopback_url(dead),
                "push_early": mode == "push_early",
                "admission": {"max_inflight_requests": 4096},
                "timeouts": {"prefill_s": 30, "decode_first_token_s": 30, "decode_total_s": 60},
            },
        },
    )


def capacity_rps() -> float:
    """The fleet's prefill capacity in requests per second at the workload's mean prompt."""
    mean_prompt = 1024 * 2.718281828 ** (0.5**2 / 2)  # a lognormal's mean
    return N_P * PREFILL_TOKENS_PER_S / mean_prompt


def one_run(mode: str, rate: float, measure_s: float, seed: int) -> dict[str, Any]:
    """``mode`` at ``rate`` req/s: the services started, the load sent, its summary."""
    with tempfile.TemporaryDirectory(prefix=f"handoff-{mode}-") as tmp_name:
        tmp = Path(tmp_name)
        ports = free_ports(N_P + N_D + 3)
        config = _config(tmp, mode, ports)
        admin, proxy = ports[N_P + N_D], ports[N_P + N_D + 1]
        with ChildGroup(grace_s=10.0) as group:
            for command, ready in (("sim", f"{loopback_url(admin)}/instances"), ("proxy", None)):
                ready = ready or f"{loopback_url(proxy)}/healthz"
                argv = pdscope_argv(config, command, log_level="WARNING")
                if not group.start(Child(command, argv, tmp / f"{command}.log", ready_url=ready, cwd=REPO)):
                    raise RuntimeError(f"{command} did not start:\n{group[command].tail()}")
            planned = plan(
                "poisson",
                rate,
                int(rate * measure_s * 2) + 10,
                measure_s,
                LengthDist.parse(PROMPT),
                LengthDist.parse(OUTPUT),
                seed,
            )
            target = LoadTarget(chat=False, model=MODEL, url=loopback_url(proxy))
            results, wall = asyncio.run(run_load(target, planned, timeout_s=30.0, seed=seed))
        return summarize(results, wall, SLO_TTFT_S, SLO_TPOT_S)


def _figures(s: dict[str, Any]) -> dict[str, Any]:
    ttft = s.get("ttft_s") or {}
    return {
        "requests": s["requests"],
        "failed": s["failed"],
        "errors": s.get("errors") or {},
        "ttft_p50_s": ttft.get("p50"),
        "ttft_p99_s": ttft.get("p99"),
        "slo_share": s.get("slo_attainment"),
        "goodput_rps": s.get("goodput_rps"),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def _table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'load':>5} {'mode':<11} {'req':>5} {'fail':>4} {'TTFT p50':>9} {'p99':>7} {'SLO':>6} "
        f"{'goodput':>8}  {'p50/pull':>8} {'p99/pull':>8} {'good/pull':>9}"
    )
    for r in rows:

        def num(v: float | None, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)

        print(
            f"{r['load']:>5.0%} {r['mode']:<11} {r['requests']:>5} {r['failed']:>4} "
            f"{num(r['ttft_p50_s'], '.3f'):>9} {num(r['ttft_p99_s'], '.3f'):>7} "
            f"{num(r['slo_share'], '.1%'):>6} {num(r['goodput_rps'], '.2f'):>8}  "
            f"{num(r.get('p50_vs_pull'), '.3f'):>8} {num(r.get('p99_vs_pull'), '.3f'):>8} "
            f"{num(r.get('goodput_vs_pull'), '.3f'):>9}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--loads", default="0.5,0.75,0.9", help="shares of the prefill capacity (default 0.5,0.75,0.9)"
    )
    ap.add_argument("--measure", type=float, default=20.0, help="seconds of load per run (default 20)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "handoff.json"))
    a = ap.parse_args(argv)
    loads = [float(x) for x in a.loads.split(",") if x.strip()]
    cap = capacity_rps()
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    total = len(loads) * len(MODES)
    for load in loads:
        base: dict[str, Any] | None = None
        for mode in MODES:
            print(f"[{len(rows) + 1}/{total}] {mode} at {load:.0%} ({load * cap:.1f} req/s) ...", flush=True)
            fig = _figures(one_run(mode, load * cap, a.measure, a.seed))
            row = {"load": load, "rate_rps": round(load * cap, 2), "mode": mode, **fig}
            if base is None:
                base = row
            else:
                row["p50_vs_pull"] = _ratio(row["ttft_p50_s"], base["ttft_p50_s"])
                row["p99_vs_pull"] = _ratio(row["ttft_p99_s"], base["ttft_p99_s"])
                row["goodput_vs_pull"] = _ratio(row["goodput_rps"], base["goodput_rps"])
            rows.append(row)
    _table(rows)
    out = {
        "bench": "handoff",
        "fleet": f"{N_P}P+{N_D}D simulated",
        "capacity_rps": round(cap, 2),
        "prompt": PROMPT,
        "output": OUTPUT,
        "slo": {"ttft_s": SLO_TTFT_S, "tpot_s": SLO_TPOT_S},
        "measure_s": a.measure,
        "seed": a.seed,
        "rows": rows,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
