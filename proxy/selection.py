"""Choosing an instance: weighted power-of-two-choices on local in-flight load, or round-robin.

``weighted`` draws two distinct candidates in proportion to their routing weight and
keeps the one with the lower ``in_flight / weight`` (the first drawn on a tie). An
instance with failures in the outlier window is weighed by its factor from
:meth:`proxy.outlier.OutlierDetector.penalties` in both the draw and the comparison
(``in_flight / (weight x factor)``), so failing fast, which keeps its in-flight count low,
does not win it traffic. Ejected instances (``proxy.outlier``) are skipped unless nothing
else is left (never stop serving).
``round-robin`` cycles through the instances in order, like vLLM's toy proxy, and
ignores weights, load and failure penalties (it still honours drains, exclusions and
ejections), for baselines.

Pure apart from the injected random source; the clock is passed in. The proxy picks P
and D jointly by calling :meth:`Selector.pick` for each role with the pools admission
allows (see ``proxy.gate``); with KV-aware routing on, the first pick is the cost model's
(``proxy.kvaware``) over :meth:`Selector.weighed` instead, and retries stay here. Also here:
:class:`RetryBudget`.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from typing import Literal

from pdscope.config import OutlierSettings
from proxy.outlier import OutlierDetector
from proxy.routing import Target

Policy = Literal["weighted", "round-robin"]


class Selector:
    """Per-instance in-flight counts, and the pick itself; failures live in :attr:`outliers`."""

    def __init__(
        self, policy: Policy, outliers: OutlierDetector | None = None, rng: random.Random | None = None
    ) -> None:
        self.policy = policy
        self.outliers = outliers or OutlierDetector(OutlierSettings())
        self.rng = rng or random.Random()
        self.inflight: dict[str, int] = {}
        self._rr: dict[str, int] = {}

    # -- load bookkeeping -------------------------------------------------------------

    def acquire(self, name: str) -> None:
        self.inflight[name] = self.inflight.get(name, 0) + 1

    def release(self, name: str) -> None:
        self.inflight[name] = self.inflight.get(name, 1) - 1

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
        candidates = self._eligible(targets, now, exclude, pools)
        if not candidates:
            return None
        out = self.outliers
        if self.policy == "round-robin":
            return self._round_robin(role, targets, candidates)
        if len(candidates) == 1:
            return candidates[0]
        penalty = out.penalties(now)
        # While some instance has failures in the window, weights are scaled by their factor.
        weights = (
            [t.weight * penalty.get(t.name, 1.0) for t in candidates]
            if penalty
            else [t.weight for t in candidates]
        )
        return self._two_choices(candidates, weights)

    def _eligible(
        self, targets: Sequence[Target], now: float, exclude: Collection[str], pools: Collection[str] | None
    ) -> list[Target]:
        """The targets a pick chooses among: not excluded, in ``pools``, not ejected (unless all are)."""
        candidates = [t for t in targets if t.name not in exclude and (pools is None or t.pool in pools)]
        out = self.outliers
        if candidates and out.any_ejected:
            healthy = [t for t in candidates if not out.is_ejected(t.name, now)]
            if healthy:
                candidates = healthy
        return candidates

    def weighed(
        self, targets: Sequence[Target], now: float, pools: Collection[str] | None = None
    ) -> list[tuple[Target, float]]:
        """The targets :meth:`pick` would choose among, each with the weight it would weigh it by
        (its routing weight times its failure factor): what the KV-aware cost model (``proxy.kvaware``)
        is given instead of a pick."""
        candidates = self._eligible(targets, now, (), pools)
        penalty = self.outliers.penalties(now) if candidates else {}
        return [(t, t.weight * penalty.get(t.name, 1.0)) for t in candidates]

    def _two_choices(self, candidates: list[Target], weights: list[float]) -> Target:
        """Power of two choices: two distinct draws by weight, the one with less in flight per weight."""
        total = sum(weights)
        i = self._draw(weights, total, -1)
        j = self._draw(weights, total - weights[i], i)
        load = self.inflight
        first, second = candidates[i], candidates[j]
        # Strictly less: when both are equally loaded (e.g. idle) the weighted draw decides,
        # so traffic shares follow the weights at low load and load evens out at high load.
        if load.get(second.name, 0) / weights[j] < load.get(first.name, 0) / weights[i]:
            return second
        return first

    def _draw(self, weights: list[float], total: float, skip: int) -> int:
        """An index drawn with probability proportional to its weight, ``skip`` left out."""
        x = self.rng.random() * total
        last = -1
        for i, w in enumerate(weights):
            if i == skip:
                continue
            last = i
            x -= w
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
