"""What the per-tenant figures read of the store: a range's records, with their tenant.

One read for the controller's observation (the tenant alerts and metrics), ``GET /v1/tenants``,
``pdscope explain --tenant`` and the dashboard's *Tenants* page; the rows become
``analysis.tenants.TenantFacts`` (``TenantFacts(*row)``: the columns :data:`TENANT_COLUMNS`, in that
order). ``RecordFilter.tenant`` narrows it to one tenant's records (``ix_request_records_tenant_ts``).
Bounded: at most ``limit`` records, the newest, and it says when it left some out. It reads; it never writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import Connection, func, select
from sqlalchemy.orm import Session

from store.models import RequestRecord
from store.queries import EVERY_RECORD, RecordFilter

MAX_RECORDS: Final = 500_000  # the most any caller may ask for
DEFAULT_RECORDS: Final = 200_000

_R = RequestRecord
# the order of analysis.tenants.TenantFacts
TENANT_COLUMNS: Final = (
    _R.tenant,
    _R.status,
    _R.attributes["reject_reason"].as_string(),
    _R.proxy_in,
    func.coalesce(_R.p_sent, _R.d_sent),
    _R.ttft_s,
    _R.tpot_s,
    _R.prompt_tokens,
    _R.completion_tokens,
)


@dataclass(frozen=True)
class TenantRows:
    """Rows read, newest first; ``truncated``: more matched than the limit (the oldest were left out)."""

    rows: tuple[tuple[Any, ...], ...]
    truncated: bool


def tenant_rows(
    reader: Session | Connection,
    since: float,
    until: float,
    *,
    only: RecordFilter = EVERY_RECORD,
    limit: int = DEFAULT_RECORDS,
) -> TenantRows:
    """The records in ``[since, until]`` (by ``proxy_in``) that ``only`` keeps (``only.tenant``: one
    tenant's), read through a
    session (the controller) or a connection (the dashboard), at most ``limit`` (1 to
    :data:`MAX_RECORDS`, else ``ValueError``), the newest first."""
    if not 1 <= limit <= MAX_RECORDS:
        raise ValueError(f"limit must be 1 to {MAX_RECORDS}, got {limit}")
    stmt = select(*TENANT_COLUMNS).where(_R.proxy_in >= since, _R.proxy_in <= until)
    stmt = stmt.order_by(_R.proxy_in.desc(), _R.id.desc()).limit(limit + 1)
    rows = reader.execute(only.apply(stmt)).all()
    return TenantRows(tuple(tuple(r) for r in rows[:limit]), len(rows) > limit)
