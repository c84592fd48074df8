"""Reads for the *Predictor* page: how far the proxy's TTFT predictions were from the observed TTFT.

The page and the controller's ``TTFTMispredicted`` alert read the same records (``store.prediction``:
those the controller believes, ``controller.trusted_span_senders``, requests refused as invalid left
out) and run the same pure analysis (``analysis.prediction``), so the two agree. An Engine and a window
in, a frame and the figures out; no Streamlit here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import pandas as pd
from sqlalchemy import Engine

from analysis.prediction import PredictionFacts, PredictionReport, measure, ratio
from dashboard.queries.common import connect
from dashboard.queries.investigate import believed
from store.prediction import DEFAULT_RECORDS, prediction_rows

COLUMNS: Final = (*PredictionFacts._fields, "ratio")


@dataclass(frozen=True)
class WindowPrediction:
    """The window's records with a prediction (``COLUMNS``; ``ratio``: observed / predicted TTFT, NaN
    where there is no observed TTFT), the figures over them, and whether the oldest were left out."""

    frame: pd.DataFrame
    report: PredictionReport
    truncated: bool
    limit: int


def prediction(
    engine: Engine,
    start: float,
    end: float,
    senders: tuple[str, ...] | None,
    limit: int = DEFAULT_RECORDS,
) -> WindowPrediction:
    """The newest ``limit`` believed records of ``[start, end]`` that carry a TTFT prediction."""
    with connect(engine) as conn:
        read = prediction_rows(conn, start, end, only=believed(senders), limit=limit)
    facts = [PredictionFacts(*r) for r in read.rows]
    frame = pd.DataFrame(
        [(*f, ratio(f.ttft_s, f.predicted_ttft_s)) for f in facts], columns=list(COLUMNS)
    ).astype({"ratio": "float64"})
    return WindowPrediction(frame, measure(facts), read.truncated, limit)
