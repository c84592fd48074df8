"""What ``pdscope explain`` charges in a faulty run, against the side that was faulty (issue 29).

The blame matrix asks who the weights cut; an SRE asks ``pdscope explain`` why requests missed. The
two must agree: explain's top reason over the run's faulty phase (:func:`top_reason`, the same
``controller.attribution.window_attribution`` the command prints) should name the faulty side. A
place names it (:func:`names_faulty`) when it is a faulty instance, a faulty P's row (``P->*``: every
link out of it), a faulty D's column (``*->D``), or, for a fault on one link, that pair (``P->D``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.goodput.pairs import Pair


def top_reason(store_url: str, config: Path, since: float, until: float) -> dict[str, Any] | None:
    """Explain's top reason for the misses of the records received from ``since`` to ``until`` (Unix
    s), under the run's config; None when nothing missed."""
    from controller.attribution import window_attribution
    from pdscope.config import load_config
    from store.db import opened

    settings = load_config(config)
    with opened(store_url) as factory:
        top = window_attribution(factory, settings, since, until).attribution.top
    if not top:
        return None
    g = top[0]
    return {"stage": g.stage, "place": g.place, "cause": str(g.cause), "share": round(g.share, 3)}


def names_faulty(place: str, faulty: list[str], pair: Pair | None) -> bool:
    """Whether an attribution ``place`` names the faulty side: the pair of a fault on one link, else a
    faulty instance, its row or its column."""
    if pair is not None:
        return place == f"{pair[0]}->{pair[1]}"
    if place in faulty:
        return True
    src, arrow, dst = place.partition("->")
    return bool(arrow) and ((src in faulty and dst == "*") or (dst in faulty and src == "*"))
