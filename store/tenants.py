"""What the per-tenant figures read of the store: a range's records, with their tenant.

One read for the controller's observation (the tenant alerts and metrics), ``GET /v1/tenants``,
``pdscope explain --tenant`` and the dashboard's *Tenants* page; the rows become
``analysis.tenants.TenantFacts`` (``TenantFacts(*row)``: the columns :data:`TENANT_COLUMNS`, in that
order). ``RecordFilter.tenant`` narrows it to one tenant's records (``ix_request_records_tenant_ts``).
Bounded: at most ``limit`` records, the newest, and it says when it left some out. It reads; it never writes.
"""

from __future__ import annotations

from typing import Final

from sqlalchemy import Connection, func
from sqlalchemy.orm import Session

from store.models import RequestRecord
from store.queries import EVERY_RECORD, RecordFilter
from store.window import WindowRows, window_rows

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


def tenant_rows(
    reader: Session | Connection,
    since: float,
    until: float,
    *,
    only: RecordFilter = EVERY_RECORD,
    limit: int = DEFAULT_RECORDS,
) -> WindowRows:
    """The records in ``[since, until]`` (by ``proxy_in``) that ``only`` keeps (``only.tenant``: one
    tenant's), newest first, at most ``limit`` (1 to :data:`MAX_RECORDS`, else ``ValueError``)."""
    return window_rows(reader, TENANT_COLUMNS, since, until, only=only, limit=limit, max_limit=MAX_RECORDS)
