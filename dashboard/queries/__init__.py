"""Read-only queries behind the dashboard pages, one module per subject.

They take an Engine and a :class:`~dashboard.queries.common.Window` and return pandas
DataFrames. Nothing here writes, caches or imports Streamlit.
"""

from dashboard.queries.common import Presence, Window, latest_ts, presence

__all__ = ["Presence", "Window", "latest_ts", "presence"]
