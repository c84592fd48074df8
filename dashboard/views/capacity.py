"""Capacity: the recorded arrival rate, prompt and output lengths and per-instance token
rates, the P:D ratio they imply — n_P / n_D ≈ (C_D / C_P) · (E[prompt] / E[output]),
a starting point only — and a what-if for a changed load.

C_P and C_D default to the busiest instance's 95th-percentile token rate per scrape,
a lower bound on capacity unless the fleet was saturated; the SRE can type better ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd
import streamlit as st
from streamlit.delta_generator import DeltaGenerator

from dashboard import charts, context, data, derive, summaries, ui
from dashboard.queries.common import Window
from dashboard.views.opening import Opened, run_page

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
    per = summaries.rate_per_instance(rates, role, column)
    return (_num(per["p95"].max()) if not per.empty else 0.0), per


@dataclass(frozen=True)
class _Load:
    """What the window's records and scrapes say, shared by the page's sections."""

    width: float
    buckets: pd.DataFrame
    served: pd.DataFrame
    ok: pd.DataFrame
    step: int
    rate: float
    mean_prompt: float
    mean_output: float
    lengths_from: str
    rates: pd.DataFrame
    c_p_obs: float
    c_d_obs: float
    per_p: pd.DataFrame
    per_d: pd.DataFrame


@dataclass(frozen=True)
class _WhatIf:
    """The capacities, utilization and changed load the SRE typed."""

    c_p: float
    c_d: float
    util: float
    factor: float
    prompt: float
    output: float


def _lengths_from_counters(
    rates: pd.DataFrame, rate: float, mean_prompt: float, mean_output: float
) -> tuple[float, float]:
    """E[prompt] and E[output] as the instances' token rates over the arrival rate, where missing."""
    # Records without token counts (no vLLM spans): use the instances' token counters.
    per_s = rates.groupby("instance").mean(numeric_only=True)
    roles = rates.drop_duplicates("instance").set_index("instance")["role"]
    p_tok = _num(per_s.loc[roles[roles == "prefill"].index, "prompt_tokens"].sum())
    d_tok = _num(per_s.loc[roles[roles == "decode"].index, "generation_tokens"].sum())
    return mean_prompt or p_tok / rate, mean_output or d_tok / rate


def _measure(window: Window, sample: pd.DataFrame, step: int) -> _Load:
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
        mean_prompt, mean_output = _lengths_from_counters(rates, rate, mean_prompt, mean_output)
        lengths_from = "token counters ÷ arrival rate (request records carry no token counts)"
    return _Load(
        width,
        buckets,
        served,
        ok,
        step,
        rate,
        mean_prompt,
        mean_output,
        lengths_from,
        rates,
        c_p_obs,
        c_d_obs,
        per_p,
        per_d,
    )


def _headline(load: _Load) -> None:
    cols = st.columns(4)
    cols[0].metric("arrival rate", f"{load.rate:.2f} req/s")
    cols[1].metric("E[prompt]", f"{load.mean_prompt:,.0f} tokens")
    cols[2].metric("E[output]", f"{load.mean_output:,.0f} tokens")
    cols[3].metric("fleet now", f"{n_p_now} P : {n_d_now} D")
    st.caption(f"E[prompt] and E[output] from {load.lengths_from}.")


