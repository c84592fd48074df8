"""Choosing an instance: weighted power-of-two-choices on local in-flight load, or round-robin.

``weighted`` draws two distinct candidates in proportion to their routing weight and
keeps the one with the lower ``in_flight / weight`` (the first drawn on a tie); instances that failed within
``failure_cooldown_s`` are skipped unless nothing else is left (never stop serving).
``round-robin`` cycles through the instances in order, like vLLM's toy proxy, and
ignores weights and load (it still honours drains and exclusions), for baselines.

Pure apart from the injected random source; the clock is passed in. The proxy picks P
and D jointly by calling :meth:`Selector.pick` for each role with the pools admission
allows (see ``proxy.flow``). Also here: :class:`RetryBudget`.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from typing import Literal

from proxy.routing import Target

Policy = Literal["weighted", "round-robin"]


class Selector:
    """Per-instance in-flight counts and failure marks, and the pick itself."""

    def __init__(self, policy: Policy, cooldown_s: float, rng: random.Random | None = None) -> None:
        self.policy = policy
        self.cooldown_s = cooldown_s
        self.rng = rng or random.Random()
        self.inflight: dict[str, int] = {}
        self.failed_until: dict[str, float] = {}
        self._rr: dict[str, int] = {}

    # -- load and health bookkeeping --------------------------------------------------

    def acquire(self, name: str) -> None:
        self.inflight[name] = self.inflight.get(name, 0) + 1

    def release(self, name: str) -> None:
        self.inflight[name] = self.inflight.get(name, 1) - 1

    def mark_failed(self, name: str, now: float) -> None:
        self.failed_until[name] = now + self.cooldown_s

    def cooling(self, name: str, now: float) -> bool:
        until = self.failed_until.get(name)
        if until is None:
            return False
        if now >= until:
            del self.failed_until[name]
            return False
        return True

    # -- the pick ---------------------------------------------------------------------

    def pick(
        self,
        role: str,
        targets: Sequence[Target],
        now: float,
        exclude: Collection[str] = (),
        pools: Collection[str] | None = None,
    ) -> Target | None:
        """One target of ``role`` not in ``exclude`` and (when given) in ``pools``, or None."""
        allowed = [
            t for t in targets if t.name not in exclude and (pools is None or t.pool in pools)
        ]
        if not allowed:
            return None
        healthy = [t for t in allowed if not self.cooling(t.name, now)]
        candidates = healthy or allowed
        if self.policy == "round-robin":
            return self._round_robin(role, targets, candidates)
        if len(candidates) == 1:
            return candidates[0]
        first, second = self._two_by_weight(candidates)
        load = self.inflight
        # Strictly less: when both are equally loaded (e.g. idle) the weighted draw decides,
        # so traffic shares follow the weights at low load and load evens out at high load.
        if load.get(second.name, 0) / second.weight < load.get(first.name, 0) / first.weight:
            return second
        return first

    def _two_by_weight(self, candidates: list[Target]) -> tuple[Target, Target]:
        total = 0.0
        for t in candidates:
            total += t.weight
        first_i = self._draw(candidates, total, -1)
        second_i = self._draw(candidates, total - candidates[first_i].weight, first_i)
        return candidates[first_i], candidates[second_i]

    def _draw(self, candidates: list[Target], total: float, skip: int) -> int:
        x = self.rng.random() * total
        last = -1
        for i, t in enumerate(candidates):
            if i == skip:
                continue
            last = i
            x -= t.weight
            if x < 0:
                return i
        return last

    def _round_robin(self, role: str, targets: Sequence[Target], candidates: list[Target]) -> Target:
        # Advance over the full list so the cycle order does not depend on exclusions.
        n = len(targets)
        start = self._rr.get(role, 0)
        names = {t.name for t in candidates}
        for step in range(n):
            t = targets[(start + step) % n]
            if t.name in names:
                self._rr[role] = (start + step + 1) % n
                return t
        return candidates[0]


class RetryBudget:
    """Retries as a bounded share of requests: each request earns ``ratio`` of a retry.

    The balance starts at ``reserve`` (so a quiet proxy can still retry) and never holds
    more than ``reserve + ratio * window`` retries, so a failing pool cannot double the
    load: over ``N`` requests at most ``reserve + ratio * N`` retries happen.
    """

    def __init__(self, ratio: float, reserve: float = 5.0, window: int = 100) -> None:
        self.ratio = ratio
        self.cap = reserve + ratio * window
        self.balance = reserve
        self.spent = 0
        self.refused = 0

    def on_request(self) -> None:
        balance = self.balance + self.ratio
        self.balance = balance if balance < self.cap else self.cap

    def try_spend(self) -> bool:
        if self.balance >= 1.0:
            self.balance -= 1.0
            self.spent += 1
            return True
        self.refused += 1
        return False
