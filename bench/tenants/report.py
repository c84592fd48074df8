"""The tenants bench's derived figures per scenario and its two tables (Markdown): every tenant in
every run, then the targets (the fair run's figure, the unfair baseline's of the same run, the verdict;
``PASS (edge)`` where the figure is within 2 % of its target)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.tenants.figures import attainment_ratios, combine, flood_figures, summary
from bench.tenants.scenarios import SCENARIOS, Scenario


def _r(v: float | None, d: int = 3) -> float | None:
    return None if v is None else round(v, d)


def derived(runs: dict[str, dict[str, Any]], sc: dict[str, Scenario]) -> dict[str, Any]:
    """Per scenario and arm: the well-behaved tenants' attainment over alone, Jain's index, the flood's
    429 figures; per scenario, the fleet goodput fair over unfair."""
    out: dict[str, Any] = {}
    for name, r in runs.items():
        s = sc[name]
        per: dict[str, Any] = {}
        for arm in (a for a in ("fair", "unfair", "priority") if a in r):
            per[arm] = {
                "attainment_vs_alone": {k: _r(v) for k, v in attainment_ratios(r, s, arm).items()},
                "jain": _r(r[arm]["jain"]),
            }
            if name == "flood":
                per[arm] |= flood_figures(r, s, arm)
        unfair = r["unfair"]["goodput_tok_s"]
        per["goodput_fair_vs_unfair"] = _r(r["fair"]["goodput_tok_s"] / unfair) if unfair else None
        if "priority" in r:
            per["goodput_priority_vs_unfair"] = (
                _r(r["priority"]["goodput_tok_s"] / unfair) if unfair else None
            )
        out[name] = per
    return out


def _f(v: float | None, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def _reasons(f: dict[str, Any]) -> str:
    by = f["rejected_by_reason"]
    return ", ".join(f"{k} {v}" for k, v in by.items()) if by else "0"


def tenant_table(result: dict[str, Any]) -> str:
    rows = [
        "| scenario | run | tenant | offered req/s (x share) | sent | served | 429s by reason | "
        "TTFT p50 / p99 (s) | attainment | goodput tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in result["runs"].items():
        declared = result["scenarios"][name]["tenants"]
        for arm, r in runs.items():
            for tid, f in r["tenants"].items():
                rows.append(
                    f"| {name} | {arm}{' (starved)' if r['starved'] else ''} | {tid} | "
                    f"{r['offered_rps'][tid]:g} ({declared[tid]['of_share']:g}) | {f['requests']} | "
                    f"{f['served']} | {_reasons(f)} | {_f(f['ttft_p50_s'])} / {_f(f['ttft_p99_s'])} | "
                    f"{_f(None if f['attainment'] is None else 100 * f['attainment'], '.1f')}% | "
                    f"{f['goodput_tok_s']:.0f} |"
                )
    return "\n".join(rows)


def target_table(result: dict[str, Any]) -> str:
    prio = any("priority" in s for s in result["summary"])
    extra = (" priority-scheduled (tenants on) | verdict |", "---|---|") if prio else ("", "")
    rows = [
        "| figure | target | measured (tenants on) | baseline (same fleet, tenants off) | verdict |"
        + extra[0],
        "|---|---|---|---|---|" + extra[1],
    ]
    for s in result["summary"]:
        more = f" {_v(s, 'priority')} | {s.get('priority_verdict', '-')} |" if prio else ""
        rows.append(
            f"| {s['figure']} | {s['target']} | {_v(s, 'measured')} | {_v(s, 'baseline')} | "
            f"{s['verdict']} |{more}"
        )
    repeats = max((s.get("repeats", 1) for s in result["summary"]), default=1)
    if repeats > 1:
        rows.append(
            f"\nmedian of {repeats} repeated runs of each arm, [least, most] beside it; "
            "verdicts on the median"
        )
    return "\n".join(rows)


def _v(row: dict[str, Any], key: str) -> str:
    """A target row's figure, with its range over repeats when it has one."""
    span = row.get(f"{key}_range")
    text = _f(row.get(key), ".3f")
    return text if not span or span[0] == span[1] else f"{text} [{span[0]:.3f}, {span[1]:.3f}]"


def tables(result: dict[str, Any]) -> str:
    cap = result["capacity"]
    head = (
        f"fleet {result['fleet']}, capacity {cap['capacity_rps']:g} req/s "
        f"({'given' if cap['given'] else 'measured'}); {result['warm_s']:g} s warm + "
        f"{result['measure_s']:g} s measured per run"
    )
    starved = result.get("starved_runs") or []
    note = f"\nstarved of CPU (timings stretched): {', '.join(starved)}" if starved else ""
    return f"{head}\n\n{tenant_table(result)}\n\n{target_table(result)}{note}"


def repeats(result: dict[str, Any]) -> list[dict[str, dict[str, Any]]]:
    """A result's runs per repeat (``--repeat``): the first, then each later one's contested runs with the
    first's alone runs (stored once)."""
    first = result["runs"]
    alone = {n: {arm: r for arm, r in runs.items() if arm.startswith("alone:")} for n, runs in first.items()}
    return [first, *({n: {**alone[n], **r} for n, r in rep.items()} for rep in result.get("repeat_runs", []))]


def rederive(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with its derived figures and targets computed again from its runs, every repeat's
    (this checkout's arithmetic over the measured figures; nothing is measured again)."""
    chosen = {n: SCENARIOS[n] for n in result["runs"]}
    ceiling = (result.get("ceiling") or {}).get("ratio_on_vs_off")
    targets = combine([summary(runs, chosen, ceiling) for runs in repeats(result)])
    return result | {"derived": derived(result["runs"], chosen), "summary": targets}


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.tenants.report RESULT.json [--rewrite]``: print a result file's tables, its
    figures derived again (``--rewrite``: and write them back)."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("result")
    ap.add_argument("--rewrite", action="store_true")
    a = ap.parse_args(argv)
    result = rederive(json.loads(Path(a.result).read_text()))
    if a.rewrite:
        Path(a.result).write_text(json.dumps(result, indent=1) + "\n")
    print(tables(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
