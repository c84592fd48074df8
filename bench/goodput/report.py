"""Ratios, targets and tables of the goodput bench (pure: dicts in, dicts and text out).

Targets per cell (issue 28, "Benchmark and targets"), all from contenders of the same run (seed):

* ``do_no_harm``          controller / static >= 1.0
* ``near_oracle``         controller / oracle >= 0.95
* ``captures_gain``       where the oracle beats static by >= 5 %:
                          (controller - static) / (oracle - static) >= 0.7
* ``alone_vs_rr``         killed / round_robin >= 1.0 (the proxy alone, its controller SIGKILLed at onset)
* ``no_healthy_cuts``     the controller cut no healthy instance below 0.9 and no limit the fault does
                          not call for
* ``overload_attainment`` overload cells (``catalogue.OVERLOAD``): the controller's SLO attainment of
                          the requests it admitted (not answered 429/503) >= 99 %
* ``overload_p99``        overload cells: the controller's served p99 TTFT within the TTFT SLO
* ``rejections``          the controller's rejections <= 1.2x the oracle's (both none: PASS)
* ``predictor_median``    median |observed / predicted - 1| of the controller run's stored TTFT
                          predictions <= 10 % (where the records carry predictions)
* ``predictor_p90``       its p90 <= 30 %

A target is PASS, MISS, or ``-`` (not applicable, or a contender it needs is missing or failed).
Over seeds (``combine_seeds``): a cell misses a target if any seed misses it; its value is the
seeds' mean, with their min (and, for the goodput of each contender, the min too).
"""

from __future__ import annotations

import math
from typing import Any

from bench.goodput.catalogue import OVERLOAD

TARGETS = {
    "do_no_harm": "controller / static >= 1.0",
    "near_oracle": "controller / oracle >= 0.95",
    "captures_gain": "captured share of the oracle's gain over static >= 70% (where that gain >= 5%)",
    "alone_vs_rr": "killed / round robin >= 1.0",
    "no_healthy_cuts": "zero cuts of healthy instances (weights < 0.9, uncalled-for limit cuts)",
    "overload_attainment": "overload: SLO attainment of the controller's admitted requests >= 99%",
    "overload_p99": "overload: the controller's served p99 TTFT <= the TTFT SLO",
    "rejections": "the controller's rejections <= 1.2x the oracle's",
    "predictor_median": "median |observed/predicted - 1| of TTFT <= 10% (controller run)",
    "predictor_p90": "p90 |observed/predicted - 1| of TTFT <= 30% (controller run)",
}
DO_NO_HARM, NEAR_ORACLE, CAPTURE, GAIN_FLOOR, ALONE = 1.0, 0.95, 0.7, 0.05, 1.0
ADMITTED_ATTAINMENT, REJECTIONS_VS_ORACLE = 0.99, 1.2
PREDICTOR_MEDIAN, PREDICTOR_P90 = 0.10, 0.30


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


def judge(value: float | None, ok: bool | None) -> dict[str, Any]:
    return {"value": value, "status": "-" if ok is None else "PASS" if ok else "MISS"}


def _ok(r: dict[str, Any] | None) -> dict[str, Any]:
    """A contender's result, or {} where it is missing or failed."""
    return {} if not r or "error" in r else r


def _rejection_ratio(res: dict[str, dict[str, Any]]) -> float | None:
    ctl, orc = _ok(res.get("controller")).get("rejections"), _ok(res.get("oracle")).get("rejections")
    if ctl is None or orc is None:
        return None
    return 1.0 if ctl == orc == 0 else _ratio(float(ctl), float(orc))


