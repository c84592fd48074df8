"""The SLO window kept between ticks: each tick adds the records that changed and slides the window.

The controller's SLO figures (attainment, goodput, TTFT and TPOT at the SLO percentiles, rejections;
``Observation.slo``) cover ``slo.window_s`` (300 s by default) of records: at 1,000 instances about
90,000 of them, read and judged again every 2 s tick. :class:`SLOWindow` keeps them instead: a tick
hands it the records stamped since the last read (``store.changes``) and the new ``now``; it adds
each record's part, takes back the part of a record that changed, and retires what left the window.
The TTFTs and TPOTs are kept sorted, so the percentiles are exact: the figures equal a whole read's
(``store.queries.slo_summary`` under the same trust and SLO), which ``tests/controller/test_slowindow.py``
checks tick by tick on SQLite and PostgreSQL, late updates and late commits included.

Which records count: as a whole read's, those the controller believes (``controller.trusted_span_senders``;
a record without a sender never matches a list) whose ``proxy_in`` lies in ``[now - window, now]``.
A record known before it enters the window (a ``proxy_in`` ahead of the clock) waits for it. A record
is never deleted inside the window (retention keeps hours); one that were would stay counted until it
left the window or the next whole read.

Pure: no I/O, no clock (``now`` is passed in). ``controller.observe`` owns the reads.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from sortedcontainers import SortedList

from analysis.prediction import ratio
from pdscope.config import SLOSettings
from pdscope.slo import slo_verdict
from pdscope.stats import percentile, percentile_of_sorted


class SLORow(NamedTuple):
    """The columns of a record the window reads (``controller.observe.SLO_COLUMNS``, in this order)."""

    id: int
    proxy_in: float | None
    status: str | None
    ttft_s: float | None
    tpot_s: float | None
    sender: str | None
    predicted_ttft_s: float | None = None


@dataclass(frozen=True, slots=True)
class _Part:
    """One counted record's part of the figures."""

    at: float
    status: str | None
    ttft: float | None  # completed with a TTFT: in the sorted TTFTs
    tpot: float | None  # completed with a TPOT: in the sorted TPOTs
    met: bool
    predicted: bool = False  # carries a predicted TTFT (the TTFT predictor's records)
    error: float | None = None  # the prediction's error (analysis.prediction): in the sorted errors


@dataclass(frozen=True, slots=True)
class WindowFigures:
    """What ``store.queries.slo_summary`` gives the controller for its window (``SLOFigures``' part)."""

    requests: int
    completed: int
    met: int
    statuses: dict[str | None, int]
    ttft_at_slo_s: float | None
    tpot_at_slo_s: float | None
    goodput_per_s: float


def _finite(v: float | None) -> float | None:
    """A stored duration that can be sorted (the collector stores no other; a whole read refuses one)."""
    return v if isinstance(v, float | int) and math.isfinite(v) else None


