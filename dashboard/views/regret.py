"""The Controller page's "Decision regret" section: for every weight or limit cut of the range, what
happened next (did the instance's signals recover, the fleet's SLO attainment before and after, was
the cut undone and after how many ticks), and the tally per reason with its flapping rate: a number
the controller's tuning can be judged by.

Not a page itself: :func:`section` is called from ``views/controller.py``. The figures are the
controller's own (``GET /v1/decisions/regret``, ``analysis.regret``) over the same store
(``dashboard.queries.investigate``).
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import data, summaries, ui
from dashboard.context import View
from dashboard.queries import investigate
from dashboard.queries.common import Window
from dashboard.queries.investigate import Regret

DEFAULT_FLAP_TICKS = 10
TALLY_COLUMNS = (
    "reason",
    "cuts",
    "undone",
    "flapped",
    "flap_rate",
    "pending",
    "median_ticks_to_undo",
    "median_s_to_undo",
    "recovered",
    "slo_delta_pts",  # the mean SLO attainment after - before, in points
)
CUT_COLUMNS = (
    "ts",
    "subject",
    "field",
    "reason",
    "cut",  # old → new value
    "recovered_after_s",
    "slo_before",
    "slo_after",
    "undone_after_ticks",
    "undone_by",
    "flapped",
    "pending",
)


def tally_frame(r: Regret) -> pd.DataFrame:
    """One row per reason, most cuts first."""
    return summaries.attribute_frame(
        r.reasons,
        TALLY_COLUMNS,
        {"slo_delta_pts": lambda t: None if t.mean_slo_delta is None else 100.0 * t.mean_slo_delta},
    )


def cuts_frame(r: Regret) -> pd.DataFrame:
    """One row per cut, newest first."""
    cut = {"cut": lambda c: f"{c.old_value:g} → {c.new_value:g}"}
    return summaries.attribute_frame(reversed(r.cuts), CUT_COLUMNS, cut)


def _totals(r: Regret) -> None:
    total = r.total
    cols = st.columns(4)
    cols[0].metric("cuts", f"{total.cuts}")
    for col, (label, value, delta) in zip(
        cols[1:],
        (
            (
                "flapping rate",
                "—" if total.flap_rate is None else f"{total.flap_rate:.0%}",
                f"{total.flapped} undone within {r.flap_ticks} ticks",
            ),
            ("undone", f"{total.undone}", f"{total.pending} too recent to say"),
            ("signals recovered", f"{total.recovered}", "of the cuts of an instance"),
        ),
        strict=True,
    ):
        col.metric(label, value, delta, delta_color="off", delta_arrow="off")


def _tables(r: Regret) -> None:
    """The tally per reason, and every cut (in an expander)."""
    st.dataframe(
        tally_frame(r),
        hide_index=True,
        width="stretch",
        column_config={
            "flap_rate": st.column_config.NumberColumn("flapping rate", format="percent"),
            "median_s_to_undo": st.column_config.NumberColumn("median s to undo", format="%.0f"),
            "median_ticks_to_undo": st.column_config.NumberColumn("median ticks to undo", format="%.0f"),
            "slo_delta_pts": st.column_config.NumberColumn(
                "SLO attainment after − before (pts)", format="%+.1f"
            ),
        },
    )
    with st.expander(f"{len(r.cuts)} cuts and what followed each"):
        st.dataframe(
            ui.to_time(cuts_frame(r), "ts"),
            hide_index=True,
            width="stretch",
            column_config={
                "slo_before": st.column_config.NumberColumn("SLO before", format="percent"),
                "slo_after": st.column_config.NumberColumn("SLO after", format="percent"),
                "recovered_after_s": st.column_config.NumberColumn("recovered after (s)", format="%.0f"),
            },
        )


def _explained(view: View, result: investigate.WindowRegret) -> None:
    settings = view.settings
    cfg = investigate.regret_config(
        flap_ticks=result.regret.flap_ticks,
        tick_s=settings.controller.interval_s,
        slo_window_s=settings.slo.window_s,
    )
    st.caption(
        f"Recovered: in a bucket after the cut the instance's scrapes were up, its KV usage at most "
        f"{cfg.max_kv_usage:.0%}, its failed share at most {cfg.max_failed_share:.0%} and its stage time "
        f"within {cfg.stage_tolerance:g}× its peers' median (over at least {cfg.min_requests} requests). "
        f"SLO: the fleet's attainment over slo.window_s = {cfg.slo_window_s:g} s before the cut and "
        "after it. Undone: a later decision back at the value the cut started from."
        + (f" Reads cut short: {', '.join(result.truncated)}." if result.truncated else "")
    )


def section(view: View, window: Window) -> None:
    """Draw the section for the cuts of ``window`` (judged on the data up to its end)."""
    st.subheader("Decision regret")
    settings = view.settings
    flap_ticks = st.number_input(
        "A cut undone within this many ticks flapped",
        min_value=1,
        max_value=10_000,
        value=DEFAULT_FLAP_TICKS,
        key="regret_flap_ticks",
        help=f"one tick is controller.interval_s = {settings.controller.interval_s:g} s",
    )
    senders = settings.controller.trusted_span_senders
    result = data.regret(
        view.store_url,
        window.start,
        window.end,
        settings.slo,
        None if senders is None else tuple(senders),
        settings.controller.interval_s,
        int(flap_ticks),
    )
    r = result.regret
    if not r.cuts:
        st.caption("The controller cut no weight or limit in this time range.")
        return
    _totals(r)
    _tables(r)
    _explained(view, result)
