"""``pdscope explain --tenant T``: one tenant's window in plain words, from the store.

What it asked (its requests; those refused as the client's mistake are not demand), what it was served,
what was rejected and why, its SLO attainment against its own targets (``tenants.<id>.slo``, else the
fleet's) and the attainment target, how long it waited for admission, its fair share (its weight over
the weights of the tenants that asked) against the share of the service it got, Jain's index over the
tenants that asked, and the stage its misses spent their time in (``analysis.attribution`` over its
records alone, under its own targets). With ``--json``: ``GET /v1/tenants?tenant=T``'s JSON with the
attribution beside it. The figures are ``controller.tenants``' (``analysis.tenants``). Exit codes: 0 an
answer, 1 no request of the tenant in the range or the store cannot be read, 2 a tenant the config does
not declare.
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from pdscope.cli.bounds import fail
from pdscope.config import TENANT_ID, Settings

if TYPE_CHECKING:  # the controller is imported when the command runs, not when the CLI starts
    from analysis.attribution import Attribution
    from analysis.tenants import TenantFigures, TenantWindow


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _undeclared(tenant: str, settings: Settings) -> str | None:
    """Why ``tenant`` cannot be explained (malformed, or not declared); None when it can."""
    if TENANT_ID.fullmatch(tenant) is None:
        return f"--tenant: {tenant[:64]!r} is not a tenant id (1-63 of letters, digits, '_', '.', '@', '-')"
    if tenant not in settings.tenants.tenants:
        names = ", ".join(list(settings.tenants.tenants)[:20])
        return f"--tenant: {tenant!r} is not declared (tenants.tenants: {names})"
    return None


def run(args: argparse.Namespace, settings: Settings, lo: float, hi: float, url: str, limit: int) -> int:
    """The tenant mode of ``pdscope explain``: the range ``lo``..``hi`` is already checked."""
    tenant: str = args.tenant
    if (why := _undeclared(tenant, settings)) is not None:
        return fail("explain", why, 2)
    from analysis.attribution import attribute
    from analysis.tenants import tenant_slo
    from controller.attribution import read_records
    from controller.tenants import read_tenants, tenants_out
    from store import queries as q
    from store.attribution import trusted_senders
    from store.db import StoreError, opened, transaction

    senders = trusted_senders(settings)
    only = q.RecordFilter(None if senders is None else frozenset(senders), charged_only=True, tenant=tenant)
    slo = tenant_slo(settings.tenants, settings.slo, tenant)
    try:
        with opened(url) as sessions, transaction(sessions) as session:
            read = read_tenants(session, settings, lo, hi, limit=limit)
            records, _ = read_records(session, lo, hi, only=only, limit=limit)
    except StoreError as exc:
        return fail("explain", f"the store cannot be read: {exc}")
    figures = read.window.of(tenant)
    if figures is None or figures.requests == 0:
        return fail("explain", f"no request of tenant {tenant} from {_when(lo)} to {_when(hi)}")
    attribution = attribute(records, slo, since=lo, until=hi)
    if args.json:
        body = tenants_out(read, settings, tenant).model_dump()
        body["attribution"] = attribution.as_dict(max_misses=args.misses)
        print(json.dumps(body, indent=2, sort_keys=True))
        return 0
    print("\n".join(tenant_words(figures, read.window, attribution, settings.slo.goodput_attainment)))
    return 0


def _ms(s: float | None) -> str:
    return "—" if s is None else f"{s * 1000:.0f} ms"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.0f}%"


def _rejected(t: TenantFigures) -> str:
    if not t.rejected:
        return "none rejected"
    reasons = ", ".join(f"{n} {r}" for r, n in sorted(t.rejected.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"{t.rejected_total} rejected ({reasons})"


def _slo_line(t: TenantFigures, target: float) -> str:
    if t.attainment is None:
        return "  SLO: none served, so no attainment."
    verdict = "under target" if t.attainment < target else "on target"
    return (
        f"  SLO: {t.met} of {t.served} served requests met its targets (TTFT {_ms(t.ttft_target_s)}, TPOT "
        f"{_ms(t.tpot_target_s)}): attainment {_pct(t.attainment)} against {_pct(target)}, {verdict}; "
        f"TTFT {_ms(t.ttft_at_slo_s)}, TPOT {_ms(t.tpot_at_slo_s)} at the SLO percentiles."
    )


def _share_line(t: TenantFigures, w: TenantWindow) -> str:
    asking = [x for x in w.tenants if x.demand > 0]
    jain = "—" if w.jain is None else f"{w.jain:.2f}"
    if t.fair_share is None:
        return f"  Share: it asked nothing, so no fair share; Jain's index over the tenants asking: {jain}."
    return (
        f"  Share: its weight {t.weight:g} makes its fair share {_pct(t.fair_share)} among the "
        f"{len(asking)} tenant(s) asking; it got {_pct(t.service_share)} of the service. "
        f"Jain's index over the tenants asking: {jain}."
    )


def tenant_words(t: TenantFigures, w: TenantWindow, a: Attribution, target: float) -> list[str]:
    """The tenant's window as lines for a person."""
    lines = [
        f"Tenant {t.tenant} (class {t.priority}, weight {t.weight:g}), {_when(w.since)} .. {_when(w.until)}:",
        f"  Demand: {t.demand} request(s) ({t.requests - t.demand} refused as the client's mistake).",
        f"  Served {t.served}, {_rejected(t)}, {t.failed} failed (error or timeout).",
        _slo_line(t, target),
        f"  Admission wait: median {_ms(t.queued_p50_s)}, p99 {_ms(t.queued_p99_s)}; {t.waited} waited.",
        _share_line(t, w),
    ]
    if t.starved:
        lines.append("  It asked and was served nothing in this range: starved (TenantStarved).")
    if a.top:
        lines.append(f"  Where its misses spent their time ({a.summary()}):")
        lines.extend(f"    {k}. {g.message}" for k, g in enumerate(a.top, 1))
    else:
        lines.append(f"  Its misses: {a.summary()}.")
    return lines
