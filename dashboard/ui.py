"""Small pieces of page furniture: empty states that say what to do next, time and
number formatting, and the per-page header. Streamlit calls only; no queries.
"""

from __future__ import annotations

import datetime as dt
from typing import Literal

import pandas as pd
import streamlit as st

from dashboard.context import View
from dashboard.queries.common import Presence, Window


def fmt_ts(ts: float | None) -> str:
    if ts is None or pd.isna(ts):
        return "—"
    return dt.datetime.fromtimestamp(float(ts), tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def fmt_ms(v: float | None) -> str:
    if v is None or pd.isna(v):
        return "—"
    return f"{v / 1000:.2f} s" if v >= 10_000 else f"{v:.0f} ms"


def to_time(df: pd.DataFrame, *cols: str) -> pd.DataFrame:
    """Copy of ``df`` with the named Unix-second columns as UTC datetimes (for charts/tables)."""
    out = df.copy()
    for c in cols:
        if c in out:
            out[c] = pd.to_datetime(out[c], unit="s", utc=True)
    return out


def table_or_caption(
    df: pd.DataFrame, empty: str, time_cols: tuple[str, ...] = (), height: int | Literal["auto"] = "auto"
) -> None:
    """``df`` as a table, its ``time_cols`` as datetimes; the caption ``empty`` when it has no rows."""
    if df.empty:
        st.caption(empty)
    else:
        st.dataframe(to_time(df, *time_cols), hide_index=True, width="stretch", height=height)


def header(title: str, view: View, window: Window, what: str) -> None:
    st.title(title)
    live = f"live, every {view.refresh_s:g} s" if view.live else "paused"
    st.caption(f"{what} · {fmt_ts(window.start)} → {fmt_ts(window.end)} · {live}")


def no_store(view: View) -> None:
    st.info(
        "**The store has no pdscope tables yet.**\n\n"
        f"Create them with `pdscope --config {view.config_path} db upgrade`, then start the collector "
        f"with `pdscope --config {view.config_path} collect` (or everything at once with `make demo`).",
        icon=":material/database:",
    )


def no_data(view: View, kind: str, latest: float | None) -> None:
    """Explain an empty page: nothing collected yet, or nothing in this time range."""
    if latest is None:
        st.info(
            f"**No {kind} yet.** pdscope fills this page from what the collector stores.\n\n"
            f"1. Start the collector: `pdscope --config {view.config_path} collect` "
            "(it scrapes every configured instance's `/metrics` and receives spans on OTLP/HTTP).\n"
            f"2. Send traffic through the proxy: `pdscope --config {view.config_path} proxy`.\n"
            "3. Or run the whole stack on a simulated fleet: `make demo`.",
            icon=":material/hourglass_empty:",
        )
    else:
        st.info(
            f"**No {kind} in this time range.** The newest stored data is from {fmt_ts(latest)}: "
            "pick a longer range or set *Ending at* to *latest data* in the sidebar.",
            icon=":material/schedule:",
        )


def need(presence: Presence, view: View, kind: str, have: bool, latest: float | None) -> bool:
    """Show the right empty state and return False when a page has nothing to draw."""
    if not presence.schema:
        no_store(view)
        return False
    if not have:
        no_data(view, kind, None)
        return False
    return True