def _rate_charts(load: _Load) -> None:
    buckets, rates = load.buckets, load.rates
    if not buckets.empty:
        b = ui.to_time(
            buckets.assign(rate=buckets["arrivals"] / load.width, series="arrivals").rename(
                columns={"t": "time"}
            ),
            "time",
        )
        st.altair_chart(charts.lines(b, "rate", "series", "Arrival rate", "requests / s"), width="stretch")
    if not rates.empty:
        r = rates.assign(
            tokens_per_s=rates["prompt_tokens"].where(rates["role"] == "prefill", rates["generation_tokens"])
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


def _length_histograms(load: _Load) -> None:
    st.altair_chart(
        charts.histogram(load.served[["prompt_tokens"]].dropna(), "prompt_tokens", "prompt tokens"),
        width="stretch",
    )
    st.altair_chart(
        charts.histogram(load.ok[["completion_tokens"]].dropna(), "completion_tokens", "output tokens"),
        width="stretch",
    )


def _per_instance_table(load: _Load) -> None:
    if load.step > 1:
        st.caption(f"Lengths from every {load.step}th request (window too large to read in full).")
    if not load.per_p.empty or not load.per_d.empty:
        st.dataframe(
            pd.concat(
                [
                    load.per_p.assign(role="prefill", unit="prompt tok/s"),
                    load.per_d.assign(role="decode", unit="output tok/s"),
                ],
                ignore_index=True,
            ),
            hide_index=True,
            width="stretch",
            column_config={c: st.column_config.NumberColumn(format="%.0f") for c in ("mean", "p95", "peak")},
        )


def _sustained(col: DeltaGenerator, role: str, tokens: str, observed: float) -> float:
    """C_P or C_D: the tokens/s one instance of ``role`` (P or D) sustains, by default ``observed``."""
    return col.number_input(
        f"C_{role}: {tokens} tokens/s one {role} sustains",
        min_value=1.0,
        value=float(max(round(observed, -1), 1.0)),
        step=100.0,
        key=f"c_{role.lower()}",
        help=f"Default: the busiest {role}'s 95th-percentile rate in the window (a lower bound).",
    )


def _what_if_inputs(load: _Load) -> _WhatIf:
    a, b, c = st.columns(3)
    c_p = _sustained(a, "P", "prompt", load.c_p_obs)
    c_d = _sustained(b, "D", "output", load.c_d_obs)
    util = c.slider("Target utilization", 0.3, 1.0, 0.8, 0.05, key="util")
    d, e, f = st.columns(3)
    factor = d.slider("Load × (what-if)", 0.25, 5.0, 1.0, 0.25, key="load_factor")
    prompt_w = e.number_input(
        "E[prompt] (what-if)", min_value=1.0, value=float(max(round(load.mean_prompt), 1)), key="wi_prompt"
    )
    output_w = f.number_input(
        "E[output] (what-if)", min_value=1.0, value=float(max(round(load.mean_output), 1)), key="wi_output"
    )
    return _WhatIf(c_p, c_d, util, factor, prompt_w, output_w)


def _plans(load: _Load, w: _WhatIf) -> None:
    rate, mean_prompt, mean_output = load.rate, load.mean_prompt, load.mean_output
    now_plan = derive.capacity_plan(rate, mean_prompt or 1.0, mean_output or 1.0, w.c_p, w.c_d, w.util)
    what_if = derive.capacity_plan(rate * w.factor, w.prompt, w.output, w.c_p, w.c_d, w.util)
    st.latex(
        r"\frac{n_P}{n_D} \approx \frac{C_D}{C_P}\cdot\frac{E[prompt]}{E[output]} = "
        rf"\frac{{{w.c_d:.0f}}}{{{w.c_p:.0f}}}\cdot\frac{{{mean_prompt:.0f}}}{{{mean_output:.0f}}} = "
        rf"{now_plan.pd_ratio:.2f}"
    )
    m = st.columns(4)
    m[0].metric(
        "needed now",
        f"{now_plan.n_prefill} P : {now_plan.n_decode} D",
        f"fleet has {n_p_now} P : {n_d_now} D",
        delta_color="off",
    )
    m[1].metric("what-if load", f"{rate * w.factor:.2f} req/s")
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


def render(opened: Opened) -> None:
    latest, window = opened.latest, opened.window
    sample, step = data.request_sample(url, window.start, window.end, slo=view.settings.slo)
    if sample.empty:
        ui.no_data(view, "requests", latest)
        return
    load = _measure(window, sample, step)
    _headline(load)
    left, right = st.columns(2)
    with left:
        _rate_charts(load)
    with right:
        _length_histograms(load)
    _per_instance_table(load)
    st.subheader("Implied P:D ratio and what-if")
    _plans(load, _what_if_inputs(load))


run_page(view, "Capacity", "recorded load and the P:D ratio it implies", "request records", render)
