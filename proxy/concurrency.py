"""A local adaptive concurrency limit per pool (AIMD on the proxy's own TTFT).

The data plane protects goodput on its own, with or without a controller: each pool's
limit on admitted requests follows what the proxy itself observes of the requests it
admitted there, against the SLO's TTFT target:

- P pools: the prefill call's time (P answered, or timed out);
- D pools: the pair's time to first token, from admission (the proxy's own queue is not
  counted: a limit that makes requests wait must not tighten itself) to D's first byte.

Samples are counted per window (``window_s``, and at least ``min_samples``): the SLO
percentile ``p`` is over the target when more than ``(1 - p/100)`` of the samples are, and
comfortably under when no more than that share is over ``headroom x target``. A decrease
also needs two samples over the target (one straggler is not evidence).

- over target: multiplicative decrease, ``limit = max(min_limit, floor(base x decrease_factor))``
  where ``base`` is the lower of the limit and the peak in-flight seen in the window (so a
  limit far above the load does not take many windows to bite);
- comfortably under: additive increase, ``limit += increase``; once it reaches the ceiling
  the pool is free again (no adaptive limit: it follows the ceiling up and down);
- in between (noise within the target): unchanged.

The ceiling is the pool limit in force (the controller's last table, or the config's), and
the limit never goes above it. Pure: the clock is passed in; O(1) per sample, no allocation.
"""

from __future__ import annotations

import math

from pdscope.config import AdaptiveLimitSettings


class _Pool:
    __slots__ = ("ceiling", "n", "over", "peak", "warm", "window_end")

    def __init__(self, ceiling: int, window_end: float) -> None:
        self.ceiling = ceiling
        self.window_end = window_end
        self.n = 0
        self.over = 0  # samples over the target
        self.warm = 0  # samples over headroom x target, not over the target
        self.peak = 0  # most requests in flight seen in the window


class AdaptiveLimits:
    def __init__(self, settings: AdaptiveLimitSettings, target_s: float, percentile: float) -> None:
        self.s = settings
        self.target_s = target_s
        self.warm_s = target_s * settings.headroom
        self.allowed = 1.0 - percentile / 100.0  # share of samples that may be over
        self._pools: dict[str, _Pool] = {}
        # Pools with an adaptive limit below their ceiling: the only ones admission must check.
        self.reduced: dict[str, int] = {}
        self.decreases = 0
        self.increases = 0

    def observe(self, pool: str, seconds: float, inflight: int, ceiling: int, now: float) -> None:
        """One sample of ``pool``: ``seconds`` against the target, ``inflight`` requests admitted there
        now."""
        st = self._pools.get(pool)
        if st is None:
            st = self._pools[pool] = _Pool(ceiling, self._window_end(now))
        st.ceiling = ceiling
        st.n += 1
        if seconds > self.target_s:
            st.over += 1
        elif seconds > self.warm_s:
            st.warm += 1
        if inflight > st.peak:
            st.peak = inflight
        if now >= st.window_end and st.n >= self.s.min_samples:
            self._decide(pool, st, inflight, now)

    def limit(self, pool: str, ceiling: int) -> int:
        """The limit admission applies to ``pool`` now: never above ``ceiling``."""
        r = self.reduced.get(pool)
        return ceiling if r is None or r >= ceiling else r

    def _decide(self, pool: str, st: _Pool, inflight: int, now: float) -> None:
        allowed = self.allowed * st.n
        current = self.limit(pool, st.ceiling)
        if st.over > allowed and st.over >= 2:  # one straggler is not evidence
            base = min(current, max(st.peak, 1))
            new = max(self.s.min_limit, math.floor(base * self.s.decrease_factor))
            if new < st.ceiling:
                self.reduced[pool] = new
                self.decreases += 1
        elif st.over + st.warm <= allowed and pool in self.reduced:
            new = current + self.s.increase
            if new >= st.ceiling:
                del self.reduced[pool]
            else:
                self.reduced[pool] = new
            self.increases += 1
        st.n = st.over = st.warm = 0
        st.peak = inflight
        st.window_end = self._window_end(now)

    def _window_end(self, now: float) -> float:
        # Windows aligned on multiples of window_s (a decision at the first sample after the end).
        return (math.floor(now / self.s.window_s) + 1) * self.s.window_s
