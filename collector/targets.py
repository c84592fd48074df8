"""Scrape targets and the snapshot rows the collector writes for them.

A ``ScrapeTarget`` is one configured P or D instance as the collector scrapes it: where its
``/metrics`` page is and which pool and role its rows are filed under (the proxy's
``proxy.routing.Target`` is another thing: where to send work, and with what weight).
``snapshot_row`` turns one scrape's outcome (signals, or an error) into the column values of
one ``store.models.Snapshot``. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from collector.signals import Signals
from pdscope.config import Settings
from pdscope.routing import Role


@dataclass(frozen=True)
class ScrapeTarget:
    name: str
    pool: str
    role: Role
    url: str
    metrics_url: str


def targets_from_settings(settings: Settings) -> list[ScrapeTarget]:
    out: list[ScrapeTarget] = []
    for pool_name, inst in settings.instances():
        role = settings.pools[pool_name].role
        out.append(ScrapeTarget(inst.name, pool_name, role, inst.url, inst.scrape_url))
    return out


def snapshot_row(
    target: ScrapeTarget,
    ts: float,
    duration_s: float | None,
    signals: Signals | None,
    error: str | None,
) -> dict[str, Any]:
    """Column values for one Snapshot. ``up`` is true when the page was read and parsed."""
    row: dict[str, Any] = {
        "instance": target.name,
        "pool": target.pool,
        "role": target.role,
        "ts": ts,
        "up": signals is not None,
        "scrape_duration_s": duration_s,
        "error": error,
        "histograms": {},
        "extra": {},
    }
    if signals is not None:
        row.update(signals.values)
        row["histograms"] = signals.histograms
        row["extra"] = signals.extra
        row["engines"] = signals.engines
        row["process_start_ts"] = signals.process_start_ts
        if signals.errors and error is None:
            row["error"] = "; ".join(signals.errors[:5])[:2000]
    return row
