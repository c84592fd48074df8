"""How far the proxy's TTFT predictions were from what came: the controlled runs' stored records.

The proxy puts its admission-time prediction (``predicted_ttft_s``) on each request's span; the
collector stores it beside the observed ``ttft_s`` in ``request_records``. The bench's client sees
only HTTP, so it reads them from the run's store. ``prediction_error`` is pure; ``read_predictions``
reads the store and returns None where the store has no such column (a proxy that predicts nothing).
"""

from __future__ import annotations

import math
from typing import Any

from pdscope.stats import percentiles

MIN_PREDICTED_S = 1e-3  # a prediction below this is no prediction (the ratio would be noise)


def read_predictions(store_url: str, since: float) -> list[tuple[float, float]] | None:
    """(predicted, observed) TTFT of every record received from ``since`` (Unix s) with both; None
    when ``request_records`` has no ``predicted_ttft_s``."""
    from sqlalchemy import create_engine, inspect, text

    engine = create_engine(store_url)
    try:
        cols = {c["name"] for c in inspect(engine).get_columns("request_records")}
        if "predicted_ttft_s" not in cols:
            return None
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT predicted_ttft_s, ttft_s FROM request_records WHERE proxy_in >= :since "
                    "AND predicted_ttft_s IS NOT NULL AND ttft_s IS NOT NULL"
                ),
                {"since": since},
            ).all()
        return [(float(p), float(o)) for p, o in rows]
    finally:
        engine.dispose()


def prediction_error(pairs: list[tuple[float, float]] | None) -> dict[str, Any]:
    """Median and p90 of ``|observed / predicted - 1|`` over ``pairs``; ``n`` the pairs counted (a
    non-finite value or a prediction under ``MIN_PREDICTED_S`` is left out, and counted in
    ``skipped``). Nones where there is nothing to count."""
    if pairs is None:
        return {"n": 0, "skipped": 0, "median": None, "p90": None, "recorded": False}
    errs = [
        abs(o / p - 1)
        for p, o in pairs
        if math.isfinite(p) and math.isfinite(o) and p >= MIN_PREDICTED_S and o >= 0
    ]
    median, p90 = percentiles(errs, (50, 90))
    return {"n": len(errs), "skipped": len(pairs) - len(errs), "median": median, "p90": p90, "recorded": True}
