"""Reads for the "why" pages: the SLO-miss attribution of a window and the regret of the controller's
cuts, each the controller's own pure analysis over the rows read here.

The dashboard reads the store itself (it must work with the controller down), and runs the same
pure functions the controller's ``GET /v1/slo/attribution`` and ``GET /v1/decisions/regret`` run
(``controller.policy.attribution``, ``controller.policy.regret``: no I/O, so the dashboard may
import them; this is the one module that does). The records are those the controller believes
(``controller.trusted_span_senders``), requests refused as invalid left out, as the controller reads
them, so the page and the API agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from controller.policy.attribution import STAGE_LABELS, Attribution, StageRecord, attribute
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
from dashboard.queries.common import connect
from pdscope.config import SLOSettings
from store import regret as reads
from store.models import RequestRecord
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
    return RecordFilter(None if senders is None else frozenset(senders), charged_only=True)


def _transfer_failed(attributes: Mapping[str, Any] | None) -> bool:
    """A NIXL transfer failed on the D during the handoff (the collector's ``nixl`` join)."""
    nixl = (attributes or {}).get("nixl")
    d = nixl.get("d") if isinstance(nixl, dict) else None
    n = d.get("nixl_failed_transfers") if isinstance(d, dict) else None
    return isinstance(n, int | float) and not isinstance(n, bool) and n > 0


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
    r = RequestRecord
    stmt = believed(senders).apply(
        select(
            r.request_id,
            r.proxy_in,
            r.status,
            r.p_instance,
            r.d_instance,
            r.p_sent,
            r.p_done,
            r.d_sent,
            r.first_token,
            r.done,
            r.p_queue_s,
            r.ttft_s,
            r.tpot_s,
            r.completion_tokens,
            r.lease_expiry_suspect,
            r.attributes,
            r.retries,
        )
        .where(r.proxy_in >= start, r.proxy_in <= end)
        .order_by(r.proxy_in.desc(), r.id.desc())
        .limit(limit + 1)
    )
    with connect(engine) as conn:
        rows = conn.execute(stmt).all()
    records = [
        StageRecord(
            request_id=x.request_id,
            proxy_in=x.proxy_in,
            status=x.status,
            p_instance=x.p_instance,
            d_instance=x.d_instance,
            p_sent=x.p_sent,
            p_done=x.p_done,
            d_sent=x.d_sent,
            first_token=x.first_token,
            done=x.done,
            p_queue_s=x.p_queue_s,
            ttft_s=x.ttft_s,
            tpot_s=x.tpot_s,
            completion_tokens=x.completion_tokens,
            lease_expired=bool(x.lease_expiry_suspect),
            transfer_failed=_transfer_failed(x.attributes),
            retries=x.retries or 0,
        )
        for x in reversed(rows[:limit])
    ]
    return WindowAttribution(attribute(records, slo, since=start, until=end), len(rows) > limit, limit)


def regret_config(*, flap_ticks: int, tick_s: float, slo_window_s: float) -> RegretConfig:
    """The controller's regret config (``controller.regret.config_for``) from plain values."""
    return RegretConfig(flap_ticks=flap_ticks, tick_s=tick_s, slo_window_s=slo_window_s)


@dataclass(frozen=True)
class WindowRegret:
    regret: Regret
    truncated: tuple[str, ...]  # which reads were cut short: "decisions", "records", "scrapes"


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
    p = plan(start, end, now, cfg)
    with connect(engine) as conn, Session(bind=conn) as session:
        d_rows = reads.decisions(session, start, cfg.cut_fields, limit=MAX_READ)
        decisions = [DecisionFact(*row) for row in d_rows.rows]
        r_rows = reads.records(
            session, p.records_from, p.data_until, slo, only=believed(senders), limit=MAX_READ
        )
        s_rows = reads.scrapes(
            session, cut_instances(decisions, start, end), start, p.data_until, limit=MAX_READ
        )
    result = regret_of(
        p,
        decisions,
        [RecordFact(*row) for row in r_rows.rows],
        [ScrapeFact(*row) for row in s_rows.rows],
        observed_until=min(now, p.data_until),
        cfg=cfg,
    )
    cut_short = tuple(
        n for n, rows in (("decisions", d_rows), ("records", r_rows), ("scrapes", s_rows)) if rows.truncated
    )
    return WindowRegret(result, cut_short)
