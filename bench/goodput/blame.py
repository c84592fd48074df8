"""The blame matrix (issue 29): in every controlled run, who was cut, against who was faulty.

Read from a result file's runs (``decisions.analyse``'s figures per seed): the fault's instances
(``FaultPlan.faulty``), every instance whose weight went under ``HEALTHY_FLOOR`` with its lowest
weight, the never-faulty ones among them with the reasons they were cut for, and the reaction (the
first cut after onset of a faulty instance's weight or of a pool limit, in ticks). A run passes when
no never-faulty instance was cut and, where the fault names instances, one of them was cut within
``REACTION_TICKS`` ticks.

    .venv/bin/python -m bench.goodput.report --blame bench/results/goodput.json
"""

from __future__ import annotations

from typing import Any

from bench.goodput.decisions import HEALTHY_FLOOR

REACTION_TICKS = 5  # the target: the faulty side cut within 5 ticks of the fault's onset
CONTROLLED = ("controller", "killed")


def _runs(cell: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(seed, that seed's contenders) for a cell of one seed or several."""
    seeds = cell.get("seeds")
    if isinstance(seeds, dict) and seeds:
        return [(str(s), v.get("contenders", {})) for s, v in seeds.items()]
    return [("-", cell.get("contenders", {}))]


def blame_rows(out: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per cell, seed and controlled contender that ran."""
    rows = []
    for name, cell in out.get("cells", {}).items():
        faulty = sorted(cell.get("faulty") or [])
        for seed, contenders in _runs(cell):
            for who in CONTROLLED:
                r = contenders.get(who)
                if not r or "min_weight" not in r:
                    continue
                lowest = {i: w for i, w in r["min_weight"].items() if w < HEALTHY_FLOOR}
                wrong: dict[str, list[str]] = {}
                for d in r.get("healthy_cut_detail") or []:
                    reasons = wrong.setdefault(str(d["subject"]), [])
                    if d["reason"] not in reasons:
                        reasons.append(str(d["reason"]))
                reaction = r.get("reaction_ticks")
                hit = [i for i in faulty if i in lowest]
                in_time = reaction is not None and reaction <= REACTION_TICKS and bool(hit)
                rows.append(
                    {
                        "cell": name,
                        "seed": seed,
                        "contender": who,
                        "faulty": faulty,
                        "cut": lowest,
                        "healthy_cut": wrong,
                        "reaction_ticks": reaction,
                        "passed": not wrong and (in_time or not faulty),
                    }
                )
    return rows


def blame_markdown(out: dict[str, Any]) -> str:
    lines = [
        f"| cell | seed | contender | faulty | cut (lowest weight < {HEALTHY_FLOOR}) | never-faulty cut "
        f"(reasons) | reaction | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = blame_rows(out)
    for r in rows:
        cut = ", ".join(f"{i} {w:.2f}" for i, w in sorted(r["cut"].items())) or "none"
        wrong = "; ".join(f"{i} ({', '.join(why)})" for i, why in sorted(r["healthy_cut"].items())) or "0"
        reaction = "–" if r["reaction_ticks"] is None else f"{r['reaction_ticks']}t"
        lines.append(
            f"| {r['cell']} | {r['seed']} | {r['contender']} | {', '.join(r['faulty']) or '–'} | {cut} | "
            f"{wrong} | {reaction} | {'PASS' if r['passed'] else 'MISS'} |"
        )
    passed = sum(1 for r in rows if r["passed"])
    lines.append("")
    lines.append(
        f"{passed} of {len(rows)} runs pass (no never-faulty instance or pool limit cut; a faulty "
        f"instance cut within {REACTION_TICKS} ticks)"
    )
    return "\n".join(lines)
