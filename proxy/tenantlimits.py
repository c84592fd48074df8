"""Each tenant's rate limit and token quota: token buckets, checked when a request arrives.

``rate_rps`` (a bucket of ``burst`` requests, default one second of the rate, at least 1) refuses
past it with 429 ``tenant_rate``; ``tokens_per_min`` (a bucket of a minute's tokens, refilled
evenly) refuses a request whose prompt tokens and ``max_tokens`` it cannot hold with 429
``tenant_quota``. Each answer says when to come back (``Retry-After``: when the bucket will hold
the request again; a request larger than a whole minute's quota: a minute). A request refused by
either takes nothing from the other; one refused later (admission) keeps what it took.

**Several proxies.** Each proxy's buckets are the tenant's figures times its scale here
(:meth:`TenantLimits.scale`: this proxy's fraction of the tenant's demand, from the controller, the
same scale its weight takes), so the proxies together hold the tenant to its whole figure: three
proxies sharing a tenant's traffic evenly each allow a third of its rate. A bucket never holds
less than one request (a burst of at least 1), so a proxy a tenant's traffic moves to admits some
while the controller's share catches up. No answer from a controller: scale 1, each proxy enforces
the whole figure (open, as before apportioning). Pure: the clock is passed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pdscope.config.tenants import TenantSettings

REASON_TENANT_RATE = "tenant_rate"
REASON_TENANT_QUOTA = "tenant_quota"
MINUTE_S = 60.0


class Bucket:
    """``capacity`` units, refilled at ``rate`` units a second; it starts full. A request of more than
    ``capacity`` but at most ``most`` (the unscaled figure) goes when the bucket is full, and leaves it
    in debt: a proxy with a small share of a tenant's quota still passes its largest requests, in time."""

    __slots__ = ("at", "capacity", "level", "most", "rate")

    def __init__(self, capacity: float, rate: float, now: float, most: float | None = None) -> None:
        self.capacity, self.rate = capacity, rate
        self.most = capacity if most is None else max(most, capacity)
        self.level, self.at = capacity, now

    def _refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = max(self.at, now)

    def short_s(self, n: float, now: float) -> float:
        """Seconds until ``n`` units may go (0: now; a minute for more than ``most``, which never may)."""
        self._refill(now)
        if n > self.most:
            return MINUTE_S
        need = min(n, self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, n: float) -> None:
        self.level -= n

    def resize(self, capacity: float, rate: float, now: float) -> None:
        """New figures from now: what is in the bucket carries over, capped at the new capacity."""
        self._refill(now)
        self.capacity, self.rate = capacity, rate
        self.most = max(self.most, capacity)
        self.level = min(self.level, capacity)


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: str
    retry_after_s: float


class TenantLimits:
    def __init__(self, ts: TenantSettings, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.ts = ts
        self.rates: dict[str, Bucket] = {}
        self.quotas: dict[str, Bucket] = {}
        self.scales: dict[str, float] = {}
        self.scale({})

    def scale(self, scales: Mapping[str, float]) -> None:
        """Each tenant's figures times its scale here (missing, not finite or not positive: 1; at most 1)."""
        now = self.clock()
        for name, t in self.ts.tenants.items():
            s = scales.get(name, 1.0)
            k = min(1.0, s) if math.isfinite(s) and s > 0 else 1.0
            self.scales[name] = k
            if t.rate_rps is not None:
                burst = t.burst if t.burst is not None else max(1, math.ceil(t.rate_rps))
                self._set(self.rates, name, (max(1.0, burst * k), t.rate_rps * k, burst), now)
            if t.tokens_per_min is not None:
                q = float(t.tokens_per_min)
                self._set(self.quotas, name, (q * k, q * k / MINUTE_S, q), now)

    @staticmethod
    def _set(buckets: dict[str, Bucket], name: str, figures: tuple[float, float, float], now: float) -> None:
        """``figures``: (capacity, rate, the largest request ever: the unscaled capacity)."""
        capacity, rate, most = figures
        if (b := buckets.get(name)) is None:
            buckets[name] = Bucket(capacity, rate, now, most)
        else:
            b.resize(capacity, rate, now)

    def check(self, tenant: str, tokens: int) -> Refusal | None:
        """Take one request of ``tokens`` (prompt + max_tokens) from ``tenant``'s buckets, or why not."""
        now = self.clock()
        rate, quota = self.rates.get(tenant), self.quotas.get(tenant)
        if rate is not None and (wait := rate.short_s(1, now)) > 0:
            return Refusal(REASON_TENANT_RATE, wait)
        if quota is not None and (wait := quota.short_s(tokens, now)) > 0:
            return Refusal(REASON_TENANT_QUOTA, wait)
        if rate is not None:
            rate.take(1)
        if quota is not None:
            quota.take(tokens)
        return None
