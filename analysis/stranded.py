"""Stranded KV, the rule's parts: one home for the ``StrandedKV`` alert (``controller.policy.alerts``) and the
dashboard's *KV transfer* page (``dashboard.summaries``).

KV is stranded on a P that holds blocks while idle (up, nothing running, nothing waiting) while no D waits
to pull from anyone: the blocks wait on leases no D will pull. A D's requests still to pull are its
KV-fetch gauges' ``waiting_to_start`` plus ``in_progress`` at its newest up scrape; a D missing either
gauge cannot be seen, and the total is then unknown (the rule abstains). Pure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def _value(v: float | None) -> float | None:
    return v if v is not None and not math.isnan(v) else None


def to_pull(waiting_to_start: float | None, in_progress: float | None) -> float | None:
    """A D's requests still to pull; None when either gauge is missing."""
    start, going = _value(waiting_to_start), _value(in_progress)
    return None if start is None or going is None else start + going


def pending_total(per_d: Iterable[float | None]) -> float | None:
    """The up Ds' requests still to pull, all together; None when any D's is unknown."""
    total = 0.0
    for v in map(_value, per_d):
        if v is None:
            return None
        total += v
    return total


def holds_while_idle(
    up: bool | None, usage: float | None, running: float | None, waiting: float | None, floor: float = 0.0
) -> bool:
    """An up instance with nothing running or waiting that holds KV: its cache usage over ``floor``."""
    held = _value(usage)
    return bool(up) and held is not None and held > floor and running == 0 and waiting == 0
