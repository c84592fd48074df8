"""Ratios, targets and tables of the goodput bench (pure: dicts in, dicts and text out).

Targets per cell (issue 14, "Benchmark and targets"), all from contenders of the same run:

* ``do_no_harm``      controller / static >= 0.98
* ``near_oracle``     controller / oracle >= 0.9
* ``captures_gain``   where the oracle beats static by >= 10 %:
                      (controller - static) / (oracle - static) >= 0.7
* ``alone_vs_rr``     killed / round_robin >= 1.0 (the proxy alone, its controller SIGKILLed at onset)
* ``no_healthy_cuts`` the controller cut no healthy instance below 0.9 and no limit the fault does
                      not call for
* ``burst_p99``       burst cells: the controller's served p99 TTFT within the TTFT SLO

A target is PASS, MISS, or ``-`` (not applicable, or a contender it needs is missing or failed).
"""

from __future__ import annotations

import math
from typing import Any

TARGETS = {
    "do_no_harm": "controller / static >= 0.98",
    "near_oracle": "controller / oracle >= 0.9",
    "captures_gain": "captured share of the oracle's gain over static >= 70% (where that gain >= 10%)",
    "alone_vs_rr": "killed / round robin >= 1.0",
    "no_healthy_cuts": "zero cuts of healthy instances (weights < 0.9, uncalled-for limit cuts)",
    "burst_p99": "burst: the controller's served p99 TTFT <= the TTFT SLO",
}
DO_NO_HARM, NEAR_ORACLE, CAPTURE, GAIN_FLOOR, ALONE = 0.98, 0.9, 0.7, 0.10, 1.0


def _goodput(res: dict[str, Any], contender: str) -> float | None:
    r = res.get(contender)
    if not r or "error" in r:
        return None
    return float(r["goodput_rps"])


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    if b == 0:
        return None if a == 0 else math.inf
    return a / b


