"""The TTFT predictor's attributes of a proxy root span, checked, as a request record's columns.

The proxy puts what its predictor said of a request on the root span (``pdscope.semconv``:
``PREDICTED_TTFT_S``, ``TTFT_TARGET_S``, ``PREDICT_TOKENS_AHEAD``, ``PREDICT_TOKENS``,
``PREDICT_SOURCE``). Each is checked against what it means, not only its column's type: the two
times are finite seconds in [0, :data:`MAX_SECONDS`], the token counts integers in
[0, ``collector.rootattrs.MAX_TOKENS``], the source one of ``semconv.PREDICT_SOURCES``. One that is
present but fails its check is left out and named in ``dropped`` (``collector.assemble`` adds it to
the record's ``dropped`` notes, which the sink counts), as the KV-aware routing attributes are.

Pure: attributes in, values out; no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

from collector.rootattrs import checked, token_count
from pdscope import semconv as sc

MAX_SECONDS: Final = 86_400.0  # a day: the largest target a request may ask for (proxy.predict)


@dataclass(frozen=True, slots=True)
class Predicted:
    """The root's predictor attributes, each checked (None: absent or invalid)."""

    predicted_ttft_s: float | None = None
    ttft_target_s: float | None = None
    predict_tokens_ahead: int | None = None
    predict_tokens: int | None = None
    predict_source: str | None = None
    dropped: tuple[str, ...] = ()  # the keys present but invalid, in semconv order


def _seconds(value: Any) -> float | None:
    """A finite number of seconds in [0, MAX_SECONDS] (a number or a numeric string), or None."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        f = float(value)
    except (ValueError, OverflowError):
        return None
    return f if math.isfinite(f) and 0.0 <= f <= MAX_SECONDS else None


def _source(value: Any) -> str | None:
    return value if isinstance(value, str) and value in sc.PREDICT_SOURCES else None


_CHECKS: Final = (
    (sc.PREDICTED_TTFT_S, _seconds),
    (sc.TTFT_TARGET_S, _seconds),
    (sc.PREDICT_TOKENS_AHEAD, token_count),
    (sc.PREDICT_TOKENS, token_count),
    (sc.PREDICT_SOURCE, _source),
)


def predicted(attrs: dict[str, Any]) -> Predicted:
    """The predictor's fields of a root span's attributes, and the keys that were invalid."""
    values, dropped = checked(attrs, _CHECKS)
    ttft, target, ahead, tokens, source = values
    return Predicted(ttft, target, ahead, tokens, source, dropped)
