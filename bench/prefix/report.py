"""The prefix benchmark's ratios, targets and table (pure: from the cells' dicts to text).

Targets (issue 17), each PASS or MISS, or "n/a" when a figure it needs is missing:
- prefix hit rate >= 0.9 x the oracle's, in ``system_prompts`` and ``multi_turn``: the fleet's
  reuse (prompt tokens not computed, ``measure.py``), since with decode-only on, the requests D
  serves alone never reach a P and the P hit rate counts only the rest (shown beside it);
- goodput >= 1.3 x load_only's, in ``system_prompts`` and ``multi_turn``;
- goodput >= 0.95 x load_only's in ``unique`` (affinity costs nothing when nothing is shared);
- ``hot_prefix``: no P queue wait over the TTFT budget.
Checked for the KV-aware contenders (approximate, precise; the oracle and vllm_router shown beside).
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.prefix.measure import ratio
from bench.prefix.stack import (
    BLOCK_SIZE,
    KV_CAPACITY_BLOCKS,
    OUTPUT_TOKENS,
    P_COUNT,
    PREFILL_TOKENS_PER_S,
    SLO_TPOT_S,
    SLO_TTFT_S,
)

KV_AWARE = ("approximate", "precise")
SHARED = ("system_prompts", "multi_turn", "live_chat")
HIT_OF_ORACLE, GOODPUT_GAIN, CONTROL_FLOOR = 0.9, 1.3, 0.95


def settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "seed": args.seed,
        "warm_s": args.warm,
        "measure_s": args.measure,
        "load_shared": args.load,
        "load_unique": args.load_unique,
        "quick": args.quick,
        "fleet": f"{P_COUNT}P+{args.decodes}D",
        "kv_set": dict(args.fleet.kv_set),
        "prefill_tokens_per_s": PREFILL_TOKENS_PER_S,
        "block_size": BLOCK_SIZE,
        "kv_capacity_blocks": KV_CAPACITY_BLOCKS,
        "slo": {"ttft_s": SLO_TTFT_S, "tpot_s": SLO_TPOT_S},
        "output_tokens": OUTPUT_TOKENS,
    }


def _f(v: Any, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


fmt = _f


def progress_line(contender: str, r: dict[str, Any]) -> str:
    if "missing" in r:
        return f"{contender:<12s} MISSING: {r['missing']}"
    if "error" in r:
        return f"{contender:<12s} ERROR: {r['error']} (logs {r.get('logs')})"
    extra = f" policy={r['router_policy']}" if "router_policy" in r else ""
    return (
        f"{contender:<12s} reuse={_f(r.get('reuse'))} P hit={_f(r.get('p_hit_rate'))} "
        f"goodput={_f(r.get('goodput_rps'))}/s "
        f"of {_f(r.get('offered_rps'))}/s ttft p50={_f(r.get('ttft_p50_s'), '{:.3f}')} "
        f"p99={_f(r.get('ttft_p99_s'), '{:.3f}')} errors={sum((r.get('errors') or {}).values())}{extra} "
        f"({r.get('wall_s')}s)"
    )


def _ok(r: dict[str, Any] | None) -> bool:
    return r is not None and "missing" not in r and "error" not in r


def _verdict(value: float | None, floor: float) -> str:
    if value is None:
        return "n/a"
    return "PASS" if value >= floor else "MISS"


def _add_ratios(row: dict[str, Any]) -> None:
    """Each run of one workload against load_only and the oracle of the same workload."""
    base = row.get("load_only")
    oracle = row.get("oracle")
    for r in row.values():
        if not _ok(r):
            continue
        r["goodput_x_load_only"] = ratio(r.get("goodput_rps"), base.get("goodput_rps")) if _ok(base) else None
        r["hit_rate_of_oracle"] = (
            ratio(r.get("p_hit_rate"), oracle.get("p_hit_rate")) if _ok(oracle) else None
        )
        r["reuse_of_oracle"] = ratio(r.get("reuse"), oracle.get("reuse")) if _ok(oracle) else None


def _target(w: str, c: str, target: str, value: Any, verdict: str) -> dict[str, Any]:
    return {"workload": w, "contender": c, "target": target, "value": value, "verdict": verdict}


def _targets(w: str, c: str, got: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets a KV-aware contender's run of workload ``w`` is held to."""
    if w in SHARED:
        hr = got.get("reuse_of_oracle")
        gx = got.get("goodput_x_load_only")
        return [
            _target(w, c, f"reuse >= {HIT_OF_ORACLE} x oracle", hr, _verdict(hr, HIT_OF_ORACLE)),
            _target(w, c, f"goodput >= {GOODPUT_GAIN} x load_only", gx, _verdict(gx, GOODPUT_GAIN)),
        ]
    if w == "unique":
        gx = got.get("goodput_x_load_only")
        return [_target(w, c, f"goodput >= {CONTROL_FLOOR} x load_only", gx, _verdict(gx, CONTROL_FLOOR))]
    if w == "hot_prefix":
        over = got.get("queue_over_budget")
        verdict = "n/a" if over is None else ("PASS" if over == 0 else "MISS")
        return [_target(w, c, f"no P queue wait > {SLO_TTFT_S} s", over, verdict)]
    return []


def summarize(cells: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ratios per cell (vs load_only and the oracle of the same workload) and the targets."""
    targets: list[dict[str, Any]] = []
    for w, row in cells.items():
        _add_ratios(row)
        for c in KV_AWARE:
            r = row.get(c)
            if r is None:
                continue
            targets += _targets(w, c, r if _ok(r) else {})
    return {"targets": targets}


def table(result: dict[str, Any]) -> str:
    """The results as a Markdown table (one row per workload x contender), then the targets."""
    lines = [
        "| workload | contender | reuse | of oracle | P hit rate | goodput (req/s) | x load_only "
        "| TTFT p50 (s) | TTFT p99 (s) | decode-only | P waits > budget | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w, row in result["cells"].items():
        offered = result["workloads"].get(w, {}).get("rate_rps")
        for c, r in row.items():
            name = c + (f" ({r['router_policy']})" if "router_policy" in r else "")
            name += " !" if r.get("sim_trustworthy") is False else ""
            if not _ok(r):
                why = r.get("missing") or r.get("error") or "?"
                lines.append(f"| {w} ({_f(offered)}/s) | {name} | {why} |  |  |  |  |  |  |  |  |  |")
                continue
            errors = sum((r.get("errors") or {}).values())
            lines.append(
                f"| {w} ({_f(offered)}/s) | {name} | {_f(r.get('reuse'))} | {_f(r.get('reuse_of_oracle'))} "
                f"| {_f(r.get('p_hit_rate'))} | {_f(r.get('goodput_rps'))} "
                f"| {_f(r.get('goodput_x_load_only'))} "
                f"| {_f(r.get('ttft_p50_s'), '{:.3f}')} | {_f(r.get('ttft_p99_s'), '{:.3f}')} "
                f"| {_f(r.get('decode_only_share'), '{:.0%}')} | {_f(r.get('queue_over_budget'), '{:.0f}')} "
                f"| {errors} |"
            )
    if any(r.get("sim_trustworthy") is False for row in result["cells"].values() for r in row.values()):
        lines += [
            "",
            "`!`: the simulator's event loop lagged past its threshold in that run (timings stretched).",
        ]
    lines += ["", "| target | workload | contender | value | verdict |", "|---|---|---|---|---|"]
    for t in result.get("summary", {}).get("targets", []):
        lines.append(
            f"| {t['target']} | {t['workload']} | {t['contender']} | {_f(t['value'])} | {t['verdict']} |"
        )
    return "\n".join(lines)
