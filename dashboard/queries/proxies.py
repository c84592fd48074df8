"""The proxies in front of the fleet, as their routing polls left them in the store (``proxies``)."""

from __future__ import annotations

from typing import Any

import pandas as pd
from sqlalchemy import Engine, inspect, select

from store.models import ProxyMember


def _pools(raw: Any) -> dict[str, Any]:
    return raw if isinstance(raw, dict) else {}


def proxies(engine: Engine, now: float, ttl_s: float) -> pd.DataFrame:
    """One row per proxy and pool: live, age, the part it holds, its in-flight and demand.

    Empty when no proxy has reported (or the store predates the table)."""
    columns = [
        "proxy",
        "live",
        "age_s",
        "pool",
        "share",
        "max_inflight_requests",
        "inflight",
        "demand_per_s",
        "applied_version",
        "served_by",
        "duplicates",
    ]
    if not inspect(engine).has_table(ProxyMember.__tablename__):
        return pd.DataFrame(columns=columns)
    with engine.connect() as conn:
        rows = list(conn.execute(select(ProxyMember.__table__).order_by(ProxyMember.id)).mappings())
    out = []
    for r in rows:
        served, inflight, rates = _pools(r["served"]), _pools(r["inflight"]), _pools(r["rates"])
        for pool in sorted(set(served) | set(inflight)):
            part = _pools(served.get(pool))
            out.append(
                (
                    r["id"],
                    now - r["last_seen"] <= ttl_s,
                    round(max(0.0, now - r["last_seen"]), 1),
                    pool,
                    part.get("share"),
                    part.get("max_inflight_requests"),
                    inflight.get(pool, 0),
                    rates.get(pool),
                    r["applied_version"],
                    r["served_by"],
                    r["duplicates"],
                )
            )
    return pd.DataFrame.from_records(out, columns=columns)
