"""The Streamlit entrypoint: loads the config, draws the sidebar (time range, live
refresh) and routes to the pages with ``st.navigation``.

Run it with ``pdscope dashboard`` (or ``streamlit run dashboard/app.py -- --config
pdscope.yaml``). It reads the store and never writes it; changes go through the
controller API from the Controller page, as the signed-in user (``dashboard.auth``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import streamlit as st

from dashboard import auth, context
from pdscope.config import ConfigError

VIEWS = Path(__file__).parent / "views"

st.set_page_config(page_title="pdscope", page_icon=":material/monitoring:", layout="wide")

try:
    config_path, settings = context.load_settings(sys.argv[1:])
except ConfigError as exc:
    st.error("**pdscope cannot load its configuration.**\n\n" + "\n".join(f"- {p}" for p in exc.problems))
    st.stop()

st.sidebar.markdown("### pdscope")
auth.sidebar(settings)  # sign-in (dashboard.auth: login) or the proxy's identity (header)
view = context.sidebar(config_path, settings)

nav = st.navigation(
    {
        "Health": [
            st.Page(VIEWS / "fleet.py", title="Fleet", icon=":material/dns:", url_path="fleet", default=True),
            st.Page(
                VIEWS / "slos.py", title="SLOs & alerts", icon=":material/notifications:", url_path="slos"
            ),
            st.Page(VIEWS / "tenants.py", title="Tenants", icon=":material/groups:", url_path="tenants"),
        ],
        "Investigate": [
            st.Page(
                VIEWS / "attribution.py",
                title="Why we missed",
                icon=":material/troubleshoot:",
                url_path="why",
            ),
            st.Page(VIEWS / "requests.py", title="Requests", icon=":material/timeline:", url_path="requests"),
            st.Page(
                VIEWS / "kv_transfer.py", title="KV transfer", icon=":material/swap_horiz:", url_path="kv"
            ),
            st.Page(
                VIEWS / "prefix_cache.py", title="Prefix cache", icon=":material/cached:", url_path="prefix"
            ),
            st.Page(
                VIEWS / "predictor.py", title="Predictor", icon=":material/query_stats:", url_path="predictor"
            ),
        ],
        "Steer": [
            st.Page(
                VIEWS / "controller.py", title="Controller", icon=":material/tune:", url_path="controller"
            ),
            st.Page(VIEWS / "capacity.py", title="Capacity", icon=":material/speed:", url_path="capacity"),
        ],
    }
)
nav.run()
