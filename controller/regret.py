"""Decision regret of a stored range: the reads, then the pure analysis.

Serves ``GET /v1/decisions/regret`` and the controller's live flapping tally. The range is the one
:mod:`controller.attribution` parses (``since`` back from now, or ``from`` / ``until``); a cut of it
is judged on the data after it up to now (``analysis.regret.plan``). The records read are
the ones the controller believes (``controller.trusted_span_senders``), requests refused as invalid
left out; each read is bounded and the answer says when one was cut short (``truncated``). The
reads and the analysis are :func:`analysis.regret_window.judge_window` (the dashboard's too) with
the flap horizon given, ticks of ``controller.interval_s`` and the SLO window ``slo.window_s``.

:class:`FlapTally` is the live part for ``/metrics``: the last hour's cuts and flaps per reason,
from the decisions alone (no records or scrapes are read at scrape time), recomputed at most every
``every_s``; a store error keeps the last tally (and is logged), never failing the scrape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Final

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session, sessionmaker

from analysis.regret import DecisionFact, Regret, RegretConfig, regret
from analysis.regret_window import WindowRegret, judge_window
from controller.observe import trusted_filter
from pdscope.config import Settings
from store import regret as reads
from store.db import StoreError, transaction

log = logging.getLogger(__name__)

DEFAULT_FLAP_TICKS: Final = 10
MAX_DECISIONS: Final = 100_000
MAX_RECORDS: Final = 200_000
MAX_SCRAPES: Final = 200_000


def config_for(settings: Settings, flap_ticks: int = DEFAULT_FLAP_TICKS) -> RegretConfig:
    """The regret config of this controller: its tick interval and SLO window, ``flap_ticks`` given."""
    return RegretConfig(
        flap_ticks=flap_ticks, tick_s=settings.controller.interval_s, slo_window_s=settings.slo.window_s
    )


def read_regret(
    session: Session, settings: Settings, lo: float, hi: float, *, now: float, cfg: RegretConfig
) -> WindowRegret:
    """Read what the cuts of ``[lo, hi]`` are judged on (in ``session``) and judge them."""
    only = replace(trusted_filter(settings), charged_only=True)
    reader = reads.Reader(
        session,
        settings.slo,
        only,
        max_decisions=MAX_DECISIONS,
        max_records=MAX_RECORDS,
        max_scrapes=MAX_SCRAPES,
    )
    return judge_window(reader, lo, hi, now=now, cfg=cfg)


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


class FlapTally(Collector):
    """``pdscope_decision_cuts{reason}``, ``pdscope_decision_flapped{reason}`` and
    ``pdscope_decision_flap_rate{reason}`` over the last :attr:`WINDOW_S` seconds."""

    WINDOW_S: Final = 3600.0

    def __init__(
        self,
        factory: sessionmaker[Session],
        settings: Settings,
        clock: Callable[[], float],
        *,
        flap_ticks: int = DEFAULT_FLAP_TICKS,
        every_s: float = 30.0,
    ) -> None:
        self.factory = factory
        self.clock = clock
        self.cfg = config_for(settings, flap_ticks)
        self.every_s = every_s
        self._at: float | None = None
        self._tally: Regret | None = None

    def _refresh(self, now: float) -> None:
        if self._at is not None and now - self._at < self.every_s:
            return
        since = now - self.WINDOW_S
        try:
            with transaction(self.factory) as session:
                rows = reads.decisions(session, since, self.cfg.cut_fields, limit=MAX_DECISIONS).rows
        except StoreError as exc:
            log.warning("decision regret for /metrics: %s (keeping the last tally)", exc)
            return
        facts = [DecisionFact(*row) for row in rows]
        self._tally = regret(facts, (), (), since=since, until=now, observed_until=now, cfg=self.cfg)
        self._at = now

    def collect(self) -> Iterator[Metric]:
        self._refresh(self.clock())
        labels = ["reason"]
        window = f"the last {self.WINDOW_S / 60:.0f} min"
        cuts = GaugeMetricFamily(
            "pdscope_decision_cuts", f"Weight and limit cuts the policy made in {window}.", labels=labels
        )
        flapped = GaugeMetricFamily(
            "pdscope_decision_flapped",
            f"Cuts of {window} undone within {self.cfg.flap_ticks} ticks (flapping).",
            labels=labels,
        )
        rate = GaugeMetricFamily(
            "pdscope_decision_flap_rate",
            f"Flapped over the cuts of {window} whose {self.cfg.flap_ticks} ticks have passed.",
            labels=labels,
        )
        for t in () if self._tally is None else self._tally.reasons:
            cuts.add_metric([t.reason], t.cuts)
            flapped.add_metric([t.reason], t.flapped)
            if t.flap_rate is not None:
                rate.add_metric([t.reason], t.flap_rate)
        yield cuts
        yield flapped
        yield rate
