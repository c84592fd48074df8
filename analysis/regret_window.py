"""The regret of a stored range: the three reads, then :func:`analysis.regret.regret_of`.

One sequence for every caller (the controller's ``GET /v1/decisions/regret`` and the dashboard's
regret page): the cuts' decisions from the start of the range, the records and the scrapes of the
cut instances over the read plan (:func:`analysis.regret.plan`), then the analysis. The reads go
through a :class:`RegretReader` (``store.regret.Reader`` reads them from a session), so this module
does no I/O itself and a test can hand it rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from analysis.regret import (
    DecisionFact,
    RecordFact,
    Regret,
    RegretConfig,
    ScrapeFact,
    cut_instances,
    plan,
    regret_of,
)


class RowsRead(Protocol):
    """Rows read, oldest first, each a tuple in the order of its fact type's fields."""

    @property
    def rows(self) -> Sequence[tuple[Any, ...]]: ...

    @property
    def truncated(self) -> bool: ...  # more matched than the read's limit


class RegretReader(Protocol):
    """The reads regret judges from; each may raise the store's error, none writes."""

    def decisions(self, since: float, fields: Iterable[str]) -> RowsRead:
        """The decisions of ``fields`` from ``since`` on (``DecisionFact`` rows)."""
        ...

    def records(self, lo: float, hi: float) -> RowsRead:
        """The records that came in over ``[lo, hi]`` (``RecordFact`` rows)."""
        ...

    def scrapes(self, instances: Iterable[str], lo: float, hi: float) -> RowsRead:
        """The scrapes of ``instances`` over ``[lo, hi]`` (``ScrapeFact`` rows)."""
        ...


@dataclass(frozen=True)
class WindowRegret:
    """The regret of a stored range, and which of its reads were cut short."""

    regret: Regret
    truncated: tuple[str, ...]  # "decisions", "records", "scrapes"

    def as_dict(self, max_cuts: int = 200) -> dict[str, Any]:
        return {**self.regret.as_dict(max_cuts), "truncated": list(self.truncated)}


def judge_window(
    reader: RegretReader, lo: float, hi: float, *, now: float, cfg: RegretConfig
) -> WindowRegret:
    """Read what the cuts of ``[lo, hi]`` are judged on, with data up to ``now``, and judge them."""
    p = plan(lo, hi, now, cfg)
    d_rows = reader.decisions(lo, cfg.cut_fields)
    decisions = [DecisionFact(*row) for row in d_rows.rows]
    r_rows = reader.records(p.records_from, p.data_until)
    s_rows = reader.scrapes(cut_instances(decisions, lo, hi), lo, p.data_until)
    result = regret_of(
        p,
        decisions,
        [RecordFact(*row) for row in r_rows.rows],
        [ScrapeFact(*row) for row in s_rows.rows],
        observed_until=min(now, p.data_until),
        cfg=cfg,
    )
    cut_short = tuple(
        name
        for name, rows in (("decisions", d_rows), ("records", r_rows), ("scrapes", s_rows))
        if rows.truncated
    )
    return WindowRegret(result, cut_short)
