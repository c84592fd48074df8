"""The dashboard's session context: which config and store it reads, the time range the
SRE picked and whether the pages refresh live.

The config path comes from ``--config`` after ``streamlit run app.py --`` (what
``pdscope dashboard`` passes) or from ``$PDSCOPE_CONFIG`` via ``pdscope.config``. The
settings and the engine are cached per process (``st.cache_resource``); the engine
refuses anything but reads, so a page cannot write to the store by mistake.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import streamlit as st
from sqlalchemy import Engine, event

from dashboard.queries.common import Window
from pdscope.config import Settings, load_config, resolve_config_path
from store.db import make_engine

# Short names for the ``?range=`` URL parameter (shareable links, screenshots).
RANGE_PARAMS = {
    "5m": "Last 5 min",
    "15m": "Last 15 min",
    "1h": "Last 1 h",
    "6h": "Last 6 h",
    "24h": "Last 24 h",
}
RANGES: dict[str, float] = {
    "Last 5 min": 300.0,
    "Last 15 min": 900.0,
    "Last 1 h": 3600.0,
    "Last 6 h": 6 * 3600.0,
    "Last 24 h": 86400.0,
}
CUSTOM = "Custom…"
DEFAULT_RANGE = "Last 15 min"
REFRESH_CHOICES = (2.0, 5.0, 10.0, 30.0)
_VIEW_KEY = "_pdscope_view"
_READ_PREFIXES = ("SELECT", "WITH", "PRAGMA", "SHOW", "EXPLAIN")


class ReadOnlyViolation(RuntimeError):
    """A dashboard query tried to write to the store; pages must write through the API."""


@dataclass(frozen=True)
class View:
    """What every page needs: settings, the picked range and the refresh mode."""

    config_path: str
    settings: Settings
    range_s: float
    anchor: Literal["now", "latest data"]
    live: bool
    refresh_s: float
    custom: tuple[float, float] | None = None  # a fixed [start, end) picked by hand

    @property
    def store_url(self) -> str:
        return self.settings.store.url

    def window(self, now: float, latest: float | None) -> Window:
        """The window ending now (or at the newest stored data), rounded up to the refresh step
        so reruns within one step share cached query results. A custom range is used as is."""
        if self.custom is not None:
            return Window(*self.custom)
        step = max(self.refresh_s, 1.0)
        end = latest + 1.0 if self.anchor == "latest data" and latest is not None else now
        end = math.ceil(end / step) * step
        return Window(end - self.range_s, end)


def config_path_from_argv(argv: Sequence[str]) -> str | None:
    """``--config PATH`` from the script arguments, if given."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--config")
    known, _ = parser.parse_known_args(list(argv))
    value = known.config
    return None if value is None else str(value)


@st.cache_resource(show_spinner=False)
def _settings_for(path: str, mtime: float) -> Settings:
    return load_config(path)


def load_settings(argv: Sequence[str]) -> tuple[str, Settings]:
    """Resolve and load the config (raises ``ConfigError``); reloaded when the file changes."""
    path = resolve_config_path(config_path_from_argv(argv))
    try:
        mtime = path.stat().st_mtime
    except OSError:
        mtime = 0.0
    return str(path), _settings_for(str(Path(path).resolve()), mtime)


def _refuse_writes(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
    head = statement.lstrip().split(None, 1)[0].upper() if statement.strip() else ""
    if head not in _READ_PREFIXES:
        raise ReadOnlyViolation(f"the dashboard only reads the store; refused: {head}")


@st.cache_resource(show_spinner=False)
def engine_for(url: str) -> Engine:
    """One read-only engine per store URL for the whole Streamlit process."""
    engine = make_engine(url)
    event.listen(engine, "before_cursor_execute", _refuse_writes)
    return engine


def sidebar(config_path: str, settings: Settings) -> View:
    """Draw the time-range picker and live-refresh controls; remember the view for pages.

    URL parameters set the initial values: ``?range=1h&anchor=latest&live=0``.
    """
    sb = st.sidebar
    params = st.query_params
    sb.caption(f"config `{config_path}`")
    initial = RANGE_PARAMS.get(str(params.get("range", "")), DEFAULT_RANGE)
    range_label = sb.selectbox(
        "Time range", [*RANGES, CUSTOM], index=list(RANGES).index(initial), key="range"
    )
    custom: tuple[float, float] | None = None
    if range_label == CUSTOM:
        now_dt = dt.datetime.now(tz=dt.UTC).replace(second=0, microsecond=0)
        start_dt = sb.datetime_input("From (UTC)", value=now_dt - dt.timedelta(hours=1), key="custom_start")
        end_dt = sb.datetime_input("To (UTC)", value=now_dt, key="custom_end")
        start_ts, end_ts = _utc_ts(start_dt), _utc_ts(end_dt)
        if end_ts <= start_ts:
            sb.error("'To' must be after 'From'.")
            end_ts = start_ts + 60.0
        custom = (start_ts, end_ts)
    anchor = sb.radio(
        "Ending at",
        ["now", "latest data"],
        index=1 if params.get("anchor") == "latest" else 0,
        horizontal=True,
        key="anchor",
        help="'latest data' ends the range at the newest stored snapshot or request, "
        "for a store that is no longer being fed.",
    )
    live = sb.toggle("Live refresh", value=params.get("live") != "0", key="live")
    refresh_s = sb.select_slider(
        "Refresh every (s)", options=list(REFRESH_CHOICES), value=5.0, key="refresh_s", disabled=not live
    )
    range_s = custom[1] - custom[0] if custom else RANGES[str(range_label)]
    view = View(
        config_path=config_path,
        settings=settings,
        range_s=range_s,
        anchor="latest data" if anchor == "latest data" else "now",
        live=bool(live) and custom is None,
        refresh_s=float(refresh_s),
        custom=custom,
    )
    st.session_state[_VIEW_KEY] = view
    return view


def _utc_ts(value: dt.datetime | dt.date | None) -> float:
    """Unix seconds of a picked date-time (naive values are UTC, as the labels say)."""
    if value is None:
        return time.time()
    if not isinstance(value, dt.datetime):
        value = dt.datetime.combine(value, dt.time())
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    return value.timestamp()


def current() -> View:
    """The view the entrypoint stored for this run (pages call this)."""
    view = st.session_state.get(_VIEW_KEY)
    if not isinstance(view, View):
        raise RuntimeError("pages must be run through dashboard/app.py (st.navigation)")
    return view


def now() -> float:
    """Wall clock for the pages (one place, so tests can reason about it)."""
    return time.time()
