"""What the TTFT predictor's measurement reads of the store: a range's records that carry a prediction.

One read for the controller's observation (the ``TTFTMispredicted`` alert), ``pdscope explain`` and the
dashboard's *Predictor* page; the rows become ``analysis.prediction.PredictionFacts`` (``Facts(*row)``:
the columns :data:`PREDICTION_COLUMNS`, in that order). Bounded: at most ``limit`` records, the newest,
and it says when it left some out. It reads; it never writes.
"""

from __future__ import annotations

from typing import Final

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from store.models import RequestRecord
from store.queries import EVERY_RECORD, RecordFilter
from store.window import WindowRows, window_rows

MAX_RECORDS: Final = 200_000  # the most any caller may ask for
DEFAULT_RECORDS: Final = 50_000

_R = RequestRecord
# the order of analysis.prediction.PredictionFacts
PREDICTION_COLUMNS: Final = (_R.p_pool, _R.p_instance, _R.ttft_s, _R.predicted_ttft_s, _R.ttft_target_s)


def prediction_rows(
    reader: Session | Connection,
    since: float,
    until: float,
    *,
    only: RecordFilter = EVERY_RECORD,
    limit: int = DEFAULT_RECORDS,
) -> WindowRows:
    """The records in ``[since, until]`` (by ``proxy_in``) with a predicted TTFT that ``only`` keeps,
    newest first, at most ``limit`` (1 to :data:`MAX_RECORDS`, else ``ValueError``)."""
    has = (_R.predicted_ttft_s.is_not(None),)
    return window_rows(
        reader, PREDICTION_COLUMNS, since, until, only=only, limit=limit, max_limit=MAX_RECORDS, where=has
    )
