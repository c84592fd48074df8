"""Tenants: the declared tenants side by side over the window.

For each tenant the config declares (``tenants``): its share of the fleet's service against the share
its weight gives it among the tenants that asked, its SLO attainment against the target (held to its
own TTFT and TPOT targets where it has them), how long its requests waited for admission, and what was
refused and why; above them Jain's index over service / weight and the tenants starved or under
target. The figures are ``analysis.tenants``' over the records the controller believes, as its
``TenantSLOBreach`` and ``TenantStarved`` alerts and ``GET /v1/tenants`` read them
(``dashboard.queries.tenants``).
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from analysis.tenants import TenantFigures, TenantWindow
from dashboard import charts, context, data, ui
from dashboard.views.opening import Opened, run_page
from store.attribution import trusted_senders

view = context.current()
url = view.store_url
settings = view.settings
SENDERS = trusted_senders(settings)
TARGET = settings.slo.goodput_attainment


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.0f}%"


def _headline(w: TenantWindow) -> None:
    asking = [t for t in w.tenants if t.demand > 0]
    under = [t.tenant for t in asking if t.attainment is not None and t.attainment < TARGET]
    starved = [t.tenant for t in w.tenants if t.starved]
    cols = st.columns(4)
    cols[0].metric("tenants asking", f"{len(asking)} of {len(w.tenants)}")
    cols[1].metric("Jain's index", "—" if w.jain is None else f"{w.jain:.2f}", "1.00: fair-queue service")
    cols[2].metric("under SLO target", str(len(under)), ", ".join(under) or "none", delta_color="off")
    cols[3].metric("starved", str(len(starved)), ", ".join(starved) or "none", delta_color="off")
    if not settings.tenants.enabled:
        st.info(
            "Tenants are off (tenants.enabled: false): every request is the default tenant's.",
            icon=":material/info:",
        )
    for name in starved:
        st.error(f"Tenant {name} asked and was served nothing in this range (TenantStarved).")


def _row(t: TenantFigures) -> dict[str, object]:
    return {
        "tenant": t.tenant,
        "class": t.priority,
        "weight": t.weight,
        "fair_share": t.fair_share,
        "service_share": t.service_share,
        "requests": t.requests,
        "served": t.served,
        "rejected": t.rejected_total,
        "failed": t.failed,
        "queued_p50_ms": None if t.queued_p50_s is None else t.queued_p50_s * 1000,
        "queued_p99_ms": None if t.queued_p99_s is None else t.queued_p99_s * 1000,
        "ttft_ms": None if t.ttft_at_slo_s is None else t.ttft_at_slo_s * 1000,
        "ttft_target_ms": t.ttft_target_s * 1000,
        "tpot_ms": None if t.tpot_at_slo_s is None else t.tpot_at_slo_s * 1000,
        "tpot_target_ms": t.tpot_target_s * 1000,
        "attainment": t.attainment,
        "goodput_tok_s": t.goodput_tokens_per_s,
    }


_FORMAT = {
    **{
        c: st.column_config.NumberColumn(format="percent")
        for c in ("fair_share", "service_share", "attainment")
    },
    **{
        c: st.column_config.NumberColumn(format="%.0f")
        for c in ("queued_p50_ms", "queued_p99_ms", "ttft_ms", "tpot_ms", "goodput_tok_s")
    },
}


def _shares(w: TenantWindow) -> pd.DataFrame:
    rows = []
    for t in w.tenants:
        if t.demand > 0:
            rows.append({"tenant": t.tenant, "share": t.fair_share or 0.0, "of": "fair share (weight)"})
            rows.append({"tenant": t.tenant, "share": t.service_share or 0.0, "of": "service it got"})
    return pd.DataFrame(rows, columns=["tenant", "share", "of"])


def _attainment(w: TenantWindow) -> pd.DataFrame:
    rows = []
    for t in w.tenants:
        if t.attainment is not None:
            rows.append({"tenant": t.tenant, "share": t.attainment, "of": "SLO attainment"})
            rows.append({"tenant": t.tenant, "share": TARGET, "of": "target"})
    return pd.DataFrame(rows, columns=["tenant", "share", "of"])


def _rejections(w: TenantWindow) -> pd.DataFrame:
    rows = [
        {"tenant": t.tenant, "reason": reason, "share": n / t.requests}
        for t in w.tenants
        for reason, n in sorted(t.rejected.items())
        if t.requests
    ]
    return pd.DataFrame(rows, columns=["tenant", "reason", "share"])


def _charts(w: TenantWindow) -> None:
    left, right = st.columns(2)
    shares, attained = _shares(w), _attainment(w)
    with left:
        if not shares.empty:
            st.altair_chart(
                charts.paired_bars(
                    shares, "tenant", "share", "of", "share of service vs weight", "share", "%"
                ),
                width="stretch",
            )
    with right:
        if not attained.empty:
            st.altair_chart(
                charts.paired_bars(
                    attained, "tenant", "share", "of", "SLO attainment vs target", "attainment", "%"
                ),
                width="stretch",
            )
    rejected = _rejections(w)
    if rejected.empty:
        st.caption("No request was rejected in this range.")
        return
    order = [t.tenant for t in w.tenants]
    st.altair_chart(
        charts.share_bars(
            rejected, "tenant", "share", "reason", "share of requests rejected, by reason", order
        ),
        width="stretch",
    )


def _read_notes(truncated: bool, limit: int, undeclared: int) -> list[str]:
    """What the reader should know about the records read."""
    notes = [f"Only the newest {limit:,} requests of the range were read."] if truncated else []
    if undeclared:
        notes.append(
            f"{undeclared:,} records name a tenant the config no longer declares: counted as default's."
        )
    return notes


def render(opened: Opened) -> None:
    window = opened.window
    result = data.tenant_window(url, window.start, window.end, SENDERS, settings.tenants, settings.slo)
    w = result.window
    if not any(t.requests for t in w.tenants):
        ui.no_data(view, "request records", opened.latest)
        return
    for note in _read_notes(result.truncated, result.limit, w.undeclared):
        st.caption(note)
    _headline(w)
    st.subheader("Shares and SLOs")
    _charts(w)
    st.subheader("Per tenant")
    st.dataframe(
        pd.DataFrame([_row(t) for t in w.tenants]), hide_index=True, width="stretch", column_config=_FORMAT
    )


run_page(view, "Tenants", "each tenant's share, queue, rejections and SLO", "request records", render)
