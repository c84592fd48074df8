"""Reads for the "why" pages: the SLO-miss attribution of a window and the regret of the controller's
cuts, each the controller's own pure analysis over the rows read here.

The dashboard reads the store itself (it must work with the controller down), and runs the same
pure analyses the controller's ``GET /v1/slo/attribution`` and ``GET /v1/decisions/regret`` run
(``analysis.attribution``; ``analysis.regret_window``, the regret's reads and analysis in one) over
the same store reads (``store.attribution``, ``store.regret``). The records are those the controller believes
(``controller.trusted_span_senders``), requests refused as invalid left out, as the controller reads
them, so the page and the API agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from analysis.attribution import STAGE_LABELS, Attribution, attribute
from analysis.attribution_records import FailureSteps, stage_record
from analysis.regret import Regret, RegretConfig
from analysis.regret_window import WindowRegret, judge_window
from dashboard.queries.common import connect
from pdscope.config import SLOSettings
from store import regret as reads
from store.attribution import read_stage_rows, trusted_records
from store.queries import RecordFilter

__all__ = [
    "STAGE_LABELS",
    "Attribution",
    "Regret",
    "WindowAttribution",
    "WindowRegret",
    "attribution",
    "regret",
    "regret_config",
]

DEFAULT_RECORDS: Final = 50_000
MAX_READ: Final = 200_000


def believed(senders: tuple[str, ...] | None) -> RecordFilter:
    """The records the controller believes: from ``senders`` (None: any), refused ones left out."""
    return trusted_records(senders, charged_only=True)


@dataclass(frozen=True)
class WindowAttribution:
    attribution: Attribution
    truncated: bool  # the oldest records of the range were left out
    limit: int


def attribution(
    engine: Engine,
    start: float,
    end: float,
    slo: SLOSettings,
    senders: tuple[str, ...] | None,
    limit: int = DEFAULT_RECORDS,
) -> WindowAttribution:
    """The attribution of the newest ``limit`` believed records of ``[start, end]`` under ``slo``."""
    with connect(engine) as conn:
        rows, spans, truncated = read_stage_rows(conn, start, end, only=believed(senders), limit=limit)
    failures = FailureSteps(spans)
    records = [stage_record(x, failures) for x in rows]
    return WindowAttribution(attribute(records, slo, since=start, until=end), truncated, limit)


def regret_config(*, flap_ticks: int, tick_s: float, slo_window_s: float) -> RegretConfig:
    """The controller's regret config (``controller.regret.config_for``) from plain values."""
    return RegretConfig(flap_ticks=flap_ticks, tick_s=tick_s, slo_window_s=slo_window_s)


def regret(
    engine: Engine,
    start: float,
    end: float,
    now: float,
    slo: SLOSettings,
    senders: tuple[str, ...] | None,
    cfg: RegretConfig,
) -> WindowRegret:
    """The regret of the cuts of ``[start, end]``, judged on the data up to ``now``."""
    with connect(engine) as conn, Session(bind=conn) as session:
        reader = reads.Reader(
            session,
            slo,
            believed(senders),
            max_decisions=MAX_READ,
            max_records=MAX_READ,
            max_scrapes=MAX_READ,
        )
        return judge_window(reader, start, end, now=now, cfg=cfg)