def _controller_targets(fault: str, res: dict[str, dict[str, Any]], slo_ttft_s: float) -> dict[str, Any]:
    """The targets on the controller's own figures: cuts, the overload cells' admitted requests,
    rejections against the oracle's, and the predictor's error."""
    r = _ok(res.get("controller"))
    overload = fault in OVERLOAD
    cuts = None if "healthy_cuts" not in r else int(r["healthy_cuts"])
    att, p99 = r.get("admitted_attainment"), r.get("ttft_p99_s")
    rej = _rejection_ratio(res)
    err = r.get("prediction_error") or {}
    med, p90 = err.get("median"), err.get("p90")
    return {
        "no_healthy_cuts": judge(cuts, None if cuts is None else cuts == 0),
        "overload_attainment": judge(
            att, None if not overload or att is None else att >= ADMITTED_ATTAINMENT
        ),
        "overload_p99": judge(p99, None if not overload or p99 is None else p99 <= slo_ttft_s),
        "rejections": judge(rej, None if rej is None else rej <= REJECTIONS_VS_ORACLE),
        "predictor_median": judge(med, None if med is None else med <= PREDICTOR_MEDIAN),
        "predictor_p90": judge(p90, None if p90 is None else p90 <= PREDICTOR_P90),
    }


def cell_targets(
    fault: str, res: dict[str, dict[str, Any]], slo_ttft_s: float
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``res``: contender -> result (one seed). Returns (ratios, targets) where each target is
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
        "rejections_vs_oracle": _rejection_ratio(res),
    }
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
    return ratios, targets | _controller_targets(fault, res, slo_ttft_s)


def _mean_min(values: list[Any]) -> tuple[float | None, float | None]:
    xs = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    finite = [x for x in xs if math.isfinite(x)]
    if not xs:
        return None, None
    return (sum(finite) / len(finite) if len(finite) == len(xs) else math.inf), min(xs)


AVERAGED = (
    "goodput_rps",
    "slo_attainment",
    "admitted_attainment",
    "ttft_p99_s",
    "errors_total",
    "rejections",
    "expired_leases",
    "requests",
    "admitted",
    "healthy_cuts",
    "reaction_ticks",
)