def cell_targets(
    fault: str, res: dict[str, dict[str, Any]], slo_ttft_s: float
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``res``: contender -> result. Returns (ratios, targets) where each target is
    ``{"value": ..., "status": "PASS" | "MISS" | "-"}``."""
    ctl, st, orc = _goodput(res, "controller"), _goodput(res, "static"), _goodput(res, "oracle")
    rr, killed = _goodput(res, "round_robin"), _goodput(res, "killed")
    gain = None if st is None or orc is None else _ratio(orc - st, st) if st else (math.inf if orc else 0.0)
    captured = None
    if ctl is not None and st is not None and orc is not None and orc > st:
        captured = (ctl - st) / (orc - st)
    ratios = {
        "controller_vs_static": _ratio(ctl, st),
        "controller_vs_oracle": _ratio(ctl, orc),
        "oracle_gain_over_static": gain,
        "captured_share": captured,
        "killed_vs_round_robin": _ratio(killed, rr),
        "static_vs_round_robin": _ratio(st, rr),
    }

    def judge(value: float | None, ok: bool | None) -> dict[str, Any]:
        return {"value": value, "status": "-" if ok is None else "PASS" if ok else "MISS"}

    c = ratios["controller_vs_static"]
    o = ratios["controller_vs_oracle"]
    k = ratios["killed_vs_round_robin"]
    targets = {
        "do_no_harm": judge(c, None if c is None else c >= DO_NO_HARM),
        "near_oracle": judge(o, None if o is None else o >= NEAR_ORACLE),
        "captures_gain": judge(
            captured, None if gain is None or gain < GAIN_FLOOR or captured is None else captured >= CAPTURE
        ),
        "alone_vs_rr": judge(k, None if k is None else k >= ALONE),
    }
    r = res.get("controller") or {}
    cuts = None if "error" in r or "healthy_cuts" not in r else int(r["healthy_cuts"])
    targets["no_healthy_cuts"] = judge(cuts, None if cuts is None else cuts == 0)
    p99 = r.get("ttft_p99_s") if "error" not in r else None
    targets["burst_p99"] = judge(p99, None if fault != "burst" or p99 is None else p99 <= slo_ttft_s)
    return ratios, targets


def summary(cells: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, what in TARGETS.items():
        st = [(cell, c["targets"][name]["status"]) for cell, c in cells.items() if "targets" in c]
        out[name] = {
            "target": what,
            "pass": sum(1 for _, s in st if s == "PASS"),
            "miss": sum(1 for _, s in st if s == "MISS"),
            "missed_cells": [cell for cell, s in st if s == "MISS"],
        }
    return out


def fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}s"


def fmt_x(v: float | None) -> str:
    return "-" if v is None else "inf" if math.isinf(v) else f"{v:.2f}"


def contender_line(cell: str, contender: str, r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{cell:30s} {contender:11s} FAILED: {str(r['error'])[:80]}"
    react = r.get("reaction_ticks")
    cuts = r.get("healthy_cuts")
    mark = "!" if r.get("starved") else " "
    return (
        f"{cell:30s} {contender:10s}{mark} {r['goodput_rps']:9.2f} {r['slo_attainment'] * 100:6.1f} "
        f"{fmt_s(r['ttft_p99_s']):>8s} {r['errors_total']:6d} {r['rejections']:8d} "
        f"{r['expired_leases']:7.0f} "
        f"{'-' if react is None else str(react) + 't':>6s} {'-' if cuts is None else cuts:>5}"
    )


HEADER = (
    f"{'cell':30s} {'contender':11s} {'goodput/s':>9s} {'SLO %':>6s} {'p99 TTFT':>8s} {'errors':>6s} "
    f"{'rejected':>8s} {'expired':>7s} {'react':>6s} {'cuts':>5s}"
)


def targets_line(targets: dict[str, Any]) -> str:
    parts = []
    for name in TARGETS:
        t = targets[name]
        if t["status"] == "-":
            continue
        v = t["value"]
        shown = (
            f"{v * 100:.0f}%"
            if name == "captures_gain"
            else fmt_s(v)
            if name == "burst_p99"
            else str(v)
            if name == "no_healthy_cuts"
            else fmt_x(v)
        )
        parts.append(f"{name} {shown} {t['status']}")
    return "    targets: " + ("  ".join(parts) if parts else "none applicable")


def table(out: dict[str, Any]) -> str:
    lines = [
        f"SLO TTFT {out['slo']['ttft_s']} s, TPOT {out['slo']['tpot_s']} s; warm {out['warm_s']} s, "
        f"measured {out['measured_s']} s; capacity "
        + ", ".join(f"{f} {v['capacity_rps']:g} req/s" for f, v in out["fleets"].items()),
        HEADER,
    ]
    for cell, c in out["cells"].items():
        for contender, r in c["contenders"].items():
            lines.append(contender_line(cell, contender, r))
        lines.append(targets_line(c["targets"]))
    starved = [
        f"{cell} {c}"
        for cell, v in out["cells"].items()
        for c, r in v["contenders"].items()
        if r.get("starved")
    ]
    lines.append("")
    if starved:
        lines.append(
            f"! starved of CPU (simulator or client loop lag p99 > 50 ms), figures distorted: "
            f"{', '.join(starved)}"
        )
    lines.append("targets over all cells:")
    for name, s in out["summary"].items():
        lines.append(
            f"  {name:16s} {s['pass']:3d} PASS {s['miss']:3d} MISS  ({s['target']})"
            + (f"  missed: {', '.join(s['missed_cells'])}" if s["missed_cells"] else "")
        )
    return "\n".join(lines)


def healthy_table(out: dict[str, Any]) -> str:
    lines = [
        f"healthy runs, {out['measured_s']:g} s each (after {out['warm_s']:g} s warm-up); "
        f"a PASS has no weight cut below 0.9 and no limit cut",
        f"{'run':28s} {'goodput/s':>9s} {'SLO %':>6s} {'p99 TTFT':>8s} {'errors':>6s} {'w<0.9':>6s} "
        f"{'limits':>6s} {'startup':>7s} {'verdict':>7s}  reasons",
    ]
    for name, r in out["runs"].items():
        if "error" in r:
            lines.append(f"{name:28s} FAILED: {str(r['error'])[:80]}")
            continue
        verdict = "PASS" if r["healthy_cuts"] == 0 else "MISS"
        mark = "!" if r.get("starved") else " "
        lines.append(
            f"{name:27s}{mark} {r['goodput_rps']:9.2f} {r['slo_attainment'] * 100:6.1f} "
            f"{fmt_s(r['ttft_p99_s']):>8s} {r['errors_total']:6d} {r['healthy_weight_cuts']:6d} "
            f"{r['unexpected_limit_cuts']:6d} {r.get('startup_cuts', 0):7d} {verdict:>7s}  "
            f"{', '.join(f'{k} x{v}' for k, v in sorted(r['cut_reasons'].items())) or '-'}"
        )
    s = out["summary"]
    lines.append(
        f"quiet when healthy: {s['pass']} PASS, {s['miss']} MISS; weight cuts < 0.9: {s['weight_cuts']}, "
        f"limit cuts: {s['limit_cuts']} (startup cuts, before the first request, apart: "
        f"{s.get('startup_cuts', 0)})"
    )
    if any(r.get("starved") for r in out["runs"].values()):
        lines.append(
            "! starved of CPU (simulator or client loop lag p99 > 50 ms): its cuts may be the machine's"
        )
    return "\n".join(lines)


def markdown(out: dict[str, Any]) -> str:
    """The matrix as the Markdown table of ``docs/goodput.md`` (goodput in requests/s; ✗ a missed
    target, – one that does not apply)."""
    cols = ("round_robin", "static", "controller", "oracle", "killed")
    lines = [
        "| cell | RR | static | **controller** | oracle | killed | ctl/static | ctl/oracle | gain captured "
        "| killed/RR | reaction | healthy cuts | ctl p99 TTFT |",
        "|" + "---|" * 13,
    ]

    def mark(t: dict[str, Any] | None, text: str) -> str:
        if t is None or t.get("status") == "-":
            return "–"
        return text + (" ✗" if t.get("status") == "MISS" else "")

    for cell, c in out["cells"].items():
        got = c["contenders"]
        t = c["targets"]
        gp = [
            f"{got[k]['goodput_rps']:.2f}" if got.get(k, {}).get("goodput_rps") is not None else "–"
            for k in cols
        ]
        ctl = got.get("controller", {})
        gain = t.get("captures_gain", {})
        lines.append(
            "| "
            + " | ".join(
                [
                    cell,
                    gp[0],
                    gp[1],
                    f"**{gp[2]}**",
                    gp[3],
                    gp[4],
                    mark(t.get("do_no_harm"), fmt_x(t.get("do_no_harm", {}).get("value"))),
                    mark(t.get("near_oracle"), fmt_x(t.get("near_oracle", {}).get("value"))),
                    mark(gain, f"{gain['value'] * 100:.0f}%" if gain.get("value") is not None else "–"),
                    mark(t.get("alone_vs_rr"), fmt_x(t.get("alone_vs_rr", {}).get("value"))),
                    f"{c['reaction_ticks']}t" if c.get("reaction_ticks") is not None else "–",
                    mark(t.get("no_healthy_cuts"), str(t.get("no_healthy_cuts", {}).get("value"))),
                    fmt_s(ctl.get("ttft_p99_s"))
                    + (" ✗" if t.get("burst_p99", {}).get("status") == "MISS" else ""),
                ]
            )
            + " |"
        )
    lines.append("")
    for name, sm in out["summary"].items():
        lines.append(f"- `{name}`: {sm['pass']} pass, {sm['miss']} miss")
    return "\n".join(lines)


def healthy_markdown(out: dict[str, Any]) -> str:
    """The healthy runs as a Markdown table."""
    lines = [
        "| run | goodput/s | SLO attainment | p99 TTFT | weight cuts < 0.9 | limit cuts | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in out["runs"].items():
        if "error" in r:
            lines.append(f"| {name} | failed: {str(r['error'])[:60]} | | | | | MISS |")
            continue
        reasons = ", ".join(f"`{k}` ×{v}" for k, v in sorted(r["cut_reasons"].items()))
        lines.append(
            f"| {name} | {r['goodput_rps']:.2f} | {r['slo_attainment'] * 100:.1f} % "
            f"| {fmt_s(r['ttft_p99_s'])} | {r['healthy_weight_cuts']} "
            f"| {r['unexpected_limit_cuts']}{f' ({reasons})' if reasons else ''} "
            f"| {'PASS' if r['healthy_cuts'] == 0 else 'MISS'}{' (starved)' if r.get('starved') else ''} |"
        )
    return "\n".join(lines)


# -- time budget ---------------------------------------------------------------------------------
# Measured overhead of one run beyond warm + measure on the 2-core machine (start the services,
# drain the last requests, stop): see the smoke figures in docs/benchmarks.md.
OVERHEAD_S = {"plain": 7.0, "controlled": 10.0}


def run_seconds(contender: str, warm_s: float, measure_s: float) -> float:
    kind = "controlled" if contender in ("controller", "killed") else "plain"
    return warm_s + measure_s + OVERHEAD_S[kind]


def budget_s(runs: list[tuple[str, float, float]], jobs: int, capacity_s: float = 0.0) -> float:
    """``runs``: (contender, warm, measure) per run, in queue order; ``capacity_s``: the capacity phase's
    estimate. The runs are laid on ``jobs`` slots as the pool does, so eight long runs on three slots
    take three rounds, not 8/3."""
    slots = [0.0] * max(1, jobs)  # the pool hands the next run to the first free slot, in queue order
    for c, w, m in runs:
        i = slots.index(min(slots))
        slots[i] += run_seconds(c, w, m)
    return capacity_s + max(slots)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.goodput.report RESULT.json``: print a result file as the Markdown of
    ``docs/goodput.md``."""
    import argparse
    import json
    from pathlib import Path

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("result", help="a bench/goodput JSON (the matrix or --healthy)")
    out = json.loads(Path(ap.parse_args(argv).result).read_text())
    print(healthy_markdown(out) if "runs" in out else markdown(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
