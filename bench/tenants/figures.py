"""The tenants bench's arithmetic (pure): each tenant's figures from the client's results, Jain's index,
and the figures held against the issue's targets, each a ratio against the baseline of the same run.

A tenant's *attainment* is the share of the requests it sent in the measured phase that were served
within its own SLO (TTFT, and TPOT where there are two tokens or more): a 429 counts as a miss, so a
tenant whose requests are refused in another's place loses attainment. *Goodput* is the tokens
(prompt + output) of the requests that met their tenant's SLO, per measured second. *Service* is what
the requests served cost their tenant as the fair queue charges it (:class:`pdscope.tenantcost.Costs` at
its defaults: the prompt tokens, and the decode steps with the KV they held); *weighted service* is that
over the tenant's weight.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from bench.tenants.scenarios import Scenario, TenantLoad
from pdscope.stats import percentile
from pdscope.tenantcost import DEFAULT_COSTS
from simulator.workload import RequestResult

EDGE = 0.02  # a figure within 2 % of its target (relative) passes "at the edge"


@dataclass
class Sent:
    """One request the client sent: its tenant, the client's result and the proxy's rejection reason
    (the error body's ``code``; ``HTTP <status>`` when the body names none), when it was rejected."""

    tenant: str
    result: RequestResult
    reason: str | None = None


def meets(r: RequestResult, t: TenantLoad) -> bool:
    """Served within the tenant's own SLO."""
    return (
        r.ok
        and r.ttft_s is not None
        and r.ttft_s * 1000 <= t.ttft_ms
        and (r.tpot_s is None or r.tpot_s * 1000 <= t.tpot_ms)
    )


def _tokens(r: RequestResult) -> float:
    return r.prompt_tokens + r.output_tokens


def _cost(r: RequestResult) -> float:
    """What the request cost its tenant, P's part and D's (its context the prompt)."""
    return r.prompt_tokens + DEFAULT_COSTS.d(r.prompt_tokens, r.output_tokens)


def tenant_figures(sent: list[Sent], t: TenantLoad, measure_s: float) -> dict[str, Any]:
    """One tenant's figures over its requests of the measured phase (``sent`` holds only those)."""
    mine = [s for s in sent if s.tenant == t.id]
    served = [s.result for s in mine if s.result.ok]
    met = [r for r in served if meets(r, t)]
    ttfts = [r.ttft_s for r in served if r.ttft_s is not None]
    rejected = Counter(s.reason for s in mine if s.result.status == 429)
    failed = Counter(s.result.error or "?" for s in mine if not s.result.ok and s.result.status != 429)
    return {
        "requests": len(mine),
        "served": len(served),
        "rejected_429": sum(rejected.values()),
        "rejected_by_reason": dict(sorted((str(k), v) for k, v in rejected.items())),
        "failed_other": dict(failed),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "attainment": len(met) / len(mine) if mine else None,
        "goodput_tok_s": sum(_tokens(r) for r in met) / measure_s,
        "service_tok_s": sum(_cost(r) for r in served) / measure_s,
        "weighted_service": sum(_cost(r) for r in served) / measure_s / t.weight,
    }


def run_figures(
    sent: list[Sent], scenario: Scenario, measure_s: float, only: str | None = None
) -> dict[str, Any]:
    """Every tenant's figures (``only``'s, in a run of that tenant alone) and the fleet's goodput and
    Jain's index over them; a tenant that sent nothing in the phase has its zeros and Nones."""
    per = {t.id: tenant_figures(sent, t, measure_s) for t in scenario.tenants if only in (None, t.id)}
    return {
        "tenants": per,
        "goodput_tok_s": sum(f["goodput_tok_s"] for f in per.values()),
        "jain": jain([f["weighted_service"] for f in per.values()]),
    }


def jain(xs: list[float]) -> float | None:
    """Jain's fairness index, (sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one has all."""
    sq = sum(x * x for x in xs)
    return sum(xs) ** 2 / (len(xs) * sq) if xs and sq > 0 else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None or den == 0 else num / den


def attainment_ratios(runs: dict[str, Any], scenario: Scenario, arm: str) -> dict[str, float | None]:
    """Each well-behaved tenant's attainment in ``arm`` (fair or unfair) over its attainment alone."""
    return {
        t.id: _ratio(
            runs[arm]["tenants"][t.id]["attainment"], runs[f"alone:{t.id}"]["tenants"][t.id]["attainment"]
        )
        for t in scenario.behaved()
    }


def flood_figures(runs: dict[str, Any], scenario: Scenario, arm: str) -> dict[str, Any]:
    """The flood scenario in ``arm``: the share of the 429s that are the flooders', each well-behaved
    tenant's 429s past its own 429s alone (its excess: none when the flood's are its own), and the share
    of the excess 429s (the flooders' and the others' past alone) that are the flooders': 1 when the
    flood's excess is rejected as its own."""
    per = runs[arm]["tenants"]
    total = sum(f["rejected_429"] for f in per.values())
    flooders = sum(per[t.id]["rejected_429"] for t in scenario.tenants if not t.behaved)
    excess = {
        t.id: per[t.id]["rejected_429"] - runs[f"alone:{t.id}"]["tenants"][t.id]["rejected_429"]
        for t in scenario.behaved()
    }
    over = flooders + sum(max(0, n) for n in excess.values())
    return {
        "flood_share_of_429": _ratio(flooders, total),
        "others_excess_429": excess,
        "excess_share": _ratio(flooders, over),
    }


def _min(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return min(vals) if vals else None


@dataclass(frozen=True)
class Target:
    key: str
    label: str
    target: str
    passes: Callable[[float], bool]
    edge: Callable[[float], bool]


def _never(v: float) -> bool:
    return False


def _all(v: float) -> bool:
    return v >= 1


def at_least(key: str, label: str, bound: float) -> Target:
    return Target(key, label, f">= {bound:g}", lambda v: v >= bound, lambda v: v < bound * (1 + EDGE))


def at_most(key: str, label: str, bound: float) -> Target:
    return Target(key, label, f"<= {bound:g}", lambda v: v <= bound, lambda v: v > bound * (1 - EDGE))


TARGETS = (
    at_least("attainment_vs_alone", "well-behaved attainment / alone (worst tenant)", 0.98),
    at_least("jain_backlogged", "Jain's index, weighted service, all backlogged", 0.95),
    Target("flood_share_of_excess_429", "share of the excess 429s that are the flood's", "= 1", _all, _never),
    at_most("interactive_p99_ttft_vs_slo", "interactive p99 TTFT / its SLO (batch filling)", 1.0),
    at_least("goodput_fair_vs_unfair", "fleet goodput fair / unfair (worst scenario)", 0.97),
    at_least("ceiling_on_vs_off", "proxy per-core ceiling, tenants on / off", 0.9),
)


def verdict(t: Target, value: float | None) -> str:
    if value is None:
        return "n/a"
    if not t.passes(value):
        return "MISS"
    return "PASS (edge)" if t.edge(value) else "PASS"


def _arm(runs: dict[str, dict[str, Any]], sc: dict[str, Scenario], arm: str) -> dict[str, float | None]:
    """The figures of one arm (fair or unfair) that are measured on that arm alone; a figure whose
    scenario did not run is left out."""
    out: dict[str, float | None] = {}
    behaved = [n for n in ("flood", "priority", "longprompt", "shapes", "mixed") if n in runs]
    ratios = [v for n in behaved for v in attainment_ratios(runs[n], sc[n], arm).values()]
    out["attainment_vs_alone"] = _min(ratios)
    if "backlog" in runs:
        out["jain_backlogged"] = runs["backlog"][arm]["jain"]
    if "flood" in runs:
        out["flood_share_of_excess_429"] = flood_figures(runs["flood"], sc["flood"], arm)["excess_share"]
    if "priority" in runs:
        chat = next(t for t in sc["priority"].tenants if t.priority == "interactive")
        p99 = runs["priority"][arm]["tenants"][chat.id]["ttft_p99_s"]
        out["interactive_p99_ttft_vs_slo"] = None if p99 is None else p99 * 1000 / chat.ttft_ms
    return out


def summary(
    runs: dict[str, dict[str, Any]], sc: dict[str, Scenario], ceiling: float | None
) -> list[dict[str, Any]]:
    """Each target's row: the fair run's figure, the unfair baseline's (where it has one), the verdict;
    with a ``priority`` arm (``--priority``), its figure and verdict too. ``runs``: per scenario, its runs
    by name (``fair``, ``unfair``, ``priority``, ``alone:<tenant>``), each's figures."""
    arms = ["fair", *(["priority"] if all("priority" in r for r in runs.values()) else [])]
    measured = {arm: _arm(runs, sc, arm) for arm in arms}
    unfair = _arm(runs, sc, "unfair")
    for arm, m in measured.items():
        m["goodput_fair_vs_unfair"] = _min(
            _ratio(r[arm]["goodput_tok_s"], r["unfair"]["goodput_tok_s"]) for r in runs.values()
        )
        m["ceiling_on_vs_off"] = ceiling
    return [_row(t, measured, unfair) for t in TARGETS]


def combine(summaries: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The targets over repeated runs (``--repeat``): each figure's median over the repeats (its verdict
    is the median's) and its range, ``[least, most]``; one repeat is its own summary."""
    if len(summaries) == 1:
        return summaries[0]
    out = []
    for i, t in enumerate(TARGETS):
        rows = [s[i] for s in summaries]
        row: dict[str, Any] = {"key": t.key, "figure": t.label, "target": t.target, "repeats": len(rows)}
        for key, judged in (("measured", "verdict"), ("baseline", None), ("priority", "priority_verdict")):
            if key not in rows[0]:
                continue
            vals = [r[key] for r in rows if r[key] is not None]
            mid = statistics.median(vals) if vals else None
            row[key] = mid
            row[f"{key}_range"] = [min(vals), max(vals)] if vals else None
            if judged is not None:
                row[judged] = verdict(t, mid)
        out.append(row)
    return out


def _row(
    t: Target, measured: dict[str, dict[str, float | None]], unfair: dict[str, float | None]
) -> dict[str, Any]:
    fair = measured["fair"]
    row = {
        "key": t.key,
        "figure": t.label,
        "target": t.target,
        "measured": fair.get(t.key),
        "baseline": unfair.get(t.key),
        "verdict": verdict(t, fair.get(t.key)),
    }
    if "priority" in measured:
        prio = measured["priority"].get(t.key)
        row |= {"priority": prio, "priority_verdict": verdict(t, prio)}
    return row
