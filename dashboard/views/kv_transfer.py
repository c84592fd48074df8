"""KV transfer: NIXL transfer and post time percentiles, MB/s, bytes and descriptors
per transfer, failed transfers and lease expiries per instance, the pairs left out of routing
(stale peers, incompatible pairs), stranded KV (what an idle P
holds while no D waits to pull), and handoff time per (P, D) pair as a heatmap.

In NIXL pull mode D records transfers and failures, P records lease expiries, so both
roles appear in the table; in push mode P records the transfers (its writes into D's blocks).
"""

from __future__ import annotations

import time
from typing import Any

import pandas as pd
import streamlit as st

from dashboard import charts, context, data, summaries, ui
from dashboard.queries.common import Window
from dashboard.views.opening import Opened, run_page

view = context.current()
url = view.store_url


def _column_config(nixl: pd.DataFrame) -> dict[str, Any]:
    fmt: dict[str, Any] = {
        c: st.column_config.NumberColumn(format="%.1f") for c in nixl.columns if c.endswith("_ms")
    }
    fmt |= {
        "MB_per_s": st.column_config.NumberColumn("MB/s", format="%.0f"),
        "MB_per_transfer": st.column_config.NumberColumn("MB / transfer", format="%.1f"),
        "descriptors_per_transfer": st.column_config.NumberColumn("descriptors / transfer", format="%.0f"),
        "transfers": st.column_config.NumberColumn(format="%d"),
        "failed_transfers": st.column_config.NumberColumn("failed", format="%d"),
        "expired_leases": st.column_config.NumberColumn("lease expiries", format="%d"),
    }
    return fmt


def _per_instance(nixl: pd.DataFrame) -> None:
    decode = nixl[nixl["transfers"].fillna(0) > 0]
    cols = st.columns(4)
    cols[0].metric("transfers", f"{decode['transfers'].sum():,.0f}")
    cols[1].metric("failed transfers", f"{nixl['failed_transfers'].sum():,.0f}")
    cols[2].metric("lease expiries (P)", f"{nixl['expired_leases'].sum():,.0f}")
    worst = decode.sort_values("xfer_p99_ms", ascending=False).head(1)
    cols[3].metric(
        "slowest D (xfer p99)",
        "—" if worst.empty else str(worst.iloc[0]["instance"]),
        None if worst.empty else f"p99 {ui.fmt_ms(worst.iloc[0]['xfer_p99_ms'])}",
        delta_color="off",
    )
    st.dataframe(nixl, hide_index=True, width="stretch", column_config=_column_config(nixl))


def _over_time(window: Window) -> None:
    series = data.snapshot_series(url, window.start, window.end)
    decode_series = series[series["role"] == "decode"] if not series.empty else series
    left, right = st.columns(2)
    with left:
        xfer = summaries.interval_means(decode_series, "nixl_xfer_time_sum", "nixl_xfer_time_count", 1000.0)
        if not xfer.empty:
            df = ui.to_time(xfer.rename(columns={"ts": "time", "value": "xfer_ms"}), "time")
            st.altair_chart(
                charts.lines(df, "xfer_ms", "instance", "Mean NIXL xfer time per scrape", "ms"),
                width="stretch",
            )
    with right:
        rates = summaries.interval_rates(series, ("nixl_failed_transfers", "nixl_kv_expired_reqs"))
        if not rates.empty:
            rates = rates.assign(
                per_min=(rates["nixl_failed_transfers"].fillna(0) + rates["nixl_kv_expired_reqs"].fillna(0))
                * 60.0
            )
            df = ui.to_time(rates.rename(columns={"ts": "time"}), "time")
            st.altair_chart(
                charts.lines(df, "per_min", "instance", "Failed transfers + lease expiries", "per minute"),
                width="stretch",
            )


def _pairs(window: Window, latest: float | None) -> None:
    st.subheader("Handoff time per (P, D) pair")
    st.caption("P done → D first token: D's queue and the NIXL pull. From request records.")
    pairs = data.handoff(url, window.start, window.end, "pair")
    if pairs.empty:
        ui.no_data(view, "handoffs (request records)", latest)
        return
    stat = st.segmented_control(
        "Statistic",
        ["p50_ms", "p99_ms", "mean_ms"],
        default="p99_ms",
        key="kv_stat",
        format_func=lambda s: s.replace("_ms", ""),
    )
    st.altair_chart(
        charts.heatmap(pairs, str(stat or "p99_ms"), f"handoff {str(stat or 'p99_ms')[:-3]} (ms)"),
        width="stretch",
    )
    _effects(pairs)


