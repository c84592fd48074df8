"""Prefix cache: each instance's prefix-cache hit rate over time from vLLM's own counters (on D
also the hits its KV connector found on P), the KV-aware router's predicted cached tokens against
what vLLM reported it reused, the hottest prefixes and which P instances served them, and the
share of requests served by D alone (``decode_only``).

The hit rates read the snapshots; the rest reads a bounded sample of the window's request records
(every k-th by id, as the other pages do), scaled back up by k. Records carry routing figures only
from a proxy with ``proxy.kv_aware`` (without it a record has its route path but no predictions); without
any the page says so.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import charts, context, data, prefix, ui
from dashboard.views.opening import Opened, run_page

view = context.current()
url = view.store_url


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100.0 * v:.0f}%"


def _hit_rates(start: float, end: float, width: float) -> pd.DataFrame:
    series = data.prefix_series(url, start, end)
    st.subheader("Hit rate per instance (vLLM)")
    st.caption(
        "Prompt tokens found in the instance's prefix cache / prompt tokens it looked up "
        "(vllm:prefix_cache_hits / queries), per bucket. *external*: on D, the tokens its KV "
        "connector found on P (pulled instead of computed)."
    )
    rates = prefix.hit_rates(series, start, width)
    if rates.empty:
        st.caption("No prefix-cache lookups counted in the window (is prefix caching enabled?).")
        return prefix.window_hit_rates(series)
    rates = rates.assign(
        line=rates["instance"] + rates["kind"].map({prefix.LOCAL: "", prefix.EXTERNAL: " external"})
    )
    df = ui.to_time(rates.rename(columns={"t": "time"}), "time")
    left, right = st.columns(2)
    with left:
        p = df[df["role"] == "prefill"]
        if not p.empty:
            st.altair_chart(
                charts.lines(p, "hit_rate", "line", "Prefill", "hit rate", step=True), width="stretch"
            )
    with right:
        d = df[df["role"] == "decode"]
        if not d.empty:
            st.altair_chart(
                charts.lines(d, "hit_rate", "line", "Decode", "hit rate", step=True), width="stretch"
            )
    return prefix.window_hit_rates(series)


def _predicted(window_rates: pd.DataFrame, sample: pd.DataFrame, step: int) -> pd.DataFrame:
    st.subheader("Predicted vs reported cached tokens")
    st.caption(
        "What the router predicted the chosen instance held of the prompt, against what vLLM "
        "reported it reused (usage.prompt_tokens_details.cached_tokens). P: requests on the P/D "
        "path; D: decode-only requests (on the P/D path D reports the tokens it pulled as cached)."
        + (f" Sums from every {step}-th request, scaled up." if step > 1 else "")
    )
    compared = prefix.predicted_vs_reported(sample, step)
    if compared.empty:
        st.caption("No request in the window carries both figures.")
        return compared
    table = compared.merge(window_rates, on=["instance", "role"], how="left")
    left, right = st.columns([3, 2])
    with left:
        st.dataframe(
            table,
            hide_index=True,
            width="stretch",
            column_config={
                "requests": st.column_config.NumberColumn(format="%d"),
                "predicted": st.column_config.NumberColumn("predicted tokens", format="%.0f"),
                "reported": st.column_config.NumberColumn("reported tokens", format="%.0f"),
                "reported_per_predicted": st.column_config.NumberColumn(
                    "reported / predicted", format="%.2f"
                ),
                "hit_rate": st.column_config.NumberColumn("vLLM hit rate", format="%.2f"),
                "external_hit_rate": st.column_config.NumberColumn("external hit rate", format="%.2f"),
            },
        )
    with right:
        bars = compared.melt(
            id_vars=["instance"], value_vars=["predicted", "reported"], var_name="figure", value_name="tokens"
        )
        st.altair_chart(
            charts.paired_bars(bars, "instance", "tokens", "figure", "Cached prompt tokens", "tokens"),
            width="stretch",
        )
    return compared


def _hot(sample: pd.DataFrame, step: int) -> None:
    st.subheader("Hottest prefixes")
    st.caption(
        "Requests by the deepest prefix block the router matched (its chain key), in the window: "
        "how many, their share of routed requests, the matched length and which P served them."
    )
    hot = prefix.hot_prefixes(sample, step)
    if hot.empty:
        st.caption("No request in the window matched a cached prefix.")
        return
    st.dataframe(
        hot,
        hide_index=True,
        width="stretch",
        column_config={
            "prefix_key": st.column_config.TextColumn("prefix (chain key)"),
            "requests": st.column_config.NumberColumn(format="%d"),
            "share": st.column_config.ProgressColumn(
                "share of requests", format="%.2f", min_value=0, max_value=1
            ),
            "prefix_tokens": st.column_config.NumberColumn("prefix tokens", format="%.0f"),
            "tokens": st.column_config.NumberColumn("matched tokens", format="%.0f"),
            "decode_only": st.column_config.NumberColumn("decode only", format="%.2f"),
            "p_instances": st.column_config.TextColumn("served by P"),
        },
    )


def _decode_only(sample: pd.DataFrame, start: float, width: float) -> None:
    st.subheader("Served without P (decode only)")
    st.caption(
        "Share of routed requests the router sent to D alone: the prompt's uncached part was short, "
        "or D already held nearly all of it (conditional disaggregation)."
    )
    share = prefix.decode_only_share(sample, start, width)
    if share.empty:
        st.caption("No routed request in the window.")
        return
    df = ui.to_time(share.rename(columns={"t": "time"}).assign(path="decode only"), "time")
    st.altair_chart(
        charts.lines(df, "share", "path", "Share of requests served without P", "share", step=True),
        width="stretch",
    )


def render(opened: Opened) -> None:
    latest, window = opened.latest, opened.window
    width = window.bucket_s(60)
    sample, step = data.prefix_sample(url, window.start, window.end)
    routed = sample[sample["route_path"].notna()] if not sample.empty else sample
    predicted = ["p_predicted_cached_tokens", "d_predicted_cached_tokens"]
    with_view = not routed.empty and bool(routed[predicted].notna().any(axis=None))
    metrics = st.container()
    window_rates = _hit_rates(window.start, window.end, width)
    if not with_view:
        st.info(
            "No request in the window was routed with a cache view (the router's predicted cached "
            "tokens): the proxy runs with `proxy.kv_aware` off, or no request arrived. vLLM's own "
            "hit rates are above.",
            icon=":material/info:",
        )
        compared = pd.DataFrame(columns=["instance", "role", "predicted", "reported"])
    else:
        compared = _predicted(window_rates, routed, step)
        _hot(routed, step)
        _decode_only(routed, window.start, width)
    figures = prefix.headline(window_rates, compared, routed)
    cols = metrics.columns(4)
    cols[0].metric("P hit rate (vLLM)", _pct(figures["p_hit_rate"]))
    cols[1].metric("D external hit rate", _pct(figures["d_external_hit_rate"]))
    ratio = figures["p_reported_per_predicted"]
    cols[2].metric("P reported / predicted", "—" if ratio is None else f"{ratio:.2f}")
    cols[3].metric("served without P", _pct(figures["decode_only_share"]))
    if sample.empty:
        ui.no_data(view, "request records", latest)


run_page(view, "Prefix cache", "vLLM's prefix caches and KV-aware routing", "snapshots", render)
