"""What the controller did in one run, from its stored decisions: reaction time and healthy cuts.

* a *weight cut*: a ``weight`` decision whose new value is below the old;
* a *limit cut*: a ``max_inflight_requests`` / ``max_inflight_kv_bytes`` decision that lowers the
  limit (a first decision, with no old value, is compared with the proxy's configured default);
* *reaction*: the first cut after onset of a faulty instance's weight or of any pool limit, in ticks;
* *healthy weight cuts*: weight cuts below ``HEALTHY_FLOOR`` of an instance the fault is not about
  (every instance before onset, and every instance in a healthy run);
* *unexpected limit cuts*: limit cuts before onset, or of a pool the fault does not name
  (``FaultPlan.limit_pools``: both pools for a burst, the prefill pool for a slow P, none otherwise);
* *startup cuts*: cuts before the client's first request (the services just started side by side),
  reported apart;
* *wait cuts to zero*: ``max_queue_wait_s`` set to 0 (reported, not counted as a healthy cut: it
  rejects only where a pool is at its limit).

``read_decisions`` reads the store directly (the killed contender's controller is gone by then).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from bench.goodput.catalogue import FaultPlan

HEALTHY_FLOOR = 0.9
REACTION_TICKS = 5  # the target: the faulty side cut within 5 ticks of the fault's onset
# the proxy's admission defaults in the bench's config (stack.py: 256; the config's 64 GiB)
LIMIT_DEFAULTS = {"max_inflight_requests": 256.0, "max_inflight_kv_bytes": float(64 * 2**30)}


def read_decisions(store_url: str) -> list[dict[str, Any]]:
    from sqlalchemy import create_engine, select
    from sqlalchemy.orm import Session

    from store.models import Decision

    engine = create_engine(store_url)
    try:
        with Session(engine) as session:
            rows = session.scalars(select(Decision).order_by(Decision.id)).all()
            cols = [c.name for c in Decision.__table__.columns]
            return [{c: getattr(r, c) for c in cols} for r in rows]
    finally:
        engine.dispose()


def is_weight_cut(d: dict[str, Any]) -> bool:
    old, new = d.get("old_value"), d.get("new_value")
    return d.get("field") == "weight" and old is not None and new is not None and new < old


def is_wait_cut(d: dict[str, Any]) -> bool:
    """The admission wait budget lowered (to 0: a request finding its pool full is rejected at once)."""
    old, new = d.get("old_value"), d.get("new_value")
    return d.get("field") == "max_queue_wait_s" and old is not None and new is not None and new < old


def is_limit_cut(d: dict[str, Any]) -> bool:
    field, old, new = d.get("field"), d.get("old_value"), d.get("new_value")
    if field not in LIMIT_DEFAULTS or new is None:
        return False
    return bool(new < (LIMIT_DEFAULTS[str(field)] if old is None else old))


def analyse(
    decisions: list[dict[str, Any]],
    plan: FaultPlan,
    onset: float | None,
    interval_s: float,
    load_from: float | None = None,
) -> dict[str, Any]:
    """``onset``: unix time of the fault (None: a healthy run, every instance is healthy throughout);
    ``load_from``: when the client's schedule began. Cuts before it (the services starting side by side,
    no request yet) are counted apart as ``startup_cuts``, not as healthy cuts."""
    after = math.inf if onset is None else onset
    if load_from is not None:
        early = [d for d in decisions if d["ts"] < load_from]
        decisions = [d for d in decisions if d["ts"] >= load_from]
    else:
        early = []
    healthy_w = [
        d
        for d in decisions
        if is_weight_cut(d)
        and d["new_value"] < HEALTHY_FLOOR
        and (d["ts"] < after or d["subject"] not in plan.faulty)
    ]
    limits = [d for d in decisions if is_limit_cut(d)]
    unexpected = [d for d in limits if d["ts"] < after or d["subject"] not in plan.limit_pools]
    reaction = [
        d
        for d in decisions
        if d["ts"] >= after and ((is_weight_cut(d) and d["subject"] in plan.faulty) or is_limit_cut(d))
    ]
    first = min((d["ts"] for d in reaction), default=None)
    out: dict[str, Any] = {
        "decisions": len(decisions) + len(early),
        "startup_cuts": sum(
            1 for d in early if (is_weight_cut(d) and d["new_value"] < HEALTHY_FLOOR) or is_limit_cut(d)
        ),
        "startup_cut_detail": [_brief(d) for d in early if is_weight_cut(d) or is_limit_cut(d)][:10],
        "weight_cuts": sum(1 for d in decisions if is_weight_cut(d)),
        "limit_cuts": len(limits),
        "healthy_weight_cuts": len(healthy_w),
        "unexpected_limit_cuts": len(unexpected),
        "healthy_cuts": len(healthy_w) + len(unexpected),
        "wait_cuts_to_zero": sum(1 for d in decisions if is_wait_cut(d) and d["new_value"] == 0),
        "healthy_cut_detail": [_brief(d) for d in (healthy_w + unexpected)[:20]],
        "min_weight": {
            s: min(
                d["new_value"]
                for d in decisions
                if d["field"] == "weight" and d["subject"] == s and d["new_value"] is not None
            )
            for s in sorted(
                {d["subject"] for d in decisions if d["field"] == "weight" and d["new_value"] is not None}
            )
        },
        "cut_reasons": dict(Counter(d["reason"] for d in decisions if is_weight_cut(d) or is_limit_cut(d))),
    }
    if onset is not None:
        out["reaction_s"] = None if first is None else round(first - onset, 3)
        out["reaction_ticks"] = None if first is None else math.ceil((first - onset) / interval_s)
    return out


def _brief(d: dict[str, Any]) -> dict[str, Any]:
    return {k: d.get(k) for k in ("ts", "tick", "subject", "field", "old_value", "new_value", "reason")}


def jsonable(decisions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Decisions as plain JSON values (the stored ones are already; this guards odd column types)."""
    out = []
    for d in decisions:
        out.append(
            {
                k: v if isinstance(v, (str, int, float, bool, list, dict, type(None))) else str(v)
                for k, v in d.items()
            }
        )
    return out
