"""The TTFT predictor, measured: how far the proxy's predictions were from the TTFT each request saw.

The proxy's predictor says, at admission, what TTFT a request will see on the P and D it is sent to
(``predicted_ttft_s`` on its record, with the ``ttft_target_s`` it was admitted against). Over a
window's records this module says, for the fleet, per P pool and per P instance:

* ``predicted``: the records that carry a prediction; ``measured``: those of them that also have an
  observed TTFT (a rejected or failed request has none) and a prediction above zero;
* the median and the p90 of the *error* ``|observed / predicted - 1|`` over the measured records
  (``pdscope.stats.percentile``; None with none measured);
* the *misses*: measured records whose TTFT was over their own target. A miss was *mispredicted*
  when its prediction was within the target (the predictor said it would make it: admitted in good
  faith, served late), else *predicted late* (it was admitted although predicted over: a cold
  predictor, or admission by prediction off). Mostly mispredicted misses say the predictor, not the
  load, is what failed: the fleet changed under it.

Pure: rows in, figures out; no I/O, no clock. The rows are read by ``store.prediction``, for the
controller's alert (``TTFTMispredicted``), ``pdscope explain`` and the dashboard's *Predictor* page.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final, NamedTuple

from pdscope.stats import percentile

MOSTLY: Final = 0.5  # a share of misses over this is "most of them"


class PredictionFacts(NamedTuple):
    """What the analysis reads of one request record (the columns of the same names)."""

    p_pool: object
    p_instance: object
    ttft_s: object
    predicted_ttft_s: object
    ttft_target_s: object


def _num(x: object) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) else None


def ratio(observed: object, predicted: object) -> float | None:
    """Observed over predicted TTFT, or None (either absent, not finite, or a prediction of zero)."""
    o, p = _num(observed), _num(predicted)
    return o / p if o is not None and p is not None and p > 0 and o >= 0 else None


@dataclass(frozen=True)
class ErrorFigures:
    """The predictor's figures over one group of records (see the module docstring)."""

    predicted: int = 0
    measured: int = 0
    error_p50: float | None = None
    error_p90: float | None = None
    misses: int = 0
    mispredicted: int = 0
    predicted_late: int = 0

    @property
    def mispredicted_share(self) -> float | None:
        """Of the misses, the share predicted in time; None: no miss."""
        return self.mispredicted / self.misses if self.misses else None

    def summary(self) -> str:
        """One line with the figures, for a person."""
        if not self.measured:
            return f"{self.predicted} predicted, none with an observed TTFT"
        text = (
            f"{self.measured} measured predictions: |observed/predicted - 1| median "
            f"{100 * (self.error_p50 or 0.0):.0f}%, p90 {100 * (self.error_p90 or 0.0):.0f}%"
        )
        if self.misses:
            text += (
                f"; of {self.misses} TTFT misses {self.mispredicted} were predicted in time "
                f"and {self.predicted_late} predicted late"
            )
        return text


@dataclass
class _Group:
    predicted: int = 0
    errors: list[float] = field(default_factory=list)
    misses: int = 0
    mispredicted: int = 0

    def add(self, r: PredictionFacts) -> None:
        pred = _num(r.predicted_ttft_s)
        if pred is None:
            return
        self.predicted += 1
        q = ratio(r.ttft_s, pred)
        if q is None:
            return
        self.errors.append(abs(q - 1.0))
        target, ttft = _num(r.ttft_target_s), _num(r.ttft_s)
        if target is not None and ttft is not None and ttft > target:
            self.misses += 1
            if pred <= target:
                self.mispredicted += 1

    def figures(self) -> ErrorFigures:
        return ErrorFigures(
            predicted=self.predicted,
            measured=len(self.errors),
            error_p50=percentile(self.errors, 50),
            error_p90=percentile(self.errors, 90),
            misses=self.misses,
            mispredicted=self.mispredicted,
            predicted_late=self.misses - self.mispredicted,
        )


@dataclass(frozen=True)
class PredictionReport:
    """The figures for the fleet, per P pool and per P instance (only those with a prediction)."""

    fleet: ErrorFigures
    pools: dict[str, ErrorFigures]
    instances: dict[str, ErrorFigures]


def measure(rows: Iterable[PredictionFacts]) -> PredictionReport:
    """The predictor's figures over ``rows`` (a window's records, in any order)."""
    fleet = _Group()
    pools: dict[str, _Group] = {}
    instances: dict[str, _Group] = {}
    for r in rows:
        fleet.add(r)
        if isinstance(r.p_pool, str):
            pools.setdefault(r.p_pool, _Group()).add(r)
        if isinstance(r.p_instance, str):
            instances.setdefault(r.p_instance, _Group()).add(r)
    return PredictionReport(
        fleet.figures(),
        {k: g.figures() for k, g in sorted(pools.items()) if g.predicted},
        {k: g.figures() for k, g in sorted(instances.items()) if g.predicted},
    )


def mispredicted_misses(f: ErrorFigures, mostly: float = MOSTLY) -> str | None:
    """A sentence when most TTFT misses were predicted in time (the predictor, not the load, failed);
    None otherwise (no miss, or most were predicted late)."""
    share = f.mispredicted_share
    if share is None or share <= mostly:
        return None
    return (
        f"{f.mispredicted} of {f.misses} TTFT misses ({100 * share:.0f}%) were mispredicted: admitted "
        f"with a predicted TTFT within their target, served late (prediction error median "
        f"{100 * (f.error_p50 or 0.0):.0f}%, p90 {100 * (f.error_p90 or 0.0):.0f}% over {f.measured} "
        "requests): the fleet changed under the predictor"
    )
