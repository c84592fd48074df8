"""Why we missed: the SLO misses of the range split over their stages (admission wait, P queue,
prefill, handoff incl. the KV pull, D queue, decode) against the healthy requests' medians, and
grouped by the stage, the instance or P×D pair and the cause that explain them: the top three
reasons with their share and since when, a chart by stage, a table by place and cause.

The range is the sidebar's, or an alert's window when the page is opened from the SLOs & alerts
page (``?from=<unix s>&until=<unix s>&alert=<rule>``). The figures are the controller's own
attribution (``GET /v1/slo/attribution``, ``pdscope explain``) over the same records, read here
from the store (``dashboard.queries.investigate``), so they agree and need no controller.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import pandas as pd
import streamlit as st

from dashboard import charts, context, data, summaries, ui
from dashboard.queries.common import Window
from dashboard.queries.investigate import STAGE_LABELS, Attribution, WindowAttribution

view = context.current()
url = view.store_url
settings = view.settings
SENDERS = (
    None
    if settings.controller.trusted_span_senders is None
    else tuple(settings.controller.trusted_span_senders)
)
GROUPINGS = {
    "stage, place and cause": ["stage", "place", "cause"],
    "place (instance or P×D pair)": ["place"],
    "cause": ["cause"],
    "stage": ["stage"],
}


@dataclass(frozen=True)
class Picked:
    """A window given in the URL (an alert's), and what it is."""

    window: Window
    alert: str | None


def picked_window(params: Mapping[str, str]) -> Picked | str | None:
    """The ``from`` / ``until`` URL parameters as a window; a message when they are not valid; None
    when not given (the sidebar's range applies)."""
    if "from" not in params:
        return None
    try:
        lo = float(params["from"])
        # an alert still firing: until now (rounded, so reruns share the cached read)
        hi = float(params["until"]) if "until" in params else math.ceil(context.now() / 5.0) * 5.0
    except ValueError:
        return "from and until must be Unix seconds; showing the sidebar's range instead"
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return "the linked range must start before it ends; showing the sidebar's range instead"
    alert = params.get("alert")
    return Picked(Window(lo, hi), str(alert)[:128] if alert else None)


def groups_frame(a: Attribution) -> pd.DataFrame:
    """One row per (stage, place, cause) group, as the attribution sorts them."""
    columns = ("stage", "place", "cause", "share", "misses", "excess_s", "since", "last")
    return summaries.attribute_frame(a.groups, columns, {"misses": lambda g: g.count})


def misses_over_time(a: Attribution, window: Window) -> pd.DataFrame:
    """Misses per time bucket by the stage that holds most of each one's excess."""
    width = window.bucket_s(60)
    rows = []
    for m in a.misses:
        main = max(m.stages, key=lambda s: s.excess_s)
        rows.append({"t": window.start + ((m.proxy_in - window.start) // width) * width, "stage": main.stage})
    if not rows:
        return pd.DataFrame(columns=["time", "stage", "misses"])
    df = pd.DataFrame(rows).groupby(["t", "stage"]).size().reset_index(name="misses")
    df["stage"] = df["stage"].map(lambda s: STAGE_LABELS.get(s, s))
    return ui.to_time(df.rename(columns={"t": "time"}), "time")


def _table(groups: pd.DataFrame) -> None:
    st.subheader("By instance, P×D pair and cause")
    choice = st.segmented_control(
        "Group by", list(GROUPINGS), default="stage, place and cause", key="why_group_by"
    )
    keys = GROUPINGS[str(choice or "stage, place and cause")]
    table = groups.groupby(keys, as_index=False).agg(
        share=("share", "sum"),
        misses=("misses", "sum"),
        excess_s=("excess_s", "sum"),
        since=("since", "min"),
        last=("last", "max"),
    )
    table = table.sort_values(["share", "misses"], ascending=False)
    if "stage" in table:
        table["stage"] = table["stage"].map(lambda s: STAGE_LABELS.get(s, s))
    if keys != ["stage", "place", "cause"]:
        st.caption("A miss counts once in each group its excess falls in, so the misses may add up to more.")
    st.dataframe(
        ui.to_time(table, "since", "last"),
        hide_index=True,
        width="stretch",
        column_config={
            "share": st.column_config.ProgressColumn("share of the excess", format="percent", min_value=0.0),
            "excess_s": st.column_config.NumberColumn("excess (s)", format="%.2f"),
            "misses": st.column_config.NumberColumn(format="%d"),
        },
    )


def _linked(picked: Picked | str | None, window: Window) -> None:
    """Say which window a link picked (or why it was refused), with a way back to the sidebar's."""
    if isinstance(picked, str):
        st.warning(picked, icon=":material/link_off:")
    elif picked is not None:
        what = f"alert **{picked.alert}**" if picked.alert else "a linked range"
        st.info(
            f"Showing the window of {what}: {ui.fmt_ts(window.start)} → {ui.fmt_ts(window.end)}, "
            "not the sidebar's range.",
            icon=":material/notifications:",
        )
        if st.button("Follow the sidebar's range", key="why_clear"):
            for k in ("from", "until", "alert"):
                st.query_params.pop(k, None)
            st.rerun()


def _counts(result: WindowAttribution) -> None:
    a = result.attribution
    cols = st.columns(4)
    cols[0].metric("requests", f"{a.requests:,}")
    cols[1].metric(
        "missed their SLO",
        f"{a.missed:,}",
        f"{a.missed / a.requests:.1%} of them",
        delta_color="off",
        delta_arrow="off",
    )
    cols[2].metric("healthy (the baselines)", f"{a.healthy:,}")
    cols[3].metric("excess over the baselines", f"{a.total_excess_s:,.1f} s")
    if result.truncated:
        st.caption(f"Only the newest {result.limit:,} records of the range were read: pick a shorter range.")


def _top_reasons(a: Attribution) -> None:
    st.subheader("Top reasons we missed")
    for i, g in enumerate(a.top, start=1):
        st.markdown(f"**{i}.** {g.message}")
    if a.baseline_source == "zero":
        st.warning(
            "No request met its SLO in this range, so the baselines are zero: each miss's excess is the "
            "whole of its stages.",
            icon=":material/warning:",
        )


def _charts(a: Attribution, groups: pd.DataFrame, window: Window) -> None:
    left, right = st.columns(2)
    with left:
        by = groups.groupby(["stage", "cause"], as_index=False)["share"].sum()
        by["stage"] = by["stage"].map(lambda s: STAGE_LABELS.get(s, s))
        st.altair_chart(
            charts.share_bars(
                by, "stage", "share", "cause", "Share of the excess by stage", list(STAGE_LABELS.values())
            ),
            width="stretch",
        )
    with right:
        st.altair_chart(
            charts.stacked_counts(
                misses_over_time(a, window), "misses", "stage", "Misses over time, by their main stage"
            ),
            width="stretch",
        )


def _baselines(a: Attribution) -> None:
    base = ", ".join(
        f"{STAGE_LABELS.get(k, k)} {v * 1000:.0f} ms" for k, v in a.baselines.items() if k in STAGE_LABELS
    )
    st.caption(
        f"Baselines (the healthy requests' medians): {base or 'none'}. A stage's excess is its time over "
        "its baseline, counted only over the stages of what the request missed (TTFT, TPOT or both)."
    )


def render() -> None:
    presence = data.presence(url)
    latest = data.latest_ts(url)
    picked = picked_window(st.query_params.to_dict())
    window = picked.window if isinstance(picked, Picked) else view.window(context.now(), latest)
    ui.header(
        "Why we missed",
        view,
        window,
        "SLO misses split over stages against the healthy requests' medians",
    )
    _linked(picked, window)
    if not ui.need(presence, view, "request records", presence.requests, latest):
        return
    result = data.attribution(url, window.start, window.end, settings.slo, SENDERS)
    a = result.attribution
    if a.requests == 0:
        ui.no_data(view, "request records", latest)
        return
    _counts(result)
    if a.missed == 0:
        st.success(
            f"No request missed its SLO in this range ({a.requests:,} requests).",
            icon=":material/check_circle:",
        )
        return
    _top_reasons(a)
    groups = groups_frame(a)
    _charts(a, groups, window)
    _table(groups)
    _baselines(a)


st.fragment(run_every=view.refresh_s if view.live and not st.query_params.get("from") else None)(render)()
