"""SLOs & alerts: TTFT and TPOT against their targets, goodput and SLO attainment over
time, and the alerts firing now and recently, each linked to "Why we missed" for its window.

Headline figures come from ``store.queries.slo_summary``, the same computation the
controller uses, so the page and the controller never disagree; like the controller, the page counts
only the records of ``controller.trusted_span_senders`` when that is set
(``store.attribution.trusted_records``).
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import charts, context, data, summaries, ui
from dashboard.queries.common import Window
from store.attribution import trusted_senders

view = context.current()
url = view.store_url
slo = view.settings.slo
SENDERS = trusted_senders(view.settings)  # forged records from other senders are not counted


def _headline(summary: dict[str, object] | None, sample: pd.DataFrame) -> None:
    cols = st.columns(5)
    ttft_target, tpot_target = slo.ttft.target_ms, slo.tpot.target_ms
    ok = sample[sample["status"] == "ok"] if not sample.empty else sample
    ttft = summaries.percentile_of(ok["ttft_s"], slo.ttft.percentile) * 1000.0 if not ok.empty else None
    tpot = summaries.percentile_of(ok["tpot_s"], slo.tpot.percentile) * 1000.0 if not ok.empty else None
    cols[0].metric(
        f"TTFT p{slo.ttft.percentile:g}",
        ui.fmt_ms(ttft),
        None if ttft is None else f"{ttft - ttft_target:+.0f} ms vs {ttft_target:g}",
        delta_color="inverse",
    )
    cols[1].metric(
        f"TPOT p{slo.tpot.percentile:g}",
        ui.fmt_ms(tpot),
        None if tpot is None else f"{tpot - tpot_target:+.1f} ms vs {tpot_target:g}",
        delta_color="inverse",
    )
    if summary is None:
        return
    att = summary.get("attainment")
    goal = slo.goodput_attainment
    cols[2].metric(
        "SLO attainment",
        "—" if att is None else f"{100 * float(att):.1f}%",  # type: ignore[arg-type]
        None if att is None else f"{100 * (float(att) - goal):+.1f} pts vs {100 * goal:g}%",  # type: ignore[arg-type]
    )
    cols[3].metric("goodput", f"{float(summary['goodput_per_s']):.2f} req/s")  # type: ignore[arg-type]
    cols[4].metric(
        "requests", f"{summary['requests']:,}", f"{summary['completed']:,} completed", delta_color="off"
    )


def why_link(rule: str, active_since: float, resolved_at: float | None, *, key: str) -> None:
    """A link to the "Why we missed" page for an alert's window: from one SLO window before it became
    active (what its rule looked at) to when it resolved (still active: now)."""
    params = {"from": f"{active_since - slo.window_s:.3f}", "alert": rule}
    if resolved_at is not None:
        params["until"] = f"{resolved_at:.3f}"
    with st.container(key=key):
        st.page_link(
            "views/attribution.py",
            label=f"Why we missed: {rule}'s window",
            icon=":material/troubleshoot:",
            query_params=params,
        )


def _latency_over_time(sample: pd.DataFrame, step: int, width_s: float, start: float) -> pd.DataFrame:
    ok = sample[sample["status"] == "ok"]
    if ok.empty:
        return pd.DataFrame()
    b = ((ok["proxy_in"] - start) // width_s).astype(int)
    q = ok.groupby(b).agg(
        ttft=("ttft_s", lambda s: summaries.percentile_of(s, slo.ttft.percentile)),
        tpot=("tpot_s", lambda s: summaries.percentile_of(s, slo.tpot.percentile)),
    )
    q.index = start + q.index.astype(float) * width_s
    long = q.reset_index(names="ts").melt(id_vars="ts", var_name="metric", value_name="seconds")
    long["ms"] = long["seconds"] * 1000.0
    return long


def _firing_now() -> None:
    firing = data.firing_alerts(url)
    st.subheader("Firing now")
    if firing.empty:
        st.success("No alert is firing.", icon=":material/check_circle:")
        return
    for row in firing.itertuples():
        text = (row.annotations or {}).get("summary", "") if isinstance(row.annotations, dict) else ""
        labels = ", ".join(f"{k}={v}" for k, v in (row.labels or {}).items())
        msg = (
            f"**{row.rule}** ({row.severity}, {row.state}) {labels} — {text} "
            f"since {ui.fmt_ts(row.active_since)}"
        )
        (st.error if row.state == "firing" else st.warning)(msg, icon=":material/notifications_active:")
        why_link(str(row.rule), float(row.active_since), None, key=f"why_firing_{row.Index}")


def _latency_charts(lat: pd.DataFrame) -> None:
    """TTFT, then TPOT, against its target."""
    if lat.empty:
        return
    for metric, target in (("ttft", slo.ttft), ("tpot", slo.tpot)):
        df = ui.to_time(lat[lat["metric"] == metric].rename(columns={"ts": "time"}), "time")
        st.altair_chart(
            charts.lines(
                df,
                "ms",
                "metric",
                f"{metric.upper()} p{target.percentile:g} vs target",
                "ms",
                rule=target.target_ms,
            ),
            width="stretch",
        )


def _attainment_charts(buckets: pd.DataFrame, width: float) -> None:
    if buckets.empty:
        return
    b = buckets.assign(
        attainment=buckets["met"] / buckets["completed"].where(buckets["completed"] > 0),
        goodput=buckets["met"] / width,
        series="all",
    )
    b = ui.to_time(b.rename(columns={"t": "time"}), "time")
    st.altair_chart(
        charts.lines(b, "attainment", "series", "SLO attainment", "share", rule=slo.goodput_attainment),
        width="stretch",
    )
    st.altair_chart(
        charts.lines(b, "goodput", "series", "Goodput (requests meeting every SLO)", "req/s"),
        width="stretch",
    )


def _performance(window: Window, latest: float | None) -> None:
    """The headline figures and the latency and attainment charts of the window's records."""
    sample, step = data.request_sample(url, window.start, window.end, slo=slo, senders=SENDERS)
    summary = data.slo_summary(url, window.start, window.end, slo, SENDERS)
    if sample.empty:
        ui.no_data(view, "requests", latest)
        return
    _headline(summary, sample)
    width = window.bucket_s(60)
    buckets = data.slo_buckets(url, window.start, window.end, width, slo, SENDERS)
    left, right = st.columns(2)
    with left:
        _latency_charts(_latency_over_time(sample, step, width, window.start))
    with right:
        _attainment_charts(buckets, width)
    if step > 1:
        counts = "estimated from it" if bool(buckets.get("estimated", pd.Series([False])).any()) else "exact"
        st.caption(
            f"Latency percentiles from every {step}th request (range too large to read in full); "
            f"counts {counts}."
        )


