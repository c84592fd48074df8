"""Altair charts the pages share. Each takes a tidy DataFrame (times already datetimes)
and returns a chart; none fetches data or calls Streamlit.
"""

from __future__ import annotations

from typing import Any, cast

import altair as alt
import pandas as pd

from dashboard.derive import STAGE_ORDER, Stage

# Altair's methods are loosely typed; every builder returns something st.altair_chart draws.
ChartLike = alt.Chart | alt.LayerChart | alt.FacetChart


def _chart(obj: Any) -> ChartLike:
    return cast(ChartLike, obj)


def small_multiples(long: pd.DataFrame, columns: int = 1) -> ChartLike:
    """Lines of ``value`` over ``time``, one panel per (metric row, instance column)."""
    base = (
        alt.Chart(long)
        .mark_line(interpolate="step-after", strokeWidth=1.5)
        .encode(
            x=alt.X("time:T", title=None, axis=alt.Axis(format="%H:%M", labelAngle=0, tickCount=4)),
            y=alt.Y("value:Q", title=None, axis=alt.Axis(format="~s", tickCount=3)),
            color=alt.Color(
                "role:N",
                legend=None,
                scale=alt.Scale(domain=["prefill", "decode"], range=["#4c78a8", "#f58518"]),
            ),
            tooltip=[
                "instance:N",
                "metric:N",
                alt.Tooltip("time:T", format="%H:%M:%S"),
                alt.Tooltip("value:Q", format=".3g"),
            ],
        )
        .properties(width=150, height=70)
    )
    return _chart(
        base.facet(
            row=alt.Row("metric:N", title=None), column=alt.Column("instance:N", title=None)
        ).resolve_scale(y="independent")
    )


def lines(
    df: pd.DataFrame,
    y: str,
    color: str,
    title: str,
    y_title: str,
    *,
    rule: float | None = None,
    step: bool = False,
) -> ChartLike:
    chart = (
        alt.Chart(df)
        .mark_line(interpolate="step-after" if step else "linear", point=False)
        .encode(
            x=alt.X("time:T", title=None),
            y=alt.Y(f"{y}:Q", title=y_title),
            color=alt.Color(f"{color}:N", title=None),
            tooltip=[
                f"{color}:N",
                alt.Tooltip("time:T", format="%H:%M:%S"),
                alt.Tooltip(f"{y}:Q", format=".3g"),
            ],
        )
        .properties(title=title, height=220)
    )
    if rule is None:
        return _chart(chart)
    target = (
        alt.Chart(pd.DataFrame({"target": [rule]}))
        .mark_rule(color="#e45756", strokeDash=[6, 3])
        .encode(y="target:Q")
    )
    return _chart(alt.layer(chart, target))


def waterfall(stages: list[Stage]) -> ChartLike:
    df = pd.DataFrame(
        [
            {"stage": s.name, "start_ms": s.start_ms, "end_ms": s.end_ms, "ms": s.duration_ms, "note": s.note}
            for s in stages
        ]
    )
    order = [s for s in STAGE_ORDER if s in set(df["stage"])]
    y = alt.Y("stage:N", sort=order, title=None, axis=alt.Axis(labelLimit=260))
    bars = (
        alt.Chart(df[df["ms"] > 0])
        .mark_bar(height=16)
        .encode(
            x=alt.X("start_ms:Q", title="ms since the proxy received the request"),
            x2="end_ms:Q",
            y=y,
            color=alt.Color("stage:N", legend=None, sort=order),
            tooltip=["stage:N", alt.Tooltip("ms:Q", format=".1f", title="duration ms"), "note:N"],
        )
    )
    marks = (
        alt.Chart(df[df["ms"] <= 0])
        .mark_tick(thickness=3, size=20, color="#e45756")
        .encode(
            x="start_ms:Q", y=y, tooltip=["stage:N", alt.Tooltip("start_ms:Q", format=".1f", title="at ms")]
        )
    )
    return _chart(alt.layer(bars, marks).properties(height=40 + 28 * len(order)))


def heatmap(df: pd.DataFrame, value: str, title: str) -> ChartLike:
    base = alt.Chart(df).encode(
        x=alt.X("d_instance:N", title="decode", axis=alt.Axis(labelAngle=0)),
        y=alt.Y("p_instance:N", title="prefill"),
    )
    rect = base.mark_rect().encode(
        color=alt.Color(f"{value}:Q", title="ms", scale=alt.Scale(scheme="orangered")),
        tooltip=[
            "p_instance:N",
            "d_instance:N",
            "requests:Q",
            alt.Tooltip("p50_ms:Q", format=".0f"),
            alt.Tooltip("p99_ms:Q", format=".0f"),
            "lease_suspects:Q",
        ],
    )
    text = base.mark_text(fontSize=12).encode(text=alt.Text(f"{value}:Q", format=".0f"))
    return _chart(alt.layer(rect, text).properties(title=title, height=alt.Step(48)))


