"""How a data page opens: the window, the title line, and the empty state when the store
has nothing of the kind the page draws; and how it runs (``run_page``: a fragment that live
mode reruns). Shared by the Fleet, KV transfer, Prefix cache, Predictor, Requests and Capacity
pages.

Not a page itself (``app.py`` lists the pages by hand); it queries only presence and the
newest timestamp, and draws only the header and the empty states.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import streamlit as st

from dashboard import context, data, ui
from dashboard.context import View
from dashboard.queries.common import Presence, Window

Needs = Literal["snapshots", "request records"]

_HAVE: dict[Needs, Callable[[Presence], bool]] = {
    "snapshots": lambda p: p.snapshots,
    "request records": lambda p: p.requests,
}


@dataclass(frozen=True)
class Opened:
    """What the rest of the page draws from: the newest stored time and the window."""

    latest: float | None
    window: Window


def open_page(view: View, title: str, what: str, needs: Needs) -> Opened | None:
    """Draw the header; return None (after the right empty state) when there are no ``needs``."""
    url = view.store_url
    presence = data.presence(url)
    latest = data.latest_ts(url)
    window = view.window(context.now(), latest)
    ui.header(title, view, window, what)
    if not ui.need(presence, view, needs, _HAVE[needs](presence), latest):
        return None
    return Opened(latest, window)


def run_page(view: View, title: str, what: str, needs: Needs, draw: Callable[[Opened], None]) -> None:
    """Run a data page: a fragment, rerun every ``view.refresh_s`` while live, that opens the page
    (``open_page``) and, unless it has nothing to draw from, draws the rest with ``draw``."""

    @functools.wraps(draw)  # the fragment is known by the page's own function, as before
    def page() -> None:
        opened = open_page(view, title, what, needs)
        if opened is not None:
            draw(opened)

    st.fragment(run_every=view.refresh_s if view.live else None)(page)()
