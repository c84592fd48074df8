"""Per-tenant SLO figures over a window of request records: the one home for them.

For each tenant the config declares (``tenants.tenants``; ``default`` always among them): its requests,
how many were served, how many refused and why, its TTFT and TPOT at the fleet's SLO percentiles held
against *its own* targets (``tenants.<id>.slo``, else the fleet's ``slo``), its SLO attainment (served
requests meeting both of its targets over served requests, as the fleet's ``GoodputAttainmentLow``
counts them), its goodput (prompt + completion tokens of those requests, and per second), the time its
requests waited for admission in the proxy (``proxy_in`` to the first leg sent), and its service: the
prompt tokens plus ``tenants.cost_per_decode_token`` × the completion tokens of its served requests,
the fair queue's own counter. Its fair share is its weight over the weights of the tenants with demand
(a request in the window, not refused as the client's mistake).

Jain's index ``(Σx)² / (n·Σx²)`` says how fairly the fleet served the tenants with demand, with ``x``
each one's service over its **fair allocation**: the weighted max-min share of all the service given
(water-filling: a tenant that asked for less than its weight's part gets all it asked, and the rest is
shared by weight among the others). What a tenant asked is its service plus, for each of its requests
not served, its prompt tokens and the decode cost of its served requests' mean completion. So 1 is
every tenant served as a fair queue would (by weight while all are backlogged; all they asked when some
asked little), and 1/n one tenant got everything. Divided by the weight alone instead, a tenant that
asked for less than its share and got all of it lowered the index (two tenants at weights 2:1 each
served all it asked at low load read 0.90).

A record whose tenant is absent (stored before records had one, or refused by the collector) or no longer
declared counts as ``default``'s (``undeclared`` counts the latter), so the tenants are exactly the
config's: a label never grows past the file. A reject reason is the proxy's word (``queue_full``,
``tenant_rate``, ...) when it is one, else ``other``; at most :data:`MAX_REASONS` per tenant.

Pure: rows in, figures out (``store.tenants`` reads the rows).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final, NamedTuple

from pdscope.config import DEFAULT_TENANT, SLOSettings, TenantSettings
from pdscope.slo import slo_verdict
from pdscope.stats import percentiles

MAX_REASONS: Final = 16  # reject reasons kept per tenant; the rest are "other"
OTHER: Final = "other"
_REASON: Final = re.compile(r"[a-z][a-z0-9_]{0,31}")
# refused as the client's own mistake: not demand on the fleet
_NOT_DEMAND: Final = frozenset({"client_error"})


class TenantFacts(NamedTuple):
    """What the figures read of one record (``store.tenants.TENANT_COLUMNS``, in this order)."""

    tenant: str | None
    status: str
    reject_reason: str | None
    proxy_in: float
    admitted: float | None  # the first leg sent (P's, or D's on the decode-only path)
    ttft_s: float | None
    tpot_s: float | None
    prompt_tokens: int | None
    completion_tokens: int | None


@dataclass(frozen=True)
class TenantTerms:
    """What the config gives one tenant: its weight, class and the SLO it is held to."""

    weight: float
    priority: str
    slo: SLOSettings


def tenant_slo(tenants: TenantSettings, fleet: SLOSettings, tenant: str) -> SLOSettings:
    """The fleet's ``slo`` with the tenant's own targets in place of the fleet's where it has them."""
    declared = tenants.tenants.get(tenant)
    if declared is None:
        return fleet
    own = declared.slo
    return fleet.model_copy(
        update={
            "ttft": fleet.ttft.model_copy(update={"target_ms": own.ttft_ms or fleet.ttft.target_ms}),
            "tpot": fleet.tpot.model_copy(update={"target_ms": own.tpot_ms or fleet.tpot.target_ms}),
        }
    )


def terms_of(tenants: TenantSettings, fleet: SLOSettings) -> dict[str, TenantTerms]:
    """Every declared tenant's terms (``tenants``; the SLO ``fleet``'s where it has none), in the config's
    order."""
    return {
        name: TenantTerms(t.weight, t.priority, tenant_slo(tenants, fleet, name))
        for name, t in tenants.tenants.items()
    }


