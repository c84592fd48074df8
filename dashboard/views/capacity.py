"""Capacity: the recorded arrival rate, prompt and output lengths and per-instance token
rates, the P:D ratio they imply — n_P / n_D ≈ (C_D / C_P) · (E[prompt] / E[output]),
a starting point only — and a what-if for a changed load.

C_P and C_D default to the busiest instance's 95th-percentile token rate per scrape,
a lower bound on capacity unless the fleet was saturated; the SRE can type better ones.
"""

from __future__ import annotations

import math

import pandas as pd
import streamlit as st

from dashboard import charts, context, data, derive, summaries, ui
from dashboard.views.opening import open_page

view = context.current()
url = view.store_url
n_p_now = sum(1 for _ in view.settings.instances("prefill"))
n_d_now = sum(1 for _ in view.settings.instances("decode"))


def _num(value: object, default: float = 0.0) -> float:
    """A finite float, or ``default`` for None/NaN (a store whose records lack token counts)."""
    try:
        out = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return default
    return out if math.isfinite(out) else default


def _observed_capacity(rates: pd.DataFrame, role: str, column: str) -> tuple[float, pd.DataFrame]:
    mine = rates[rates["role"] == role] if not rates.empty else rates
    if mine.empty:
        return 0.0, pd.DataFrame()
    per = (
        mine.groupby("instance")[column]
        .agg(mean="mean", p95=lambda s: summaries.percentile_of(s, 95), peak="max")
        .reset_index()
    )
    return _num(per["p95"].max()), per