def timeline(df: pd.DataFrame) -> ChartLike:
    """Decisions as points: time × subject, coloured by reason."""
    return _chart(
        alt.Chart(df)
        .mark_point(filled=True, size=70)
        .encode(
            x=alt.X("time:T", title=None),
            y=alt.Y("subject:N", title=None),
            color=alt.Color("reason:N", title="reason"),
            shape=alt.Shape("field:N", title="field"),
            tooltip=[
                alt.Tooltip("time:T", format="%H:%M:%S"),
                "subject:N",
                "field:N",
                "old_value:Q",
                "new_value:Q",
                "reason:N",
                "message:N",
                "arithmetic:N",
            ],
        )
        .properties(height=60 + 22 * max(df["subject"].nunique(), 1))
    )


def histogram(values: pd.DataFrame, column: str, title: str, maxbins: int = 40) -> ChartLike:
    return _chart(
        alt.Chart(values)
        .mark_bar()
        .encode(
            x=alt.X(f"{column}:Q", bin=alt.Bin(maxbins=maxbins), title=title),
            y=alt.Y("count():Q", title="requests"),
        )
        .properties(height=200)
    )


def boxplot(values: pd.DataFrame, column: str, group: str, title: str) -> ChartLike:
    """One box per ``group`` of ``column`` (median, quartiles, 1.5 IQR whiskers, outliers)."""
    return _chart(
        alt.Chart(values)
        .mark_boxplot(extent=1.5)
        .encode(
            x=alt.X(f"{column}:Q", title=title, scale=alt.Scale(zero=False)),
            y=alt.Y(f"{group}:N", title=None),
        )
        .properties(height=40 + 28 * max(values[group].nunique(), 1))
    )


def paired_bars(
    df: pd.DataFrame, category: str, value: str, series: str, title: str, x_title: str, fmt: str = "~s"
) -> ChartLike:
    """Horizontal bars of ``value`` per ``category``, one bar per ``series`` side by side
    (e.g. predicted and reported cached tokens per instance); ``fmt`` the value axis' d3 format."""
    return _chart(
        alt.Chart(df)
        .mark_bar()
        .encode(
            y=alt.Y(f"{category}:N", title=None, axis=alt.Axis(labelLimit=200)),
            yOffset=alt.YOffset(f"{series}:N"),
            x=alt.X(f"{value}:Q", title=x_title, axis=alt.Axis(format=fmt)),
            color=alt.Color(f"{series}:N", title=None, scale=alt.Scale(range=["#4c78a8", "#f58518"])),
            tooltip=[
                f"{category}:N",
                f"{series}:N",
                alt.Tooltip(f"{value}:Q", format=",.0f" if fmt == "~s" else fmt),
            ],
        )
        .properties(title=title, height=alt.Step(14))
    )


def share_bars(
    df: pd.DataFrame, category: str, share: str, color: str, title: str, order: list[str]
) -> ChartLike:
    """Horizontal bars of ``share`` (0..1) per ``category`` in ``order``, stacked by ``color``."""
    return _chart(
        alt.Chart(df, title=title)
        .mark_bar()
        .encode(
            y=alt.Y(f"{category}:N", sort=order, title=None, axis=alt.Axis(labelLimit=200)),
            x=alt.X(f"{share}:Q", title="share", axis=alt.Axis(format="%")),
            color=alt.Color(f"{color}:N", title=color),
            tooltip=[f"{category}:N", f"{color}:N", alt.Tooltip(f"{share}:Q", format=".1%")],
        )
        .properties(height=alt.Step(26))
    )


def stacked_counts(df: pd.DataFrame, count: str, color: str, title: str) -> ChartLike:
    """Bars of ``count`` over ``time``, stacked by ``color``."""
    return _chart(
        alt.Chart(df, title=title)
        .mark_bar()
        .encode(
            x=alt.X("time:T", title=None, axis=alt.Axis(format="%H:%M", labelAngle=0)),
            y=alt.Y(f"{count}:Q", title=count, stack="zero"),
            color=alt.Color(f"{color}:N", title=color),
            tooltip=[alt.Tooltip("time:T", format="%H:%M:%S"), f"{color}:N", f"{count}:Q"],
        )
        .properties(height=240)
    )
