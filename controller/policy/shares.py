"""How every pool's limits are split among the live proxies (pure: no I/O, the clock passed in).

Several proxies admit into the same pools. Each enforces its own part of a pool's
``max_inflight_requests`` and ``max_inflight_kv_bytes``, so that together they hold the
pool's limit, not one limit each. A proxy's part follows its share of the pool's recent
demand (requests that sought admission into the pool, admitted or not: admissions alone
would shrink a starved proxy's share further), with a floor split equally so an idle proxy
can still admit:

    share_i = floor / n + (1 - floor) * rate_i / sum(rate)        (equal when no proxy has demand)

``rate`` is each proxy's demand smoothed with time constant ``window_s`` from the counters it
reports on every poll (:func:`smoothed_rate`). A proxy seen for the first time starts at the
mean rate of the others: a load balancer spreads new traffic evenly, so it needs its fair
part at once, not after a window. The integer limits are apportioned (:func:`apportion`): one
slot for every proxy first, so an idle one can admit, the rest by largest remainder, so they
add up to the pool's limit exactly (only a limit below the number of live proxies is exceeded:
each still gets one).

Parts are worked out at each proxy's own poll, from rates that move between polls, so targets
alone would not add up at any one moment: a proxy whose target grew could be granted it while
the others still hold larger parts granted earlier. So a part is granted only within the room
the others leave (:func:`within_room`): the pool's limit minus what each other live proxy holds,
its last part or, when more, what it still has in flight (it admitted under a larger part and
has not drained). The granted parts, and the admissions under them, never add up past the
limit; a part that must grow waits until the others have polled and shrunk (one poll period).

What moves the shares: a new proxy takes its part from the others at their next polls (it may
get less, even nothing, until they have); a dead one (no poll for ``controller.proxy_ttl_s``)
leaves the live set and its part goes to the others at theirs; a controller restart changes
nothing, because the rates and the granted parts live in the store.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def smoothed_rate(
    prev_rate: float,
    prev_total: int | None,
    prev_ts: float | None,
    total: int,
    now: float,
    window_s: float,
) -> float:
    """The demand rate (per second) after a report of ``total`` at ``now``.

    ``prev_rate`` is the smoothed rate at ``prev_ts`` (for a first report, the prior: the peers'
    mean). A counter below the last one (the proxy restarted) counts from zero. Without an
    earlier report, or with no time passed, the rate stays ``prev_rate``.
    """
    if prev_total is None or prev_ts is None or now <= prev_ts:
        return prev_rate
    delta = total - prev_total if total >= prev_total else total
    instant = delta / (now - prev_ts)
    alpha = 1.0 - math.exp(-(now - prev_ts) / window_s)
    return prev_rate + alpha * (instant - prev_rate)


def split(rates: Mapping[str, float], floor: float) -> dict[str, float]:
    """Each proxy's fraction of one pool (they add up to 1): ``floor`` equally, the rest by rate."""
    n = len(rates)
    if n == 0:
        return {}
    total = sum(max(0.0, r) for r in rates.values())
    if total <= 0.0:
        return {p: 1.0 / n for p in rates}
    return {p: floor / n + (1.0 - floor) * (max(0.0, r) / total) for p, r in rates.items()}


def apportion(limit: int, shares: Mapping[str, float]) -> dict[str, int]:
    """``limit`` in whole parts by ``shares``: one for each proxy first (so an idle one can admit), the
    rest by largest remainder (ties by id). The parts add up to ``limit`` when it is at least the
    number of proxies; below that each gets 1. A limit of 0 (a closed pool) gives 0 to all."""
    if not shares or limit <= 0:
        return {p: 0 for p in shares}
    n = len(shares)
    if limit <= n:
        return {p: 1 for p in shares}
    total = sum(shares.values())
    norm = {p: (s / total if total > 0 else 1.0 / n) for p, s in shares.items()}
    rest = limit - n
    exact = {p: rest * s for p, s in norm.items()}
    parts = {p: math.floor(x) for p, x in exact.items()}
    left = rest - sum(parts.values())
    for p in sorted(exact, key=lambda p: (-(exact[p] - parts[p]), p))[: max(0, left)]:
        parts[p] += 1
    return {p: k + 1 for p, k in parts.items()}


def prior_rate(peer_rates: list[float]) -> float:
    """The rate a proxy seen for the first time starts at: the mean of its live peers' (0 alone)."""
    return sum(peer_rates) / len(peer_rates) if peer_rates else 0.0


def within_room(target: int, limit: int, others_held: int) -> int:
    """The part granted: ``target``, but never more than the room the others leave in ``limit``."""
    return max(0, min(target, limit - others_held))
