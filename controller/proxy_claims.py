"""Bounds on what a proxy's report claims (pure: no I/O, no store, the figures passed in).

A report's ``inflight`` and ``demand`` move every other proxy's part (``controller.proxies``):
in-flight requests are room the others do not get, demand is the share of the split. The
controller cannot count either, so it clips each to what it can check:

- **in flight**, per pool: at most the part this id was last granted plus a margin
  (``max(INFLIGHT_MARGIN_MIN, INFLIGHT_MARGIN x part)``: admissions racing a shrinking part), or,
  when it was granted none yet, what a proxy without a part admits (the pool's limit divided by
  ``proxy.expected_replicas``) plus that margin; never below what it was last recorded holding (a
  proxy whose part shrank drains what it admitted under the larger one). Pools the controller does
  not know are dropped.
- **demand**, per pool: a counter, so its growth since the last report is at most
  ``DEMAND_PER_SLOT_S`` requests a second per request slot of the pool's limit (a request holding
  a slot for less than 100 ms, sustained, is not an LLM request).

Each clipped figure is counted by the caller.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

INFLIGHT_MARGIN = 0.1
INFLIGHT_MARGIN_MIN = 2
DEMAND_PER_SLOT_S = 10.0


def unshared_part(limit: int, expected_replicas: int) -> int:
    """What a proxy without a part admits of ``limit`` (as the proxy works it out: at least 1 of a
    limit above 0)."""
    return 0 if limit <= 0 else max(1, limit // max(1, expected_replicas))


def inflight_cap(last_part: int | None, last_inflight: int, unshared: int) -> int:
    """The most in-flight requests a report may claim in one pool."""
    base = unshared if last_part is None else last_part
    return max(base + max(INFLIGHT_MARGIN_MIN, math.ceil(base * INFLIGHT_MARGIN)), last_inflight)


def clip_inflight(reported: Mapping[str, int], caps: Mapping[str, int]) -> tuple[dict[str, int], int]:
    """``reported`` within ``caps`` (unknown pools dropped), and how many pools were clipped."""
    out: dict[str, int] = {}
    clipped = 0
    for pool, n in reported.items():
        if pool not in caps:
            continue
        out[pool] = min(n, caps[pool])
        clipped += n > caps[pool]
    return out, clipped


def clip_demand(total: int, prev_total: int | None, dt_s: float, limit: int) -> int:
    """A demand counter's report within the bound on its growth since ``prev_total`` (``dt_s`` ago).

    A first report (no ``prev_total``) is only the baseline: no rate is read from it, so it stands.
    A counter below the last one is a restart counting from 0, bounded the same way.
    """
    if prev_total is None:
        return total
    room = int(DEMAND_PER_SLOT_S * max(1, limit) * max(0.0, dt_s))
    base = prev_total if total >= prev_total else 0
    return min(total, base + room)