def _recent_alerts(window: Window) -> None:
    st.subheader("Recent alerts")
    recent = data.recent_alerts(url, window.start, window.end)
    if recent.empty:
        st.caption("No alert was active in this time range.")
        return
    st.dataframe(
        ui.to_time(recent, "active_since", "fired_at", "resolved_at"), hide_index=True, width="stretch"
    )
    choices = [
        f"{r.rule} ({r.state}) since {ui.fmt_ts(r.active_since)}"
        + ("" if pd.isna(r.resolved_at) else f" until {ui.fmt_ts(r.resolved_at)}")
        for r in recent.itertuples()
    ]
    pick = st.selectbox(
        "Why we missed during", range(len(choices)), format_func=choices.__getitem__, key="why_pick"
    )
    if pick is not None:
        row = recent.iloc[int(pick)]
        resolved = None if pd.isna(row["resolved_at"]) else float(row["resolved_at"])
        why_link(str(row["rule"]), float(row["active_since"]), resolved, key="why_recent")


def render() -> None:
    presence = data.presence(url)
    latest = data.latest_ts(url)
    window = view.window(context.now(), latest)
    ui.header(
        "SLOs & alerts",
        view,
        window,
        f"targets: TTFT p{slo.ttft.percentile:g} ≤ {slo.ttft.target_ms:g} ms, "
        f"TPOT p{slo.tpot.percentile:g} ≤ {slo.tpot.target_ms:g} ms, "
        f"attainment ≥ {100 * slo.goodput_attainment:g}%",
    )
    if not presence.schema:
        ui.no_store(view)
        return
    _firing_now()
    if not presence.requests:
        ui.no_data(view, "request records", None)
    else:
        _performance(window, latest)
    _recent_alerts(window)


st.fragment(run_every=view.refresh_s if view.live else None)(render)()
