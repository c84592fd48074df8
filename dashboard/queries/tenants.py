"""Reads for the *Tenants* page: each declared tenant's window, as the controller computes it.

The page, ``GET /v1/tenants`` and the tenant alerts read the same records (``store.tenants``: those the
controller believes, ``controller.trusted_span_senders``) and run the same pure figures
(``analysis.tenants``), so they agree, and the page works with the controller down. An Engine and a
window in, the figures out; no Streamlit here.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine

from analysis.tenants import TenantFacts, TenantWindow, tenant_window, terms_of
from dashboard.queries.common import connect
from pdscope.config import SLOSettings, TenantSettings
from pdscope.tenantcost import Costs
from store.attribution import trusted_records
from store.tenants import DEFAULT_RECORDS, tenant_rows


@dataclass(frozen=True)
class WindowTenants:
    """The figures of the window, and whether its oldest records were left out."""

    window: TenantWindow
    truncated: bool
    limit: int


def tenants(
    engine: Engine,
    start: float,
    end: float,
    senders: tuple[str, ...] | None,
    declared: TenantSettings,
    slo: SLOSettings,
    limit: int = DEFAULT_RECORDS,
) -> WindowTenants:
    """Every declared tenant's figures over the newest ``limit`` believed records of ``[start, end]``."""
    with connect(engine) as conn:
        read = tenant_rows(conn, start, end, only=trusted_records(senders), limit=limit)
    window = tenant_window(
        (TenantFacts(*r) for r in read.rows),
        terms_of(declared, slo),
        since=start,
        until=end,
        costs=Costs.of(declared),
    )
    return WindowTenants(window, read.truncated, limit)
