"""Decision regret of a stored range: the reads, then the pure analysis.

Serves ``GET /v1/decisions/regret`` and the controller's live flapping tally. The range is the one
:mod:`controller.attribution` parses (``since`` back from now, or ``from`` / ``until``); a cut of it
is judged on the data after it up to now (``controller.policy.regret.plan``). The records read are
the ones the controller believes (``controller.trusted_span_senders``), requests refused as invalid
left out; each read is bounded and the answer says when one was cut short (``truncated``). The
analysis is :func:`controller.policy.regret.regret_of` with the flap horizon given, ticks of
``controller.interval_s`` and the SLO window ``slo.window_s``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Final

from sqlalchemy.orm import Session, sessionmaker

from controller.observe import trusted_filter
from controller.policy.regret import (
    DecisionFact,
    RecordFact,
    Regret,
    RegretConfig,
    ScrapeFact,
    cut_instances,
    plan,
    regret_of,
)
from pdscope.config import Settings
from store import regret as reads
from store.db import transaction

DEFAULT_FLAP_TICKS: Final = 10
MAX_DECISIONS: Final = 100_000
MAX_RECORDS: Final = 200_000
MAX_SCRAPES: Final = 200_000


def config_for(settings: Settings, flap_ticks: int = DEFAULT_FLAP_TICKS) -> RegretConfig:
    """The regret config of this controller: its tick interval and SLO window, ``flap_ticks`` given."""
    return RegretConfig(
        flap_ticks=flap_ticks, tick_s=settings.controller.interval_s, slo_window_s=settings.slo.window_s
    )


@dataclass(frozen=True)
class WindowRegret:
    """The regret of a stored range, and which of its reads were cut short."""

    regret: Regret
    truncated: tuple[str, ...]  # "decisions", "records", "scrapes"

    def as_dict(self, max_cuts: int = 200) -> dict[str, Any]:
        return {**self.regret.as_dict(max_cuts), "truncated": list(self.truncated)}


def read_regret(
    session: Session, settings: Settings, lo: float, hi: float, *, now: float, cfg: RegretConfig
) -> WindowRegret:
    """Read what the cuts of ``[lo, hi]`` are judged on (in ``session``) and judge them."""
    p = plan(lo, hi, now, cfg)
    d_rows = reads.decisions(session, lo, cfg.cut_fields, limit=MAX_DECISIONS)
    decisions = [DecisionFact(*row) for row in d_rows.rows]
    only = replace(trusted_filter(settings), charged_only=True)
    r_rows = reads.records(
        session,
        p.records_from,
        p.data_until,
        settings.slo,
        only=only,
        limit=MAX_RECORDS,
    )
    s_rows = reads.scrapes(session, cut_instances(decisions, lo, hi), lo, p.data_until, limit=MAX_SCRAPES)
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


def window_regret(
    factory: sessionmaker[Session],
    settings: Settings,
    lo: float,
    hi: float,
    *,
    now: float,
    flap_ticks: int = DEFAULT_FLAP_TICKS,
) -> WindowRegret:
    """:func:`read_regret` in a transaction of its own."""
    with transaction(factory) as session:
        return read_regret(session, settings, lo, hi, now=now, cfg=config_for(settings, flap_ticks))
