"""The Controller page's replay section: the policy re-run over the page's window, side by side.

Asks the controller (``GET /v1/replay``: the dashboard never runs the policy itself) to replay the
recorded ticks of the window under the stored config, or with the settings typed in
(``max_weight_step=0.05, min_weight=0.05``), and draws each instance's served weight, the run's
beside the replay's, with the first divergence, the alerts and the decisions by reason.
``?replay=name=value,...`` in the page's URL fills the settings in and replays at once (a link an
SRE can share).
"""

from __future__ import annotations

from typing import Any

import altair as alt
import pandas as pd
import streamlit as st

from dashboard.api import ControllerClient, ControllerError
from dashboard.charts import ChartLike

SERIES = ("run", "replay")
# what the section reads of GET /v1/replay's answer (a controller of another version may lack some)
REQUIRED = frozenset(
    [
        "ticks",
        "candidate",
        "reproduced",
        "mismatch_count",
        "mismatches",
        "first_divergence",
        "divergent_ticks",
        "weights",
        "decisions",
        "alerts",
    ]
)


def timeline_frame(timeline: dict[str, list[list[Any]]], only: set[str] | None = None) -> pd.DataFrame:
    """Long form of ``/v1/replay``'s ``timeline``: one row per (instance, change point, series)."""
    rows = []
    for name, points in timeline.items():
        if only is not None and name not in only:
            continue
        for ts, actual, replayed in points:
            rows.append({"instance": name, "time": ts, "series": "run", "weight": actual})
            rows.append({"instance": name, "time": ts, "series": "replay", "weight": replayed})
    df = pd.DataFrame(rows, columns=["instance", "time", "series", "weight"])
    if not df.empty:
        df["time"] = pd.to_datetime(df["time"], unit="s", utc=True)
    return df


def side_by_side(df: pd.DataFrame) -> ChartLike:
    """Each instance's served weight over time, the run's line beside the replay's."""
    base = (
        alt.Chart(df)
        .mark_line(interpolate="step-after", strokeWidth=1.8)
        .encode(
            x=alt.X("time:T", title=None, axis=alt.Axis(format="%H:%M", labelAngle=0, tickCount=5)),
            y=alt.Y("weight:Q", title="served weight", scale=alt.Scale(domain=[0, 1])),
            color=alt.Color("series:N", scale=alt.Scale(domain=list(SERIES), range=["#4c78a8", "#e45756"])),
            strokeDash=alt.StrokeDash(
                "series:N", scale=alt.Scale(domain=list(SERIES), range=[[1, 0], [5, 3]]), legend=None
            ),
            tooltip=["instance:N", "series:N", alt.Tooltip("time:T", format="%H:%M:%S"), "weight:Q"],
        )
        .properties(height=90, width=820)
    )
    chart: ChartLike = base.facet(row=alt.Row("instance:N", title=None)).properties(
        title="Served weight: the run and the replay"
    )
    return chart


def weights_table(weights: dict[str, Any]) -> pd.DataFrame:
    rows = []
    for name, c in weights.items():
        a, r = c["actual"], c["replayed"]
        rows.append(
            {
                "instance": name,
                "mean (run)": a["mean"],
                "mean (replay)": r["mean"],
                "min (run)": a["min"],
                "min (replay)": r["min"],
            }
        )
    return pd.DataFrame(rows)


def headline(body: dict[str, Any]) -> tuple[str, str]:
    """``(kind, text)``: kind is success, error or info, for the banner over the chart."""
    n = body["ticks"]
    if not body["reproduced"]:
        first = _divergence(body["mismatches"][0]) if body["mismatches"] else "n/a"
        return "error", (
            f"The stored config did NOT reproduce the run: {body['mismatch_count']} mismatch(es) over "
            f"{n} ticks (first: {first}); no comparison with it holds."
        )
    if body["candidate"] is None:
        return "success", f"The stored config reproduces all {n} ticks exactly: every decision, every state."
    first = body["first_divergence"]
    if first is None:
        return "success", f"The candidate decides as the run did over all {n} ticks."
    return "info", (
        f"The candidate parts from the run on {body['divergent_ticks']} of {n} ticks; "
        f"first: {_divergence(first)}."
    )


def _divergence(d: dict[str, Any]) -> str:
    when = pd.to_datetime(d["ts"], unit="s", utc=True).strftime("%H:%M:%S")
    return f"{when} UTC, {d['subject']} {d['field']}: run {d['actual']}, replay {d['replayed']}"


def render(controller_url: str, start: float, end: float) -> None:
    st.subheader("Replay: this window's decisions under the stored or a changed policy")
    preset = st.query_params.get("replay", "")
    with st.form("replay_form"):
        text = st.text_input(
            "Policy settings to change (name=value, comma separated; empty: the stored config)",
            value=preset,
            key="replay_set",
            placeholder="max_weight_step=0.05, min_weight=0.05",
        )
        go = st.form_submit_button("Replay")
    if not (go or preset):
        st.caption(
            "Re-runs the policy over the recorded ticks of the time range: the stored config must reproduce "
            "every decision; changed settings show where the decisions would have parted (same evidence)."
        )
        return
    changes = [c.strip() for c in text.split(",") if c.strip()]
    try:
        body = ControllerClient(controller_url, None, timeout_s=20.0).replay(start, end, changes)
    except ControllerError as exc:
        st.warning(f"**Replay not available.** {exc}", icon=":material/history:")
        return
    missing = sorted(REQUIRED - set(body))
    if missing:
        st.warning(f"**Replay not available.** The controller's answer lacks {', '.join(missing)}.")
        return
    kind, msg = headline(body)
    getattr(st, kind)(msg)
    moved = {n for n, c in body["weights"].items() if c["actual"]["seconds"] != c["replayed"]["seconds"]}
    df = timeline_frame(body.get("timeline", {}), moved or None)
    if not df.empty:
        st.altair_chart(side_by_side(df), width="stretch")
    _tables(body)


def _tables(body: dict[str, Any]) -> None:
    """The weights and decision counts side by side, then the alerts, run against replay."""
    left, right = st.columns(2)
    with left:
        st.dataframe(weights_table(body["weights"]), hide_index=True, width="stretch")
    with right:
        decisions = pd.DataFrame(
            [{"reason": k, "run": v["actual"], "replay": v["replayed"]} for k, v in body["decisions"].items()]
        )
        st.dataframe(decisions, hide_index=True, width="stretch")
    if body["alerts"]:
        alerts = pd.DataFrame(
            [
                {
                    "alert": k,
                    "firing s (run)": a["actual_firing_s"],
                    "firing s (replay)": a["replayed_firing_s"],
                    "fired (run)": a["actual_fired"],
                    "fired (replay)": a["replayed_fired"],
                }
                for k, a in body["alerts"].items()
            ]
        )
        st.dataframe(alerts, hide_index=True, width="stretch")
