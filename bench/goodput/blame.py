"""The blame matrix (issue 29): in every controlled run, who was cut, against who was faulty.

Read from a result file's runs (``decisions.analyse``'s figures per seed): the fault's instances
(``FaultPlan.faulty``), every instance whose weight went under ``HEALTHY_FLOOR`` with its lowest
weight, the never-faulty ones among them with the reasons they were cut for, and the reaction (the
first cut after onset of a faulty instance's weight or of a pool limit, in ticks). A run passes when
no never-faulty instance was cut and, where the fault names instances, one of them was cut within
``REACTION_TICKS`` ticks; a fault on one P x D link, when the pair was avoided and neither of its
ends was cut (:mod:`bench.goodput.pairs`).

    .venv/bin/python -m bench.goodput.report --blame bench/results/goodput.json
"""

from __future__ import annotations

from typing import Any

from bench.goodput.decisions import HEALTHY_FLOOR, REACTION_TICKS
from bench.goodput.explained import names_faulty
from bench.goodput.pairs import AVOIDED_SHARE, fault_pair

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
        pair = fault_pair(cell.get("injections") or [])
        for seed, contenders in _runs(cell):
            for who in CONTROLLED:
                r = contenders.get(who)
                if r and "min_weight" in r:
                    rows.append({"cell": name, "seed": seed, "contender": who, **_verdict(r, faulty, pair)})
    return rows


def _verdict(r: dict[str, Any], faulty: list[str], pair: tuple[str, str] | None) -> dict[str, Any]:
    """Who was cut against who was faulty, in one controlled run. A pair fault passes when neither end
    was cut (each serves its other links well) and the pair was avoided (:mod:`bench.goodput.pairs`);
    any other, when one of its instances was cut in time."""
    lowest = {i: w for i, w in r["min_weight"].items() if w < HEALTHY_FLOOR}
    wrong: dict[str, list[str]] = {}
    for d in r.get("healthy_cut_detail") or []:
        reasons = wrong.setdefault(str(d["subject"]), [])
        if d["reason"] not in reasons:
            reasons.append(str(d["reason"]))
    reaction = r.get("reaction_ticks")
    share = r.get("pair_share")
    if pair is not None:
        for end in pair:  # an end cut for its one slow link is a cut of a healthy instance
            if end in lowest:
                wrong.setdefault(end, []).append("cut for its pair")
        found = share is not None and share <= AVOIDED_SHARE
    else:
        found = reaction is not None and reaction <= REACTION_TICKS and any(i in lowest for i in faulty)
    top = r.get("explain_top")
    return {
        "faulty": [f"{pair[0]} x {pair[1]}"] if pair is not None else faulty,
        "cut": lowest,
        "healthy_cut": wrong,
        "reaction_ticks": reaction,
        "pair_share": share,
        "passed": not wrong and (found or (not faulty and pair is None)),
        "explain_top": top,
        "explain_agrees": None
        if not top or not (faulty or pair)
        else names_faulty(top["place"], faulty, pair),
    }


def _explained(r: dict[str, Any]) -> str:
    top = r["explain_top"]
    if not top:
        return "–"
    mark = {True: "", False: " ✗", None: ""}[r["explain_agrees"]]
    return f"{top['place']} ({top['stage']}, {top['cause']}, {top['share']:.0%}){mark}"


def blame_markdown(out: dict[str, Any]) -> str:
    lines = [
        f"| cell | seed | contender | faulty | cut (lowest weight < {HEALTHY_FLOOR}) | never-faulty cut "
        f"(reasons) | reaction | explain's top reason | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = blame_rows(out)
    for r in rows:
        cut = ", ".join(f"{i} {w:.2f}" for i, w in sorted(r["cut"].items())) or "none"
        if r["pair_share"] is not None:
            cut += f"; the pair carried ×{r['pair_share']:.2f} an even share"
        wrong = "; ".join(f"{i} ({', '.join(why)})" for i, why in sorted(r["healthy_cut"].items())) or "0"
        reaction = "–" if r["reaction_ticks"] is None else f"{r['reaction_ticks']}t"
        lines.append(
            f"| {r['cell']} | {r['seed']} | {r['contender']} | {', '.join(r['faulty']) or '–'} | {cut} | "
            f"{wrong} | {reaction} | {_explained(r)} | {'PASS' if r['passed'] else 'MISS'} |"
        )
    passed = sum(1 for r in rows if r["passed"])
    judged = [r for r in rows if r["explain_agrees"] is not None]
    lines.append("")
    lines.append(
        f"{passed} of {len(rows)} runs pass (no never-faulty instance or pool limit cut; a faulty "
        f"instance cut within {REACTION_TICKS} ticks; a slow pair avoided, carrying at most "
        f"×{AVOIDED_SHARE:g} an even share from then, with neither of its ends cut)"
    )
    if judged:
        lines.append(
            f"explain's top reason over the faulty phase names the faulty side (the instance, its row "
            f"P->*, its column *->D, or the pair) in {sum(1 for r in judged if r['explain_agrees'])} of "
            f"{len(judged)} runs (✗: it does not)"
        )
    return "\n".join(lines)
