"""Requests: search request records (id, status, instance, SLO miss, lease expiry) and
follow one request through proxy → P queue → P prefill → handoff → first token →
decode (or, served by D alone, proxy → D queue and prefill → first token → decode), with its
route path and the cached prompt tokens P and D reported (and the router predicted), beside
the NIXL figures of its decode instance at that moment.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from dashboard import charts, context, data, derive, summaries, ui
from dashboard.queries.common import Window
from dashboard.views.opening import Opened, run_page

view = context.current()
url = view.store_url
STATUSES = ["", "ok", "error", "timeout", "rejected", "client_error", "client_disconnect"]


def _filters() -> dict[str, object]:
    names = [inst.name for _, inst in view.settings.instances()]
    a, b, c, d, e = st.columns([3, 2, 2, 1, 1], vertical_alignment="bottom")
    return {
        "request_id": a.text_input(
            "Request or trace id",
            value=str(st.query_params.get("request", "")),
            key="q_id",
            placeholder="cmpl-… (prefix is enough)",
        ).strip(),
        "status": b.selectbox("Status", STATUSES, key="q_status", format_func=lambda s: s or "any"),
        "instance": c.selectbox(
            "Instance (P or D)", ["", *names], key="q_instance", format_func=lambda s: s or "any"
        ),
        "slo_miss": d.checkbox("SLO miss", key="q_slo_miss"),
        "lease_expiry": e.checkbox("Lease expiry", key="q_lease"),
    }


def _nixl_panel(rec: dict[str, Any]) -> None:
    d = rec.get("d_instance")
    st.markdown(f"**{d or 'no decode instance'}** around this request")
    start = rec.get("d_sent") or rec.get("proxy_in")
    if not d or start is None:
        st.caption("The request never reached a decode instance.")
        return
    t0 = float(start)
    # The pull ends by the first token: the scrape interval around it holds this transfer.
    t_ref = float(rec.get("first_token") or t0)
    t1 = float(rec.get("done") or t_ref)
    snaps = data.nixl_around(url, str(d), t0, t1)
    if len(snaps) < 2:
        st.caption("No snapshots of this instance around that time (was the collector running?).")
        return
    snaps = snaps.assign(instance=str(d))
    xfer = summaries.interval_means(snaps, "nixl_xfer_time_sum", "nixl_xfer_time_count", 1000.0)
    at = snaps[snaps["ts"] >= t_ref].head(1)
    # No scrape after the request yet: show the last interval before it.
    before = snaps[snaps["ts"] < t_ref].tail(1 if len(at) else 2)
    pair = pd.concat([before, at])
    if len(pair) == 2:
        st.caption(f"scrape interval {ui.fmt_ts(pair.iloc[0]['ts'])} → {ui.fmt_ts(pair.iloc[1]['ts'])}")
        a, b = pair.iloc[0], pair.iloc[1]

        def delta(col: str) -> float:
            return (
                float((b[col] or 0) - (a[col] or 0))
                if not (pd.isna(a[col]) or pd.isna(b[col]))
                else float("nan")
            )

        n = delta("nixl_xfer_time_count")
        m1, m2 = st.columns(2)
        mean = derive.ratio(delta("nixl_xfer_time_sum"), n)
        m1.metric("NIXL xfer mean", ui.fmt_ms(None if mean is None else mean * 1000.0))
        m2.metric("transfers in scrape", f"{n:.0f}" if n == n else "—")
        m3, m4 = st.columns(2)
        rate = derive.ratio(delta("nixl_bytes_sum"), delta("nixl_xfer_time_sum"))
        m3.metric("MB/s while transferring", "—" if rate is None else f"{rate / 1e6:,.0f}")
        m4.metric("failed transfers", f"{delta('nixl_failed_transfers'):.0f}")
        m5, m6 = st.columns(2)
        m5.metric("KV used", "—" if pd.isna(b["kv_cache_usage"]) else f"{100 * b['kv_cache_usage']:.0f}%")
        m6.metric("running / waiting", f"{b['num_running']:.0f} / {b['num_waiting']:.0f}")
    if not xfer.empty:
        chart_df = ui.to_time(xfer.rename(columns={"ts": "time", "value": "xfer_ms"}), "time")
        chart = charts.lines(chart_df, "xfer_ms", "instance", "D's mean NIXL xfer per scrape", "ms")
        st.altair_chart(chart, width="stretch")


def _status_counts(window: Window) -> None:
    counts = data.status_counts(url, window.start, window.end)
    if counts.empty:
        return
    approx = "estimated" in counts and bool(counts["estimated"].any())
    st.caption(
        " · ".join(
            f"{r.status}: {'≈' * bool(getattr(r, 'estimated', False))}{r.requests:,}"
            for r in counts.itertuples()
        )
        + " in the window"
        + (" (≈: estimated from every k-th request, range too large to count)" if approx else "")
    )


def _found_table(found: pd.DataFrame) -> None:
    st.dataframe(
        ui.to_time(found, "proxy_in"),
        hide_index=True,
        width="stretch",
        height=260,
        column_config={
            c: st.column_config.NumberColumn(format="%.3f") for c in ("ttft_s", "tpot_s", "e2e_s")
        },
    )
    st.caption(f"{len(found)} shown (newest first, at most 200).")


def _stages_table(stages: list[derive.Stage]) -> None:
    st.dataframe(
        pd.DataFrame(
            [
                {"stage": s.name, "start ms": s.start_ms, "duration ms": s.duration_ms, "note": s.note}
                for s in stages
            ]
        ),
        hide_index=True,
        width="stretch",
        column_config={
            "start ms": st.column_config.NumberColumn(format="%.1f"),
            "duration ms": st.column_config.NumberColumn(format="%.1f"),
        },
    )


def _waterfall(rec: dict[str, Any]) -> None:
    """The request's route, tokens, cache and flags, then its stages as a chart and a table."""
    st.subheader(f"Waterfall · {rec['request_id']}")
    stages = derive.waterfall(rec)
    decode_only = rec.get("route_path") == "decode_only"
    flags = [
        f"status **{rec['status']}** (HTTP {rec['http_status']})",
        f"D **{rec['d_instance']}** alone"
        if decode_only
        else f"P **{rec['p_instance']}** → D **{rec['d_instance']}**",
        f"{rec['prompt_tokens']} prompt / {rec['completion_tokens']} output tokens",
    ]
    st.markdown(" · ".join(flags))
    cache = derive.cache_summary(rec)
    if cache:
        st.markdown(cache)
    if rec.get("lease_expiry_suspect"):
        st.warning(
            "Flagged as a likely KV-lease expiry: P released the blocks before D's pull finished.",
            icon=":material/timer_off:",
        )
    if stages:
        st.altair_chart(charts.waterfall(stages), width="stretch")
        _stages_table(stages)
    else:
        st.caption("No stage timestamps were recorded for this request.")


def _lease_expiries(window: Window) -> None:
    st.subheader("Flagged lease-expiry requests")
    leases = data.search_requests(url, window.start, window.end, "", "", "", False, True, 50)
    ui.table_or_caption(leases, "None in the window.", ("proxy_in",), height=200)


def render(opened: Opened) -> None:
    latest, window = opened.latest, opened.window
    flt = _filters()
    found = data.search_requests(url, window.start, window.end, **flt)  # type: ignore[arg-type]
    _status_counts(window)
    if found.empty:
        if flt["request_id"]:
            st.warning(f"No request with id or trace id starting {flt['request_id']!r}.")
        else:
            ui.no_data(view, "matching requests", latest)
        return
    _found_table(found)
    chosen = st.selectbox("Inspect request", list(found["request_id"]), key="inspect")
    rec = data.get_request(url, str(chosen)) if chosen else None
    if rec is None:
        return
    left, right = st.columns([3, 2])
    with left:
        _waterfall(rec)
    with right:
        st.subheader("Decode side at that time")
        _nixl_panel(rec)
    _lease_expiries(window)


run_page(view, "Requests", "request records", "request records", render)