def render() -> None:
    opened = open_page(view, "Capacity", "recorded load and the P:D ratio it implies", "request records")
    if opened is None:
        return
    latest, window = opened.latest, opened.window
    sample, step = data.request_sample(url, window.start, window.end, slo=view.settings.slo)
    if sample.empty:
        ui.no_data(view, "requests", latest)
        return
    width = window.bucket_s(60)
    buckets = data.slo_buckets(url, window.start, window.end, width, view.settings.slo)
    served = sample[sample["status"] != "rejected"]
    rate = float(buckets["arrivals"].sum()) / window.seconds if not buckets.empty else 0.0
    mean_prompt = _num(served["prompt_tokens"].mean()) if not served.empty else 0.0
    ok = served[served["status"] == "ok"]
    mean_output = _num(ok["completion_tokens"].mean()) if not ok.empty else 0.0

    series = data.snapshot_series(url, window.start, window.end)
    rates = summaries.interval_rates(series, ("prompt_tokens", "generation_tokens"))
    c_p_obs, per_p = _observed_capacity(rates, "prefill", "prompt_tokens")
    c_d_obs, per_d = _observed_capacity(rates, "decode", "generation_tokens")

    lengths_from = "request records"
    if (not mean_prompt or not mean_output) and not rates.empty and rate > 0:
        # Records without token counts (no vLLM spans): use the instances' token counters.
        per_s = rates.groupby("instance").mean(numeric_only=True)
        roles = rates.drop_duplicates("instance").set_index("instance")["role"]
        p_tok = _num(per_s.loc[roles[roles == "prefill"].index, "prompt_tokens"].sum())
        d_tok = _num(per_s.loc[roles[roles == "decode"].index, "generation_tokens"].sum())
        mean_prompt = mean_prompt or p_tok / rate
        mean_output = mean_output or d_tok / rate
        lengths_from = "token counters ÷ arrival rate (request records carry no token counts)"

    cols = st.columns(4)
    cols[0].metric("arrival rate", f"{rate:.2f} req/s")
    cols[1].metric("E[prompt]", f"{mean_prompt:,.0f} tokens")
    cols[2].metric("E[output]", f"{mean_output:,.0f} tokens")
    cols[3].metric("fleet now", f"{n_p_now} P : {n_d_now} D")
    st.caption(f"E[prompt] and E[output] from {lengths_from}.")

    left, right = st.columns(2)
    with left:
        if not buckets.empty:
            b = ui.to_time(
                buckets.assign(rate=buckets["arrivals"] / width, series="arrivals").rename(
                    columns={"t": "time"}
                ),
                "time",
            )
            st.altair_chart(
                charts.lines(b, "rate", "series", "Arrival rate", "requests / s"), width="stretch"
            )
        if not rates.empty:
            r = rates.assign(
                tokens_per_s=rates["prompt_tokens"].where(
                    rates["role"] == "prefill", rates["generation_tokens"]
                )
            )
            r = ui.to_time(r.rename(columns={"ts": "time"}), "time")
            st.altair_chart(
                charts.lines(
                    r,
                    "tokens_per_s",
                    "instance",
                    "Per-instance rate (P: prompt tokens/s, D: output tokens/s)",
                    "tokens / s",
                ),
                width="stretch",
            )
    with right:
        st.altair_chart(
            charts.histogram(served[["prompt_tokens"]].dropna(), "prompt_tokens", "prompt tokens"),
            width="stretch",
        )
        st.altair_chart(
            charts.histogram(ok[["completion_tokens"]].dropna(), "completion_tokens", "output tokens"),
            width="stretch",
        )
    if step > 1:
        st.caption(f"Lengths from every {step}th request (window too large to read in full).")
    if not per_p.empty or not per_d.empty:
        st.dataframe(
            pd.concat(
                [
                    per_p.assign(role="prefill", unit="prompt tok/s"),
                    per_d.assign(role="decode", unit="output tok/s"),
                ],
                ignore_index=True,
            ),
            hide_index=True,
            width="stretch",
            column_config={c: st.column_config.NumberColumn(format="%.0f") for c in ("mean", "p95", "peak")},
        )

    st.subheader("Implied P:D ratio and what-if")
    a, b, c = st.columns(3)
    c_p = a.number_input(
        "C_P: prompt tokens/s one P sustains",
        min_value=1.0,
        value=float(max(round(c_p_obs, -1), 1.0)),
        step=100.0,
        key="c_p",
        help="Default: the busiest P's 95th-percentile rate in the window (a lower bound).",
    )
    c_d = b.number_input(
        "C_D: output tokens/s one D sustains",
        min_value=1.0,
        value=float(max(round(c_d_obs, -1), 1.0)),
        step=100.0,
        key="c_d",
        help="Default: the busiest D's 95th-percentile rate in the window (a lower bound).",
    )
    util = c.slider("Target utilization", 0.3, 1.0, 0.8, 0.05, key="util")
    d, e, f = st.columns(3)
    factor = d.slider("Load × (what-if)", 0.25, 5.0, 1.0, 0.25, key="load_factor")
    prompt_w = e.number_input(
        "E[prompt] (what-if)", min_value=1.0, value=float(max(round(mean_prompt), 1)), key="wi_prompt"
    )
    output_w = f.number_input(
        "E[output] (what-if)", min_value=1.0, value=float(max(round(mean_output), 1)), key="wi_output"
    )

    now_plan = derive.capacity_plan(rate, mean_prompt or 1.0, mean_output or 1.0, c_p, c_d, util)
    what_if = derive.capacity_plan(rate * factor, prompt_w, output_w, c_p, c_d, util)
    st.latex(
        r"\frac{n_P}{n_D} \approx \frac{C_D}{C_P}\cdot\frac{E[prompt]}{E[output]} = "
        rf"\frac{{{c_d:.0f}}}{{{c_p:.0f}}}\cdot\frac{{{mean_prompt:.0f}}}{{{mean_output:.0f}}} = "
        rf"{now_plan.pd_ratio:.2f}"
    )
    m = st.columns(4)
    m[0].metric(
        "needed now",
        f"{now_plan.n_prefill} P : {now_plan.n_decode} D",
        f"fleet has {n_p_now} P : {n_d_now} D",
        delta_color="off",
    )
    m[1].metric("what-if load", f"{rate * factor:.2f} req/s")
    m[2].metric(
        "needed at what-if",
        f"{what_if.n_prefill} P : {what_if.n_decode} D",
        f"{what_if.n_prefill - n_p_now:+d} P, {what_if.n_decode - n_d_now:+d} D",
        delta_color="off",
    )
    ratio = what_if.pd_ratio
    m[3].metric("what-if P:D", "—" if math.isinf(ratio) else f"{ratio:.2f}")
    st.caption(
        "A starting point only: it ignores prefix-cache hits, queueing at high utilization and the handoff "
        "budget. Check the SLO page after changing the fleet."
    )


st.fragment(run_every=view.refresh_s if view.live else None)(render)()
