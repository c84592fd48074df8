"""Each tenant's window read from the store: the records the controller believes, the pure figures.

Shared by the controller's observation (``TenantSLOBreach``, ``TenantStarved``, the ``pdscope_tenant_*``
metrics), ``GET /v1/tenants`` and ``pdscope explain --tenant``. The records are those the controller
believes (``controller.trusted_span_senders``), at most ``limit``, the newest (``truncated`` says when
older ones were left out); the figures are :func:`analysis.tenants.tenant_window` under the config's
tenants and SLOs.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from analysis.tenants import TenantFacts, TenantFigures, TenantWindow, tenant_window, terms_of
from controller.schemas import TenantOut, TenantsOut
from pdscope.config import Settings
from pdscope.tenantcost import Costs
from store.attribution import trusted_records
from store.tenants import DEFAULT_RECORDS, tenant_rows
from store.window import WindowRows


@dataclass(frozen=True)
class ReadTenants:
    """The figures of a range, and whether its oldest records were left out."""

    window: TenantWindow
    truncated: bool
    limit: int


def read_tenants(
    session: Session, settings: Settings, lo: float, hi: float, *, limit: int = DEFAULT_RECORDS
) -> ReadTenants:
    """Every declared tenant's figures over the believed records of ``lo``..``hi``."""
    only = trusted_records(settings.controller.trusted_span_senders)
    return tenant_figures(tenant_rows(session, lo, hi, only=only, limit=limit), settings, lo, hi, limit)


def tenant_figures(read: WindowRows, settings: Settings, lo: float, hi: float, limit: int) -> ReadTenants:
    """Every declared tenant's figures over ``read`` (the believed records of ``lo``..``hi``, at most
    ``limit``: :func:`store.tenants.tenant_rows`' or the kept window's, ``controller.tenantrows``)."""
    window = tenant_window(
        (TenantFacts(*r) for r in read.rows),
        terms_of(settings.tenants, settings.slo),
        since=lo,
        until=hi,
        costs=Costs.of(settings.tenants),
    )
    return ReadTenants(window, read.truncated, limit)


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1000.0


def tenant_out(t: TenantFigures) -> TenantOut:
    """One tenant's figures as ``GET /v1/tenants`` answers them."""
    return TenantOut(
        tenant=t.tenant,
        weight=t.weight,
        priority=t.priority,
        ttft_target_ms=t.ttft_target_s * 1000.0,
        tpot_target_ms=t.tpot_target_s * 1000.0,
        requests=t.requests,
        demand=t.demand,
        served=t.served,
        met=t.met,
        failed=t.failed,
        rejected=dict(t.rejected),
        waited=t.waited,
        attainment=t.attainment,
        ttft_observed_ms=_ms(t.ttft_at_slo_s),
        tpot_observed_ms=_ms(t.tpot_at_slo_s),
        queued_p50_ms=_ms(t.queued_p50_s),
        queued_p99_ms=_ms(t.queued_p99_s),
        service=t.service,
        goodput_tokens=t.goodput_tokens,
        goodput_tokens_per_s=t.goodput_tokens_per_s,
        fair_share=t.fair_share,
        service_share=t.service_share,
        starved=t.starved,
    )


def tenants_out(read: ReadTenants, settings: Settings, only: str | None = None) -> TenantsOut:
    """The range's figures as ``GET /v1/tenants`` answers them: every tenant, or ``only`` that one."""
    w = read.window
    return TenantsOut(
        since=w.since,
        until=w.until,
        enabled=settings.tenants.enabled,
        goodput_attainment_target=settings.slo.goodput_attainment,
        jain=w.jain,
        undeclared=w.undeclared,
        truncated=read.truncated,
        record_limit=read.limit,
        tenants=[tenant_out(t) for t in w.tenants if only is None or t.tenant == only],
    )