@dataclass(frozen=True)
class TenantFigures:
    """One tenant's window (see the module's words for each figure)."""

    tenant: str
    weight: float
    priority: str
    ttft_target_s: float
    tpot_target_s: float
    requests: int = 0
    demand: int = 0  # requests not refused as the client's mistake
    served: int = 0  # status ok
    met: int = 0  # served within both of its targets
    failed: int = 0  # error or timeout
    rejected: Mapping[str, int] = field(default_factory=dict)  # by reason
    waited: int = 0  # requests with an admission wait over zero
    ttft_at_slo_s: float | None = None
    tpot_at_slo_s: float | None = None
    queued_p50_s: float | None = None
    queued_p99_s: float | None = None
    service: float = 0.0
    goodput_tokens: int = 0
    goodput_tokens_per_s: float = 0.0
    fair_share: float | None = None  # its weight over the weights of the tenants with demand
    service_share: float | None = None  # its service over all tenants' service

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    @property
    def attainment(self) -> float | None:
        return self.met / self.served if self.served else None

    @property
    def starved(self) -> bool:
        """It asked (refused, or kept waiting) and was served nothing."""
        return self.served == 0 and (self.rejected_total > 0 or self.waited > 0)


@dataclass(frozen=True)
class TenantWindow:
    """Every declared tenant's figures over ``since``..``until``, and Jain's index over their service."""

    since: float
    until: float
    tenants: tuple[TenantFigures, ...]
    jain: float | None  # None: no tenant with demand, or none served
    undeclared: int = 0  # records whose tenant the config no longer declares (counted as default's)

    def of(self, tenant: str) -> TenantFigures | None:
        return next((t for t in self.tenants if t.tenant == tenant), None)


def _reason(raw: str | None) -> str:
    return raw if isinstance(raw, str) and _REASON.fullmatch(raw) else OTHER


