"""What the TTFT predictor's measurement reads of the store: a range's records that carry a prediction.

One read for the controller's observation (the ``TTFTMispredicted`` alert), ``pdscope explain`` and the
dashboard's *Predictor* page; the rows become ``analysis.prediction.PredictionFacts`` (``Facts(*row)``:
the columns :data:`PREDICTION_COLUMNS`, in that order). Bounded: at most ``limit`` records, the newest,
and it says when it left some out. It reads; it never writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import Connection, select
from sqlalchemy.orm import Session

from store.models import RequestRecord
from store.queries import EVERY_RECORD, RecordFilter

MAX_RECORDS: Final = 200_000  # the most any caller may ask for
DEFAULT_RECORDS: Final = 50_000

_R = RequestRecord
# the order of analysis.prediction.PredictionFacts
PREDICTION_COLUMNS: Final = (_R.p_pool, _R.p_instance, _R.ttft_s, _R.predicted_ttft_s, _R.ttft_target_s)


@dataclass(frozen=True)
class PredictionRows:
    """Rows read, newest first; ``truncated``: more matched than the limit (the oldest were left out)."""

    rows: tuple[tuple[Any, ...], ...]
    truncated: bool


def prediction_rows(
    reader: Session | Connection,
    since: float,
    until: float,
    *,
    only: RecordFilter = EVERY_RECORD,
    limit: int = DEFAULT_RECORDS,
) -> PredictionRows:
    """The records in ``[since, until]`` (by ``proxy_in``) with a predicted TTFT, read through a session
    (the controller) or a connection (the dashboard), at most ``limit``
    (1 to :data:`MAX_RECORDS`, else ``ValueError``), the newest first."""
    if not 1 <= limit <= MAX_RECORDS:
        raise ValueError(f"limit must be 1 to {MAX_RECORDS}, got {limit}")
    stmt = (
        select(*PREDICTION_COLUMNS)
        .where(_R.proxy_in >= since, _R.proxy_in <= until, _R.predicted_ttft_s.is_not(None))
        .order_by(_R.proxy_in.desc(), _R.id.desc())
        .limit(limit + 1)
    )
    rows = reader.execute(only.apply(stmt)).all()
    return PredictionRows(tuple(tuple(r) for r in rows[:limit]), len(rows) > limit)
