"""Fleet: P and D pools at a glance — each instance's up/down, weight, KV usage,
running/waiting, TTFT/ITL percentiles, NIXL transfer time and lease expiries, small
multiples over the window, pool totals and the admission limits now in force.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from dashboard import charts, context, data, summaries, ui
from dashboard.queries.common import Window
from dashboard.views.opening import Opened, run_page

view = context.current()
url = view.store_url


def _limits_frame(limits: pd.DataFrame) -> pd.DataFrame:
    adm = view.settings.proxy.admission
    rows = []
    for name, pool in view.settings.pools.items():
        got = limits[limits["pool"] == name] if not limits.empty else limits
        first = got.iloc[0] if not got.empty else None

        def pick(col: str, default: float, row: pd.Series | None = first) -> float:
            value = None if row is None or col not in row or pd.isna(row[col]) else row[col]
            return float(default if value is None else value)

        rows.append(
            {
                "pool": name,
                "role": pool.role,
                "weight": pick("weight", pool.weight),
                "max in-flight requests": int(pick("max_inflight_requests", adm.max_inflight_requests)),
                "max handoff KV (GiB)": pick("max_inflight_kv_bytes", adm.max_inflight_kv_bytes) / 2**30,
                "max wait for a slot (s)": pick("max_queue_wait_s", adm.queue_timeout_s),
                "source": "controller" if first is not None else "config default",
            }
        )
    return pd.DataFrame(rows)


METRIC_NAMES = {
    "kv_cache_usage_pct": "KV used %",
    "num_running": "running",
    "num_waiting": "waiting",
    "nixl_xfer_ms": "NIXL xfer ms",
}


def _as_served(health: pd.DataFrame) -> tuple[pd.DataFrame, bool]:
    """``health`` with the weights the proxy is served now; whether the controller said so."""
    routing = data.routing_table(view.settings.controller_url)
    served = {r["name"]: r for r in (routing or {}).get("instances", [])}
    if served:  # what the proxy is told now, overrides and drains included
        health = health.assign(
            weight=[
                served.get(n, {}).get("weight", w)
                for n, w in zip(health["instance"], health["weight"], strict=True)
            ],
            drained=[bool(served.get(n, {}).get("drained", False)) for n in health["instance"]],
        )
    else:  # no decision stored yet means the initial weight
        health = health.assign(weight=health["weight"].fillna(1.0))
    return health, bool(served)


def _pool_cards(health: pd.DataFrame) -> None:
    totals = summaries.pool_totals(health)
    cols = st.columns(max(len(totals), 1))
    for col, (_, pool) in zip(cols, totals.iterrows(), strict=False):
        with col.container(border=True):
            st.markdown(f"**{pool['pool']}** · {pool['role']}")
            a, b, c, d = st.columns(4)
            a.metric("up", f"{int(pool['up'])}/{int(pool['instances'])}")
            b.metric("running", f"{pool['running']:.0f}")
            c.metric("waiting", f"{pool['waiting']:.0f}")
            d.metric(
                "KV used",
                "—" if pd.isna(pool["kv_cache_usage_pct"]) else f"{pool['kv_cache_usage_pct']:.0f}%",
            )


def _instance_columns() -> dict[str, Any]:
    number = st.column_config.NumberColumn
    return {
        "up": st.column_config.CheckboxColumn("up"),
        "weight": number("weight", format="%.2f"),
        "kv_cache_usage_pct": st.column_config.ProgressColumn(
            "KV used", min_value=0, max_value=100, format="%.0f%%"
        ),
        "ttft_p50_ms": number("TTFT p50 ms", format="%.0f"),
        "ttft_p99_ms": number("TTFT p99 ms", format="%.0f"),
        "itl_p50_ms": number("ITL p50 ms", format="%.1f"),
        "itl_p99_ms": number("ITL p99 ms", format="%.1f"),
        "nixl_xfer_mean_ms": number("NIXL xfer ms", format="%.1f"),
        "nixl_failed": number("NIXL failed", format="%d"),
        "expired_leases": number("lease expiries", format="%d"),
    }


def _instances(health: pd.DataFrame, served: bool) -> None:
    st.subheader("Instances")
    st.caption(
        "weight: "
        + (
            "served now, from the controller's routing table"
            if served
            else "the controller's last decision (controller not reachable)"
        )
    )
    st.dataframe(
        health.drop(columns=["last_scrape"]),
        hide_index=True,
        width="stretch",
        column_config=_instance_columns(),
    )
    down = health[~health["up"]]
    if not down.empty:
        st.error("Down: " + ", ".join(down["instance"]), icon=":material/error:")


def _small_multiples_frame(series: pd.DataFrame) -> pd.DataFrame:
    """One row per (time, instance, metric) for the small multiples."""
    series = series.assign(kv_cache_usage_pct=series["kv_cache_usage"] * 100.0)
    xfer = summaries.interval_means(series, "nixl_xfer_time_sum", "nixl_xfer_time_count", 1000.0)
    long = series.melt(
        id_vars=["ts", "instance", "role"],
        value_vars=["kv_cache_usage_pct", "num_running", "num_waiting"],
        var_name="metric",
    )
    if not xfer.empty:
        xfer = xfer.merge(series[["instance", "role"]].drop_duplicates(), on="instance")
        long = pd.concat([long, xfer.assign(metric="nixl_xfer_ms")], ignore_index=True)
    long["metric"] = long["metric"].map(METRIC_NAMES)
    return ui.to_time(long.rename(columns={"ts": "time"}), "time")


def _limits_and_overrides(window: Window) -> None:
    left, right = st.columns(2)
    with left:
        st.subheader("Admission limits")
        st.dataframe(
            _limits_frame(data.pool_limits(url, window.end)),
            hide_index=True,
            width="stretch",
            column_config={"max handoff KV (GiB)": st.column_config.NumberColumn(format="%.1f")},
        )
    with right:
        st.subheader("Manual overrides in force")
        overrides = data.active_overrides(url, window.end)
        ui.table_or_caption(overrides, "None. Set one on the Controller page.", ("created", "expires"))


def render(opened: Opened) -> None:
    latest, window = opened.latest, opened.window
    health = data.fleet_health(url, window.start, window.end)
    if health.empty:
        ui.no_data(view, "snapshots", latest)
        return
    health, served = _as_served(health)
    _pool_cards(health)
    _instances(health, served)
    st.subheader("Over the window")
    series = data.snapshot_series(url, window.start, window.end)
    if not series.empty:
        st.altair_chart(charts.small_multiples(_small_multiples_frame(series)), width="content")
    _limits_and_overrides(window)


run_page(view, "Fleet", "P and D instances", "snapshots", render)
