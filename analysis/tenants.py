"""Per-tenant SLO figures over a window of request records: the one home for them.

For each tenant the config declares (``tenants.tenants``; ``default`` always among them): its requests,
how many were served, how many refused and why, its TTFT and TPOT at the fleet's SLO percentiles held
against *its own* targets (``tenants.<id>.slo``, else the fleet's ``slo``), its SLO attainment (served
requests meeting both of its targets over served requests, as the fleet's ``GoodputAttainmentLow``
counts them), its goodput (prompt + completion tokens of those requests, and per second), the time its
requests waited for admission in the proxy (``proxy_in`` to the first leg sent), and its service: the
prompt tokens of its served requests plus what their decode cost D (``pdscope.tenantcost``: each
completion token at ``tenants.cost_per_decode_token``, and the KV each held times its decode steps at
``tenants.cost_per_kv_token_step``), the fair queue's own charges. Its fair share is its weight over the
weights of the tenants with demand (a request in the window, not refused as the client's mistake).

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
``tenant_rate``, ...) when it is one, else ``other``; at most :data:`MAX_REASONS` per tenant: its
most common (ties by name), the rest ``other``, whatever order the records come in.

The arithmetic is :class:`TenantTally`'s, which keeps the figures' terms as records are added and taken
back (``controller.tenantrows`` keeps one between the controller's ticks); :func:`tenant_window` is a
tally built once.

Pure: rows in, figures out (``store.tenants`` reads the rows).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final, NamedTuple

from sortedcontainers import SortedList

from pdscope.config import DEFAULT_TENANT, SLOSettings, TenantSettings
from pdscope.slo import slo_verdict
from pdscope.stats import percentile_of_sorted
from pdscope.tenantcost import DEFAULT_COSTS, Costs, kv_token_steps

MAX_REASONS: Final = 16  # reject reasons shown per tenant; the rest are "other"
KEPT_REASONS: Final = 1024  # reject reasons a tenant's tally holds by name; past them, "other"
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


def _bounded(reasons: Mapping[str, int]) -> dict[str, int]:
    """At most :data:`MAX_REASONS`: the most common named reasons (ties by name), the rest as ``other``."""
    named = sorted((k for k, n in reasons.items() if k != OTHER and n > 0), key=lambda k: (-reasons[k], k))
    out = {k: reasons[k] for k in named[: MAX_REASONS - 1]}
    rest = reasons.get(OTHER, 0) + sum(reasons[k] for k in named[MAX_REASONS - 1 :])
    if rest > 0:
        out[OTHER] = rest
    return out


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def _queue_wait(r: TenantFacts) -> float | None:
    """Its wait for admission (``proxy_in`` to the first leg sent); None unsent or unordered."""
    if r.admitted is None or r.admitted < r.proxy_in:
        return None
    return _finite(r.admitted - r.proxy_in)


_Values = tuple[float | None, float | None, float | None]


def _values(r: TenantFacts) -> _Values:
    """``r``'s entries in a tenant's sorted TTFTs, TPOTs (served ones') and admission waits (None: none)."""
    served = r.status == "ok"
    return (_finite(r.ttft_s) if served else None, _finite(r.tpot_s) if served else None, _queue_wait(r))


def _means(served: int, prompt: int, completion: int, fallback: tuple[float, float]) -> tuple[float, float]:
    """The mean prompt and completion tokens of ``served`` requests of those sums; ``fallback`` when none."""
    return (prompt / served, completion / served) if served else fallback


class _Own:
    """One tenant's counts, token sums and sorted values over the records it holds (whole numbers, so a
    record removed takes back exactly what it added)."""

    def __init__(self) -> None:
        self.requests = self.demand = self.served = self.met = self.failed = self.waited = 0
        self.served_prompt = self.served_completion = self.served_kv = self.met_tokens = 0
        self.unserved = self.unserved_prompt = self.unserved_unknown = 0  # demand not served; its prompts
        self.reasons: dict[str, int] = {}
        self.ttft: SortedList[float] = SortedList()  # served ones'
        self.tpot: SortedList[float] = SortedList()
        self.queued: SortedList[float] = SortedList()

    def count(self, r: TenantFacts, slo: SLOSettings, sign: int, values: _Values) -> None:
        """Add (``sign`` 1) or take back (-1) ``r``'s counts and sums (``values``: its :func:`_values`)."""
        self.requests += sign
        demand = r.status not in _NOT_DEMAND
        self.demand += sign * demand
        self.failed += sign * (r.status in ("error", "timeout"))
        wait = values[2]
        self.waited += sign * (wait is not None and wait > 0)
        prompt, completion = int(r.prompt_tokens or 0), int(r.completion_tokens or 0)
        if r.status == "rejected":
            self._reason(_reason(r.reject_reason), sign)
        if r.status == "ok":
            self.served += sign
            self.served_prompt += sign * prompt
            self.served_completion += sign * completion
            self.served_kv += sign * kv_token_steps(prompt, completion)
            if slo_verdict(r.status, r.ttft_s, r.tpot_s, slo).met:
                self.met += sign
                self.met_tokens += sign * (prompt + completion)
        elif demand:
            self.unserved += sign
            self.unserved_unknown += sign * (r.prompt_tokens is None)
            self.unserved_prompt += sign * prompt

    def place(self, values: _Values, sign: int) -> None:
        """Add a record's :func:`_values` to the sorted TTFTs, TPOTs and waits, or take them back."""
        for kept, v in zip((self.ttft, self.tpot, self.queued), values, strict=True):
            if v is not None:
                kept.add(v) if sign > 0 else kept.remove(v)

    def _reason(self, name: str, sign: int) -> None:
        held = self.reasons
        if name not in held and (sign < 0 or len(held) >= KEPT_REASONS):
            name = OTHER
        left = held.get(name, 0) + sign
        if left > 0:
            held[name] = left
        else:
            held.pop(name, None)

    def means(self, fallback: tuple[float, float]) -> tuple[float, float]:
        """The mean prompt and completion tokens of its served requests; ``fallback`` when none."""
        return _means(self.served, self.served_prompt, self.served_completion, fallback)

    def figures(self, name: str, terms: TenantTerms, span_s: float, costs: Costs) -> TenantFigures:
        """Its figures (shares are filled in by :meth:`TenantTally.window`)."""
        slo = terms.slo
        q50, q99 = (_at(self.queued, 50), _at(self.queued, 99))
        return TenantFigures(
            tenant=name,
            weight=terms.weight,
            priority=terms.priority,
            ttft_target_s=slo.ttft.target_ms / 1000.0,
            tpot_target_s=slo.tpot.target_ms / 1000.0,
            requests=self.requests,
            demand=self.demand,
            served=self.served,
            met=self.met,
            failed=self.failed,
            rejected=_bounded(self.reasons),
            waited=self.waited,
            ttft_at_slo_s=_at(self.ttft, slo.ttft.percentile),
            tpot_at_slo_s=_at(self.tpot, slo.tpot.percentile),
            queued_p50_s=q50,
            queued_p99_s=q99,
            service=self.service(costs),
            goodput_tokens=self.met_tokens,
            goodput_tokens_per_s=self.met_tokens / span_s,
        )

    def service(self, costs: Costs) -> float:
        return self.served_prompt + costs.decode * self.served_completion + costs.kv * self.served_kv

    def asked(self, costs: Costs, fleet: tuple[float, float]) -> float:
        """The service it asked for: its served requests' own, and for each request of its demand not
        served, its prompt tokens (unknown: its served ones' mean, else ``fleet``'s) and the decode cost
        of its served ones' mean completion (else ``fleet``'s) after their mean prompt."""
        prompt, out = self.means(fleet)
        decode = costs.d(round(prompt), round(out))
        unserved = self.unserved_prompt + self.unserved_unknown * prompt + self.unserved * decode
        return self.service(costs) + unserved


def _at(values: Sequence[float], q: float) -> float | None:
    return percentile_of_sorted(values, q) if values else None


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


class TenantTally:
    """Every tenant of ``terms``' counts and sorted values over the records it holds, kept as records are
    added and taken back (``controller.tenantrows`` keeps one between ticks); :meth:`window` gives the
    figures. Built whole by :meth:`of`. Exact: whole numbers and sorted values, so a tally kept through
    any adds and removals reads what one built from its records reads, to the bit (one bound: a tenant's
    reject reasons past :data:`KEPT_REASONS` names count as ``other``, and may then be split otherwise)."""

    def __init__(self, terms: Mapping[str, TenantTerms]) -> None:
        self.terms = dict(terms)
        self._own = {name: _Own() for name in terms}
        self.undeclared = 0

    @classmethod
    def of(cls, facts: Iterable[TenantFacts], terms: Mapping[str, TenantTerms]) -> TenantTally:
        """A tally of ``facts``, their values sorted once."""
        tally = cls(terms)
        values: dict[str, tuple[list[float], list[float], list[float]]] = {n: ([], [], []) for n in terms}
        for r in facts:
            counted = tally._count(r, 1)
            if counted is not None:
                for kept, v in zip(values[counted[0]], counted[1], strict=True):
                    if v is not None:
                        kept.append(v)
        for name, (ttft, tpot, queued) in values.items():
            own = tally._own[name]
            own.ttft, own.tpot, own.queued = SortedList(ttft), SortedList(tpot), SortedList(queued)
        return tally

    def add(self, r: TenantFacts) -> None:
        counted = self._count(r, 1)
        if counted is not None:
            self._own[counted[0]].place(counted[1], 1)

    def remove(self, r: TenantFacts) -> None:
        """Take back a record :meth:`add` (or :meth:`of`) counted."""
        counted = self._count(r, -1)
        if counted is not None:
            self._own[counted[0]].place(counted[1], -1)

    def _count(self, r: TenantFacts, sign: int) -> tuple[str, _Values] | None:
        """Count ``r`` in its tenant's (``default``'s when absent or undeclared): the tenant and ``r``'s
        :func:`_values`; None: no such tenant."""
        name = r.tenant if r.tenant in self._own else DEFAULT_TENANT
        self.undeclared += sign * (r.tenant is not None and r.tenant not in self._own)
        own = self._own.get(name)
        if own is None:  # a map without default (a caller's own) leaves the rest out
            return None
        values = _values(r)
        own.count(r, self.terms[name].slo, sign, values)
        return name, values

    def window(self, since: float, until: float, costs: Costs = DEFAULT_COSTS) -> TenantWindow:
        """Every tenant's figures over ``since``..``until`` (the records held)."""
        span = max(until - since, 1e-9)
        owns = self._own.items()
        figures = [own.figures(name, self.terms[name], span, costs) for name, own in owns]
        every = self._own.values()  # the served requests of all, for their means
        fleet = _means(
            sum(o.served for o in every),
            sum(o.served_prompt for o in every),
            sum(o.served_completion for o in every),
            (0.0, 0.0),
        )
        asked = {name: own.asked(costs, fleet) for name, own in owns}
        shared, jain = _shares(figures, asked)
        return TenantWindow(since, until, tuple(shared), jain, self.undeclared)


def tenant_window(
    facts: Iterable[TenantFacts],
    terms: Mapping[str, TenantTerms],
    *,
    since: float,
    until: float,
    costs: Costs = DEFAULT_COSTS,
) -> TenantWindow:
    """Every tenant of ``terms``'s figures over the records ``facts`` of ``since``..``until``."""
    return TenantTally.of(facts, terms).window(since, until, costs)
