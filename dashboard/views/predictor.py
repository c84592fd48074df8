"""Predictor: how far the proxy's TTFT predictions were from the TTFT the requests saw.

The proxy predicts, at admission, the TTFT of each request on the P and D it sends it to
(``proxy.predict``), and the record keeps it beside the observed one. For the chosen window this page
shows the error ``|observed / predicted - 1|`` (median and p90) for the fleet, per P pool and per P
instance, the distribution of observed / predicted per pool (a histogram) and per instance (a box),
and of the TTFT misses the share that was *mispredicted* (predicted within its target, served late)
rather than predicted late. The figures are ``analysis.prediction``'s over the records the controller
believes, as its ``TTFTMispredicted`` alert and ``pdscope explain`` read them
(``dashboard.queries.predictor``).
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from analysis.prediction import ErrorFigures
from dashboard import charts, context, data, ui
from dashboard.queries.predictor import WindowPrediction
from dashboard.views.opening import Opened, run_page
from store.attribution import trusted_senders

view = context.current()
url = view.store_url
settings = view.settings
SENDERS = trusted_senders(settings)


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.0f}%"


def _headline(f: ErrorFigures) -> None:
    cols = st.columns(4)
    cols[0].metric("predicted requests", f"{f.predicted:,}", f"{f.measured:,} with a TTFT", delta_color="off")
    cols[1].metric("median error", _pct(f.error_p50))
    cols[2].metric("p90 error", _pct(f.error_p90))
    cols[3].metric(
        "misses mispredicted",
        _pct(f.mispredicted_share),
        f"{f.mispredicted} of {f.misses} TTFT misses" if f.misses else "no TTFT miss",
        delta_color="off",
    )
    threshold = settings.alerts.mispredicted_error
    if f.error_p50 is not None and f.error_p50 > threshold:
        st.warning(
            f"The median error {_pct(f.error_p50)} is over the TTFTMispredicted threshold "
            f"{_pct(threshold)} (alerts.mispredicted_error): the fleet may have changed under the "
            "predictor.",
            icon=":material/warning:",
        )


def _table(groups: dict[str, ErrorFigures], key: str) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                key: name,
                "predicted": f.predicted,
                "measured": f.measured,
                "error_p50": f.error_p50,
                "error_p90": f.error_p90,
                "misses": f.misses,
                "mispredicted": f.mispredicted,
                "predicted_late": f.predicted_late,
                "mispredicted_share": f.mispredicted_share,
            }
            for name, f in groups.items()
        ]
    )


_FORMAT = {
    c: st.column_config.NumberColumn(format="percent")
    for c in ("error_p50", "error_p90", "mispredicted_share")
}


def _distribution(result: WindowPrediction) -> None:
    ratios = result.frame.dropna(subset=["ratio"])
    if ratios.empty:
        st.info("No request with a prediction has an observed TTFT in this range (all rejected or failed).")
        return
    left, right = st.columns(2)
    with left:
        st.altair_chart(charts.histogram(ratios, "ratio", "observed / predicted TTFT"), width="stretch")
    with right:
        by_inst = ratios.dropna(subset=["p_instance"])
        if not by_inst.empty:
            st.altair_chart(
                charts.boxplot(by_inst, "ratio", "p_instance", "observed / predicted TTFT per P"),
                width="stretch",
            )


def render(opened: Opened) -> None:
    window = opened.window
    result = data.prediction(url, window.start, window.end, SENDERS)
    fleet = result.report.fleet
    if fleet.predicted == 0:
        ui.no_data(view, "request records with a TTFT prediction (proxy.predict)", opened.latest)
        return
    if result.truncated:
        st.caption(f"Only the newest {result.limit:,} predicted requests of the range were read.")
    _headline(fleet)
    st.subheader("Error distribution")
    _distribution(result)
    st.subheader("Per pool and per instance")
    st.dataframe(_table(result.report.pools, "pool"), hide_index=True, width="stretch", column_config=_FORMAT)
    st.dataframe(
        _table(result.report.instances, "instance"), hide_index=True, width="stretch", column_config=_FORMAT
    )


run_page(
    view, "Predictor", "the proxy's TTFT predictions against the observed TTFT", "request records", render
)