def combine_contender(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One contender over seeds: the mean of each figure of ``AVERAGED`` (``*_min``: the least),
    the worst p99 TTFT, the predictor's error over the seeds' pooled medians; a failed seed is left
    out and named; all failed: the first error."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return dict(runs[0]) if runs else {"error": "no run"}
    if len(runs) == 1:
        return dict(ok[0])
    out: dict[str, Any] = {"seeds": len(runs), "failed_seeds": len(runs) - len(ok)}
    for key in AVERAGED:
        mean, least = _mean_min([r.get(key) for r in ok])
        out[key] = round(mean, 4) if mean is not None and math.isfinite(mean) else mean
        out[f"{key}_min"] = least
    out["ttft_p99_max_s"] = max(
        (r["ttft_p99_s"] for r in ok if r.get("ttft_p99_s") is not None), default=None
    )
    for key in ("healthy_cuts", "errors_total", "rejections"):
        if out.get(key) is not None:
            out[key] = round(out[key], 2)
    errs = [r.get("prediction_error") or {} for r in ok]
    out["prediction_error"] = {k: _mean_min([e.get(k) for e in errs])[0] for k in ("median", "p90")} | {
        "n": sum(int(e.get("n") or 0) for e in errs)
    }
    out["starved"] = any(r.get("starved") for r in ok)
    return out


def combine_targets(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """A cell's targets over its seeds: MISS if any seed misses, PASS if one passes and none misses;
    ``value`` the mean over the seeds where it applies, ``min`` the least."""
    out: dict[str, Any] = {}
    for name in TARGETS:
        got = [t[name] for t in per_seed if name in t and t[name]["status"] != "-"]
        mean, least = _mean_min([t["value"] for t in got])
        status = "-" if not got else "MISS" if any(t["status"] == "MISS" for t in got) else "PASS"
        out[name] = {"value": mean, "min": least, "status": status, "seeds": len(got)}
    return out


def combine_seeds(
    fault: str, by_seed: dict[str, dict[str, dict[str, Any]]], slo_ttft_s: float
) -> dict[str, Any]:
    """``by_seed``: seed -> contender -> result. The cell's figures over its seeds: ``contenders``
    (``combine_contender``), ``targets`` (``combine_targets``), ``ratios`` of the mean goodputs, and
    each seed's own ``contenders``, ``ratios`` and ``targets`` under ``seeds``."""
    seeds = {}
    for seed, res in by_seed.items():
        ratios, targets = cell_targets(fault, res, slo_ttft_s)
        seeds[seed] = {"contenders": res, "ratios": ratios, "targets": targets}
    names = list(dict.fromkeys(c for res in by_seed.values() for c in res))
    contenders = {c: combine_contender([res[c] for res in by_seed.values() if c in res]) for c in names}
    ratios, _ = cell_targets(fault, contenders, slo_ttft_s)
    return {
        "contenders": contenders,
        "ratios": ratios,
        "targets": combine_targets([v["targets"] for v in seeds.values()]),
        "seeds": seeds,
    }


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


def fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}"


def _count(v: float | None) -> str:
    return "-" if v is None else f"{v:g}" if isinstance(v, int) or float(v).is_integer() else f"{v:.1f}"


def contender_line(cell: str, contender: str, r: dict[str, Any]) -> str:
    """One contender's figures (over seeds: their means; ``min`` the least goodput)."""
    if "error" in r:
        return f"{cell:30s} {contender:11s} FAILED: {str(r['error'])[:80]}"
    react = r.get("reaction_ticks")
    cuts = r.get("healthy_cuts")
    mark = "!" if r.get("starved") else " "
    err = r.get("prediction_error") or {}
    least = r.get("goodput_rps_min")
    return (
        f"{cell:30s} {contender:10s}{mark} {r['goodput_rps']:9.2f} "
        f"{'-' if least is None else f'{least:.2f}':>6s} {fmt_pct(r['slo_attainment']):>6s} "
        f"{fmt_pct(r.get('admitted_attainment')):>6s} {fmt_s(r['ttft_p99_s']):>8s} "
        f"{_count(r['errors_total']):>6s} {_count(r['rejections']):>8s} {_count(r['expired_leases']):>7s} "
        f"{'-' if react is None else _count(react) + 't':>6s} {_count(cuts):>5s} "
        f"{fmt_pct(err.get('median')):>6s} {fmt_pct(err.get('p90')):>6s}"
    )


HEADER = (
    f"{'cell':30s} {'contender':11s} {'goodput/s':>9s} {'min':>6s} {'SLO %':>6s} {'adm %':>6s} "
    f"{'p99 TTFT':>8s} {'errors':>6s} {'rejected':>8s} {'expired':>7s} {'react':>6s} {'cuts':>5s} "
    f"{'err50%':>6s} {'err90%':>6s}"
)
PERCENT_TARGETS = ("captures_gain", "overload_attainment", "predictor_median", "predictor_p90")


def _shown(name: str, v: float | None) -> str:
    if v is None:
        return "-"
    if name in PERCENT_TARGETS:
        return f"{v * 100:.0f}%" if math.isfinite(v) else "inf"
    if name == "overload_p99":
        return fmt_s(v)
    if name == "no_healthy_cuts":
        return _count(v)
    return fmt_x(v)


def targets_line(targets: dict[str, Any]) -> str:
    """The cell's PASS/MISS per target that applies (over seeds: the mean, and the least in brackets)."""
    parts = []
    for name in TARGETS:
        t = targets.get(name) or {"status": "-"}
        if t["status"] == "-":
            continue
        least = f" (min {_shown(name, t['min'])})" if t.get("seeds", 1) > 1 else ""
        parts.append(f"{name} {_shown(name, t['value'])}{least} {t['status']}")
    return "    targets: " + ("  ".join(parts) if parts else "none applicable")


def table(out: dict[str, Any]) -> str:
    lines = [
        f"SLO TTFT {out['slo']['ttft_s']} s, TPOT {out['slo']['tpot_s']} s; warm {out['warm_s']} s, "
        f"measured {out['measured_s']} s; seeds {', '.join(map(str, out.get('seeds') or [out.get('seed')]))}"
        "; capacity " + ", ".join(f"{f} {v['capacity_rps']:g} req/s" for f, v in out["fleets"].items()),
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


MD_HEADER = (
    "| cell | RR | static | **controller** | oracle | killed | ctl/static | ctl/oracle | gain captured "
    "| killed/RR | reaction | healthy cuts | ctl p99 TTFT | ctl admitted SLO | rejected ctl/oracle "
    "| pred. err p50/p90 |"
)


def _mark(t: dict[str, Any] | None, text: str) -> str:
    if t is None or t.get("status") == "-":
        return "–"
    return text + (" ✗" if t.get("status") == "MISS" else "")


def _md_row(cell: str, c: dict[str, Any]) -> str:
    got, t = c["contenders"], c["targets"]
    gp = [
        f"{got[k]['goodput_rps']:.2f}" if got.get(k, {}).get("goodput_rps") is not None else "–"
        for k in ("round_robin", "static", "controller", "oracle", "killed")
    ]
    ctl, orc = got.get("controller", {}), got.get("oracle", {})
    err = ctl.get("prediction_error") or {}
    miss = (
        " ✗" if "MISS" in (t.get(k, {}).get("status") for k in ("predictor_median", "predictor_p90")) else ""
    )
    p99_miss = t.get("overload_p99", {}).get("status") == "MISS"
    att = ctl.get("admitted_attainment")
    return (
        "| "
        + " | ".join(
            [
                cell,
                *gp[:2],
                f"**{gp[2]}**",
                *gp[3:],
                *(
                    _mark(t.get(k), _shown(k, t.get(k, {}).get("value")))
                    for k in ("do_no_harm", "near_oracle", "captures_gain", "alone_vs_rr")
                ),
                f"{_count(c['reaction_ticks'])}t" if c.get("reaction_ticks") is not None else "–",
                _mark(t.get("no_healthy_cuts"), _count(t.get("no_healthy_cuts", {}).get("value"))),
                fmt_s(ctl.get("ttft_p99_s")) + (" ✗" if p99_miss else ""),
                ("–" if att is None else f"{att * 100:.1f} %")
                + (" ✗" if t.get("overload_attainment", {}).get("status") == "MISS" else ""),
                _mark(
                    t.get("rejections"), f"{_count(ctl.get('rejections'))}/{_count(orc.get('rejections'))}"
                ),
                "–"
                if err.get("median") is None
                else f"{err['median'] * 100:.0f}/{(err.get('p90') or 0) * 100:.0f} %{miss}",
            ]
        )
        + " |"
    )


def markdown(out: dict[str, Any]) -> str:
    """The matrix as the Markdown table of ``docs/goodput.md`` (goodput in requests/s, over seeds
    their mean; ✗ a missed target, – one that does not apply)."""
    lines = [MD_HEADER, "|" + "---|" * 16]
    lines += [_md_row(cell, c) for cell, c in out["cells"].items()]
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
    ``docs/goodput.md`` (``--blame``: the blame matrix of its controlled runs, ``bench/goodput/blame.py``)."""
    import argparse
    import json
    from pathlib import Path

    from bench.goodput.blame import blame_markdown

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("result", help="a bench/goodput JSON (the matrix or --healthy)")
    ap.add_argument(
        "--blame", action="store_true", help="the blame matrix: who was cut against who was faulty, per run"
    )
    a = ap.parse_args(argv)
    out = json.loads(Path(a.result).read_text())
    if a.blame:
        print(blame_markdown(out))
    else:
        print(healthy_markdown(out) if "runs" in out else markdown(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