def _effects(pairs: pd.DataFrame) -> None:
    """The matrix factored as the controller factors it: the P's row, the D's column or the pair."""
    effects, fit = summaries.handoff_effects(pairs)
    st.caption(
        "Who is slow: each P's row and each D's column over the typical pair's median handoff "
        f"({ui.fmt_ms(fit.typical * 1000.0)}), as the controller weighs them; blamed from 2×."
    )
    for b in fit.blames:
        st.warning(b.message)
    st.dataframe(
        effects,
        hide_index=True,
        width="stretch",
        column_config={"effect_x": st.column_config.NumberColumn("effect (×)", format="%.2f")},
    )
    for note in (*fit.unjudged, *fit.notes):
        st.caption(note)


def _stranded(window: Window) -> None:
    """Stranded KV: KV an idle P holds while no D waits to pull, and the handoffs no D served."""
    st.subheader("Stranded KV")
    st.caption(
        "KV a P holds while it runs and queues nothing, at its newest scrape, and for how long; the "
        "handoffs it prefilled that no D served (P done, no first token). While no D waits to pull, such "
        "KV waits on leases no D will pull: the StrandedKV alert fires after 60 s of it."
    )
    series = data.snapshot_series(url, window.start, window.end)
    sample, step = data.request_sample(url, window.start, window.end)
    per_p, pending = summaries.stranded_kv(series, sample, step)
    alerts = data.firing_alerts(url)
    for a in alerts[alerts["rule"] == "StrandedKV"].itertuples(index=False) if not alerts.empty else ():
        note = a.annotations if isinstance(a.annotations, dict) else {}
        st.error(f"StrandedKV ({a.state}): {note.get('description', a.labels)}")
    st.metric("requests the Ds still have to pull", "unknown" if pending is None else f"{pending:,.0f}")
    if not per_p.empty:
        st.dataframe(
            per_p,
            hide_index=True,
            width="stretch",
            column_config={
                "held_while_idle_pct": st.column_config.NumberColumn("KV held while idle (%)", format="%.1f"),
                "held_for_s": st.column_config.NumberColumn("for (s)", format="%.0f"),
                "unserved_handoffs": st.column_config.NumberColumn("unserved handoffs", format="%d"),
            },
        )


def _left_out() -> None:
    """The pairs the routing table leaves out, and the instances compatible with nobody."""
    st.subheader("Pairs left out of routing")
    st.caption(
        "P x D pairs the controller tells the proxies to leave out: a D whose NIXL agent for a restarted P "
        "is stale (StalePeerAfterRestart: probed now and then, back once one is served), or a P and a D "
        "whose model, KV block size, KV dtype or revision differ, or cannot be told (IncompatiblePair: "
        "never tried)."
    )
    alerts = data.firing_alerts(url)
    for a in alerts[alerts["rule"] == "IncompatiblePair"].itertuples(index=False) if not alerts.empty else ():
        note = a.annotations if isinstance(a.annotations, dict) else {}
        st.error(f"IncompatiblePair ({a.state}): {note.get('description', a.labels)}")
    table = data.routing_table(view.settings.controller_url)
    if table is None:
        st.info("The controller does not answer: its routing table (and the pairs it leaves out) is unknown.")
        return
    pairs = summaries.avoided_pairs(table, time.time())
    if pairs.empty:
        st.success("No pair is left out: every P may hand off to every D.")
        return
    st.dataframe(
        pairs,
        hide_index=True,
        width="stretch",
        column_config={"for_s": st.column_config.NumberColumn("for (s)", format="%.0f")},
    )


def render(opened: Opened) -> None:
    latest, window = opened.latest, opened.window
    nixl = data.nixl_per_instance(url, window.start, window.end)
    if nixl.empty:
        ui.no_data(view, "NIXL transfers", latest)
    else:
        _per_instance(nixl)
    _over_time(window)
    _stranded(window)
    _left_out()
    _pairs(window, latest)


run_page(view, "KV transfer", "NIXL figures from vLLM's vllm:nixl_* metrics", "snapshots", render)