class SLOWindow:
    """The records of ``[now - span_s, now]`` that ``senders`` trust (None: all), judged under ``slo``."""

    def __init__(self, span_s: float, senders: frozenset[str] | None, slo: SLOSettings) -> None:
        self.span_s, self.senders, self.slo = span_s, senders, slo
        self.reset()

    def reset(self) -> None:
        """Forget everything (before a whole read)."""
        self.parts: dict[int, _Part] = {}
        self.times: SortedList = SortedList()  # (proxy_in, id) of every part kept
        self.lo, self.hi = -math.inf, -math.inf  # the window the counted parts are in
        self.ttfts: SortedList = SortedList()
        self.tpots: SortedList = SortedList()
        self.predicted: SortedList = SortedList()  # (proxy_in, id) of the counted parts with a prediction
        self.errors: SortedList = SortedList()  # the counted parts' prediction errors
        self.statuses: Counter[str | None] = Counter()
        self.counted = self.completed = self.met = 0

    def matches(self, span_s: float, senders: frozenset[str] | None, slo: SLOSettings) -> bool:
        """Whether this window is the one asked for (else the caller builds a new one: a config reload)."""
        return (self.span_s, self.senders, self.slo) == (span_s, senders, slo)

    # -- changes -------------------------------------------------------------------------------

    def update(self, rows: Iterable[Any]) -> None:
        """Each record as it is now (:class:`SLORow` fields, in order): its old part taken back, its new
        one kept if it can count (believed, a ``proxy_in`` not before the window)."""
        for row in rows:
            r = SLORow._make(row)
            old = self.parts.pop(r.id, None)
            if old is not None:
                self.times.remove((old.at, r.id))
                if self.lo <= old.at <= self.hi:
                    self._count(old, -1, r.id)
            part = self._part(r)
            if part is None or part.at < self.lo:
                continue
            self.parts[r.id] = part
            self.times.add((part.at, r.id))
            if part.at <= self.hi:
                self._count(part, +1, r.id)

    def _part(self, r: SLORow) -> _Part | None:
        """The part ``r`` would have; None when it never counts (not believed, no time to place it)."""
        if not isinstance(r.proxy_in, float | int) or not math.isfinite(r.proxy_in):
            return None
        if self.senders is not None and r.sender not in self.senders:
            return None
        ok = r.status == "ok"
        met = ok and slo_verdict(r.status, r.ttft_s, r.tpot_s, self.slo).met
        return _Part(
            float(r.proxy_in),
            r.status,
            _finite(r.ttft_s) if ok else None,
            _finite(r.tpot_s) if ok else None,
            met,
            r.predicted_ttft_s is not None,
            prediction_error(r.ttft_s, r.predicted_ttft_s),
        )

    def _count(self, p: _Part, sign: int, rid: int) -> None:
        self.counted += sign
        if p.predicted:
            _move(self.predicted, (p.at, rid), sign)
        if p.error is not None:
            _move(self.errors, p.error, sign)
        self.statuses[p.status] += sign
        if p.status == "ok":
            self.completed += sign
            self.met += sign if p.met else 0
            for values, v in ((self.ttfts, p.ttft), (self.tpots, p.tpot)):
                if v is not None:
                    _move(values, v, sign)

    # -- the clock -----------------------------------------------------------------------------

    def slide(self, now: float) -> None:
        """Make the window ``[now - span_s, now]``: count what entered it, take back and forget what left.
        A clock that went back recounts the kept parts."""
        lo, hi = now - self.span_s, now
        if lo < self.lo or hi < self.hi:
            self._recount(lo, hi)
            return
        for at, rid in self.times.irange((self.hi, math.inf), (hi, math.inf), inclusive=(False, True)):
            if at >= lo and at > self.hi:
                self._count(self.parts[rid], +1, rid)
        while self.times and self.times[0][0] < lo:
            at, rid = self.times.pop(0)
            part = self.parts.pop(rid)
            if self.lo <= at <= self.hi:
                self._count(part, -1, rid)
        self.lo, self.hi = lo, hi

    def _recount(self, lo: float, hi: float) -> None:
        kept = [(rid, p) for rid, p in self.parts.items() if p.at >= lo]
        self.reset()
        self.lo, self.hi = lo, hi
        for rid, p in kept:
            self.parts[rid] = p
            self.times.add((p.at, rid))
            if p.at <= hi:
                self._count(p, +1, rid)

    # -- the figures ---------------------------------------------------------------------------

    def figures(self) -> WindowFigures | None:
        """The window's figures; None when it counts no record (as a whole read finds none)."""
        if not self.counted:
            return None
        return WindowFigures(
            requests=self.counted,
            completed=self.completed,
            met=self.met,
            statuses={k: n for k, n in self.statuses.items() if n},
            ttft_at_slo_s=self._at(self.ttfts, self.slo.ttft.percentile),
            tpot_at_slo_s=self._at(self.tpots, self.slo.tpot.percentile),
            goodput_per_s=self.met / max(self.hi - self.lo, 1e-9),
        )

    @staticmethod
    def _at(values: SortedList, q: float) -> float | None:
        return percentile_of_sorted(values, q) if values else None

    def prediction(self, limit: int) -> tuple[int, float | None]:
        """The TTFT predictor's figures for the fleet over the window (``analysis.prediction.measure`` of
        ``store.prediction.prediction_rows``, its ``limit`` newest records with a prediction): how many
        were measured and the errors' median. Raises as ``measure`` does (an error that is not finite)."""
        if len(self.predicted) > limit:  # the newest only, as the read's order and limit keep them
            errors = [e for _, rid in self.predicted[-limit:] if (e := self.parts[rid].error) is not None]
            return len(errors), percentile(errors, 50)
        if self.errors and not math.isfinite(self.errors[-1]):  # +inf sorts last; as the read's measure does
            raise ValueError(f"percentile of a non-finite value {self.errors[-1]!r}")
        return len(self.errors), self._at(self.errors, 50)


def prediction_error(ttft: object, predicted: object) -> float | None:
    """A record's prediction error as ``analysis.prediction`` measures it (None: not measured)."""
    q = ratio(ttft, predicted)
    return None if q is None else abs(q - 1.0)


def _move(values: SortedList, v: Any, sign: int) -> None:
    """Add ``v`` to ``values`` (``sign`` > 0) or take one of it back."""
    if sign > 0:
        values.add(v)
    else:
        values.remove(v)
