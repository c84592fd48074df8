"""Each tenant's rate limit and token quota: token buckets, checked when a request arrives.

``rate_rps`` (a bucket of ``burst`` requests, default one second of the rate, at least 1) refuses
past it with 429 ``tenant_rate``; ``tokens_per_min`` (a bucket of a minute's tokens, refilled
evenly) refuses a request whose prompt tokens and ``max_tokens`` it cannot hold with 429
``tenant_quota``. Each answer says when to come back (``Retry-After``: when the bucket will hold
the request again; a request larger than a whole minute's quota: a minute). A request refused by
either takes nothing from the other; one refused later (admission) keeps what it took. Per proxy:
with several, each enforces the whole figure (the controller does not split these). Pure: the
clock is passed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from pdscope.config.tenants import TenantSettings

REASON_TENANT_RATE = "tenant_rate"
REASON_TENANT_QUOTA = "tenant_quota"
MINUTE_S = 60.0


class Bucket:
    """``capacity`` units, refilled at ``rate`` units a second; it starts full."""

    __slots__ = ("at", "capacity", "level", "rate")

    def __init__(self, capacity: float, rate: float, now: float) -> None:
        self.capacity, self.rate = capacity, rate
        self.level, self.at = capacity, now

    def _refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = max(self.at, now)

    def short_s(self, n: float, now: float) -> float:
        """Seconds until ``n`` units are there (0: now; a minute past what refills to more than capacity)."""
        self._refill(now)
        if n > self.capacity:
            return MINUTE_S
        return 0.0 if self.level >= n else (n - self.level) / self.rate

    def take(self, n: float) -> None:
        self.level -= n


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: str
    retry_after_s: float


class TenantLimits:
    def __init__(self, ts: TenantSettings, clock: Callable[[], float]) -> None:
        self.clock = clock
        now = clock()
        self.rates: dict[str, Bucket] = {}
        self.quotas: dict[str, Bucket] = {}
        for name, t in ts.tenants.items():
            if t.rate_rps is not None:
                burst = t.burst if t.burst is not None else max(1, math.ceil(t.rate_rps))
                self.rates[name] = Bucket(burst, t.rate_rps, now)
            if t.tokens_per_min is not None:
                self.quotas[name] = Bucket(t.tokens_per_min, t.tokens_per_min / MINUTE_S, now)

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
