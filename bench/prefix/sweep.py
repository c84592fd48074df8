"""The prefix benchmark's load sweep (``python -m bench.prefix --sweep``), declared before any run.

For every shared-prefix workload (all but ``unique``, or ``--workloads``): one load_only calibration
run (``run.calibrate``: the load at which load_only's P pool is 95 % busy at the reuse it gets, its
capacity, 1.0x below), then every contender (default load_only, approximate, precise; the oracle when
named) at 0.85x, 1.0x, 1.3x and 1.6x of it, each on a fresh fleet. The verdict of a cell is the
approximate mode's goodput over the precise mode's at that load, PASS at 0.9 or more (issue 33).

Bounded: every cell is ``--warm`` + ``--measure`` seconds of load, plus the fleet's start and at most
the client's timeout; ``--max-wall`` stops starting cells past it (each cell not run is listed). One
progress line per cell; the results are written after every cell, so a stopped sweep keeps its part.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from bench.prefix import report
from bench.prefix.run import SWEEP_LOADS, RouterChoice, calibrate, plan_for, run_one
from bench.prefix.stack import CONTENDERS
from bench.prefix.workloads import mean_prompt_tokens, request_tokens

APPROX_OF_PRECISE = 0.9
DEFAULT_CONTENDERS = ("load_only", "approximate", "precise")
KEEP = (
    "goodput_rps",
    "offered_rps",
    "slo_attainment",
    "p_hit_rate",
    "reuse",
    "ttft_p50_s",
    "ttft_p99_s",
    "decode_only_share",
    "errors",
    "kv_checks",
    "wall_s",
    "sim_trustworthy",
    "error",
    "missing",
)


def _cell(
    w: str, x: float, load: float, contenders: list[str], args: argparse.Namespace, router: RouterChoice
) -> dict[str, Any]:
    planned, rate = plan_for(w, load * x, args.warm + args.measure, args.seed)
    row: dict[str, Any] = {"x": x, "load": round(load * x, 3), "rate_rps": round(rate, 2)}
    row["requests_planned"] = len(request_tokens(planned))
    row["mean_prompt_tokens"] = round(mean_prompt_tokens(planned), 1)
    for c in contenders:
        r = run_one(w, c, planned, args.warm, args.measure, args.seed, router, args.fleet)
        row[c] = {k: v for k, v in r.items() if k in KEEP}
        print(f"   {w} {x:.2f}x {report.progress_line(c, r)}", flush=True)
    base = row.get("load_only", {}).get("goodput_rps")
    a, p = row.get("approximate", {}).get("goodput_rps"), row.get("precise", {}).get("goodput_rps")
    row["approx_of_precise"] = a / p if a is not None and p else None
    row["approx_x_load_only"] = a / base if a is not None and base else None
    row["precise_x_load_only"] = p / base if p is not None and base else None
    ratio = row["approx_of_precise"]
    row["verdict"] = "n/a" if ratio is None else ("PASS" if ratio >= APPROX_OF_PRECISE else "MISS")
    return row


def table(result: dict[str, Any]) -> str:
    """The sweep as Markdown: one row per workload and load."""
    lines = [
        "| workload | load (x load_only capacity) | goodput load_only / approximate / precise (req/s) "
        "| approximate ÷ precise | ≥ 0.9 | P hit approximate / precise | approx. x load_only |",
        "|---|---|---|---|---|---|---|",
    ]
    f = report.fmt
    for w, rows in result["cells"].items():
        for row in rows:
            g = [f(row.get(c, {}).get("goodput_rps")) for c in ("load_only", "approximate", "precise")]
            hits = [f(row.get(c, {}).get("p_hit_rate")) for c in ("approximate", "precise")]
            lines.append(
                f"| {w} | {row['x']:.2f} ({f(row.get('rate_rps'))}/s) | {' / '.join(g)} "
                f"| {f(row.get('approx_of_precise'))} | {row.get('verdict')} | {' / '.join(hits)} "
                f"| {f(row.get('approx_x_load_only'))} |"
            )
    if result.get("not_run"):
        lines += ["", "Not run (past --max-wall): " + ", ".join(result["not_run"])]
    return "\n".join(lines)


def sweep(
    args: argparse.Namespace, workloads: list[str], contenders: list[str], argv: list[str] | None
) -> int:
    if contenders == list(CONTENDERS):  # the default: the sweep's own three
        contenders = list(DEFAULT_CONTENDERS)
    router = RouterChoice()
    t0 = time.monotonic()
    result: dict[str, Any] = {
        "command": "python -m bench.prefix " + " ".join(argv if argv is not None else sys.argv[1:]),
        "settings": {**report.settings(args), "loads": list(SWEEP_LOADS), "threshold": APPROX_OF_PRECISE},
        "calibration": {},
        "cells": {},
        "not_run": [],
    }

    def write() -> None:
        result["wall_s"] = round(time.monotonic() - t0, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=float) + "\n")

    for w in workloads:
        if args.max_wall is not None and time.monotonic() - t0 > args.max_wall:
            result["not_run"] += [f"{w} (all loads)"]
            continue
        load, cal = (args.load, {}) if args.load is not None else calibrate(w, args, router, t0)
        got = {f"calibration_{k}": v for k, v in cal.items() if k != "run"}
        result["calibration"][w] = {"load": round(load, 3), **got}
        result["cells"][w] = []
        for x in SWEEP_LOADS:
            if args.max_wall is not None and time.monotonic() - t0 > args.max_wall:
                result["not_run"].append(f"{w} {x}x")
                continue
            result["cells"][w].append(_cell(w, x, load, contenders, args, router))
            print(f"== {w} {x:.2f}x done [{time.monotonic() - t0:5.0f}s]", flush=True)
            write()
    write()
    print()
    print(table(result))
    print(f"\nwrote {args.out}")
    return 0