def _rejections(rows: Sequence[TenantFacts]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        if r.status != "rejected":
            continue
        reason = _reason(r.reject_reason)
        if reason not in out and len(out) >= MAX_REASONS - 1:
            reason = OTHER
        out[reason] = out.get(reason, 0) + 1
    return out


def _queued(rows: Sequence[TenantFacts]) -> list[float]:
    return [r.admitted - r.proxy_in for r in rows if r.admitted is not None and r.admitted >= r.proxy_in]


def _tokens(r: TenantFacts, decode_cost: float = 1.0) -> float:
    return (r.prompt_tokens or 0) + decode_cost * (r.completion_tokens or 0)


def _figures(
    name: str, terms: TenantTerms, rows: Sequence[TenantFacts], span_s: float, decode_cost: float
) -> TenantFigures:
    """One tenant's figures over its rows (shares are filled in by :func:`tenant_window`)."""
    slo = terms.slo
    served = [r for r in rows if r.status == "ok"]
    met = [r for r in served if slo_verdict(r.status, r.ttft_s, r.tpot_s, slo).met]
    (ttft_at,) = percentiles([r.ttft_s for r in served if r.ttft_s is not None], (slo.ttft.percentile,))
    (tpot_at,) = percentiles([r.tpot_s for r in served if r.tpot_s is not None], (slo.tpot.percentile,))
    queued = _queued(rows)
    q50, q99 = percentiles(queued, (50, 99))
    goodput = int(sum(_tokens(r) for r in met))
    return TenantFigures(
        tenant=name,
        weight=terms.weight,
        priority=terms.priority,
        ttft_target_s=slo.ttft.target_ms / 1000.0,
        tpot_target_s=slo.tpot.target_ms / 1000.0,
        requests=len(rows),
        demand=sum(1 for r in rows if r.status not in _NOT_DEMAND),
        served=len(served),
        met=len(met),
        failed=sum(1 for r in rows if r.status in ("error", "timeout")),
        rejected=_rejections(rows),
        waited=sum(1 for q in queued if q > 0),
        ttft_at_slo_s=ttft_at,
        tpot_at_slo_s=tpot_at,
        queued_p50_s=q50,
        queued_p99_s=q99,
        service=sum((_tokens(r, decode_cost) for r in served), 0.0),
        goodput_tokens=goodput,
        goodput_tokens_per_s=goodput / span_s,
    )


def jain_index(values: Sequence[float]) -> float | None:
    """Jain's fairness index of ``values``: 1 when all are equal, 1/n when one holds everything."""
    total, squares = sum(values), sum(v * v for v in values)
    if not values or squares <= 0:
        return None
    return total * total / (len(values) * squares)


def max_min_allocation(total: float, asks: Mapping[str, tuple[float, float]]) -> dict[str, float]:
    """``total`` shared by weighted max-min fairness among ``asks`` (name -> (weight, asked)): each gets
    at most what it asked; the rest is shared by weight among those that asked for more."""
    alloc = {n: 0.0 for n in asks}
    open_ = {n for n, (w, a) in asks.items() if w > 0 and a > 0}
    left = max(0.0, total)
    while open_ and left > 1e-12:
        level = left / sum(asks[n][0] for n in open_)
        sated = {n for n in open_ if asks[n][1] - alloc[n] <= level * asks[n][0]}
        if not sated:
            for n in open_:
                alloc[n] += level * asks[n][0]
            break
        for n in sated:
            left -= asks[n][1] - alloc[n]
            alloc[n] = asks[n][1]
        open_ -= sated
    return alloc


def _shares(
    figures: list[TenantFigures], asked: Mapping[str, float]
) -> tuple[list[TenantFigures], float | None]:
    """The figures with their fair and service shares, and Jain's index over the tenants with demand of
    their service over their fair allocation (:func:`max_min_allocation` of all the service given)."""
    asking = [f for f in figures if f.demand > 0]
    weights = sum(f.weight for f in asking)
    service = sum(f.service for f in figures)
    out = [
        replace(
            f,
            fair_share=f.weight / weights if f.demand > 0 and weights > 0 else None,
            service_share=f.service / service if service > 0 else None,
        )
        for f in figures
    ]
    alloc = max_min_allocation(service, {f.tenant: (f.weight, asked.get(f.tenant, 0.0)) for f in asking})
    return out, jain_index([f.service / alloc[f.tenant] for f in asking if alloc[f.tenant] > 0])


def _means(rows: Sequence[TenantFacts], fallback: tuple[float, float]) -> tuple[float, float]:
    """The mean prompt and completion tokens of ``rows``' served requests; ``fallback`` when none."""
    served = [r for r in rows if r.status == "ok"]
    if not served:
        return fallback
    n = len(served)
    return sum(r.prompt_tokens or 0 for r in served) / n, sum(r.completion_tokens or 0 for r in served) / n


def _asked(rows: Sequence[TenantFacts], decode_cost: float, fleet: tuple[float, float]) -> float:
    """The service a tenant's rows asked for: its served requests' own, and for each request of its
    demand not served, its prompt tokens (unknown: its served ones' mean, else ``fleet``'s) and the decode
    cost of its served ones' mean completion (else ``fleet``'s)."""
    prompt, out = _means(rows, fleet)
    unserved = [r for r in rows if r.status != "ok" and r.status not in _NOT_DEMAND]
    return sum(_tokens(r, decode_cost) for r in rows if r.status == "ok") + sum(
        (prompt if r.prompt_tokens is None else r.prompt_tokens) + decode_cost * out for r in unserved
    )


def tenant_window(
    facts: Iterable[TenantFacts],
    terms: Mapping[str, TenantTerms],
    *,
    since: float,
    until: float,
    decode_cost: float = 1.0,
) -> TenantWindow:
    """Every tenant of ``terms``'s figures over the records ``facts`` of ``since``..``until``."""
    by: dict[str, list[TenantFacts]] = {name: [] for name in terms}
    undeclared = 0
    for r in facts:
        if r.tenant is not None and r.tenant not in by:
            undeclared += 1
        rows = by.get(r.tenant if r.tenant in by else DEFAULT_TENANT)
        if rows is not None:  # a map without default (a caller's own) leaves the rest out
            rows.append(r)
    span = max(until - since, 1e-9)
    figures = [_figures(name, terms[name], rows, span, decode_cost) for name, rows in by.items()]
    fleet = _means([r for rows in by.values() for r in rows], (0.0, 0.0))
    asked = {name: _asked(rows, decode_cost, fleet) for name, rows in by.items()}
    shared, jain = _shares(figures, asked)
    return TenantWindow(since, until, tuple(shared), jain, undeclared)
