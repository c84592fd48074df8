"""Outlier detection: the one home of "recent failures of an instance" in the proxy.

In the manner of Envoy's outlier detection, per instance:

- ``consecutive_failures`` failures in a row, or a failed share of at least
  ``failure_ratio`` among the results of the last ``window_s`` (once there are
  ``min_requests`` of them), **eject** the instance: selection skips it (unless nothing
  else is left: the proxy never stops serving).
- The ejection lasts ``base_ejection_s``, doubled for each successive ejection, capped at
  ``max_ejection_s``. An instance that then stays in for ``max_ejection_s`` starts again
  from the base period.
- After its period an instance returns *on probation*: its window starts empty, and its
  first failure before ``consecutive_failures`` successes ejects it again at once.
- At most ``max_ejected_share`` of a pool's instances are ejected at once (at least one,
  never the last one; ``0`` ejects nothing). A pool here is a config pool.

What is a failure is the caller's call (``proxy.attempts``): connect errors, 5xx, timeouts,
D's stream errors before or after the first token, a stream without ``[DONE]``. A 4xx the
client caused (429 included) is neither a failure nor a success.

Selection also reads the :meth:`OutlierDetector.penalties`: an instance with recent
failures is weighed by ``(1 - failed / (results + 2)) ** failure_penalty`` in the
power-of-two choice, so failing fast does not win it traffic. The map only holds
instances with failures in the window, so a healthy fleet costs selection nothing.

Pure: no I/O, the clock is passed in. O(1) per result (a ring of five buckets).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pdscope.config import OutlierSettings

REASON_CONSECUTIVE = "consecutive_failures"
REASON_RATIO = "failure_ratio"
REASON_PROBATION = "probation"
REASONS = (REASON_CONSECUTIVE, REASON_RATIO, REASON_PROBATION)

_BUCKETS = 5
_PRIOR = 2.0  # successes assumed in every window, so one failure of one is not a 100% ratio


class _Instance:
    __slots__ = (
        "consecutive",
        "ejections",
        "epochs",
        "failed",
        "level",
        "pool",
        "probation",
        "reason",
        "returned_at",
        "total",
        "until",
    )

    def __init__(self, pool: str) -> None:
        self.pool = pool
        self.consecutive = 0
        self.epochs = [-1] * _BUCKETS
        self.total = [0] * _BUCKETS
        self.failed = [0] * _BUCKETS
        self.until = 0.0  # > 0: ejected until then
        self.reason = ""
        self.level = 0  # successive ejections
        self.returned_at = 0.0
        self.probation = 0  # successes still needed after a return
        self.ejections = 0

    def reset_window(self) -> None:
        for i in range(_BUCKETS):
            self.epochs[i] = -1
            self.total[i] = 0
            self.failed[i] = 0
        self.consecutive = 0


@dataclass(frozen=True, slots=True)
class Ejection:
    """What /healthz shows for an ejected instance."""

    instance: str
    pool: str
    reason: str
    remaining_s: float
    ejections: int


class OutlierDetector:
    def __init__(self, settings: OutlierSettings, pools: Mapping[str, Iterable[str]] | None = None) -> None:
        self.s = settings
        self._bucket_s = settings.window_s / _BUCKETS
        self._state: dict[str, _Instance] = {}
        self._members: dict[str, set[str]] = {}
        self._ejected: dict[str, _Instance] = {}
        self._penalty: dict[str, float] = {}
        self._next_refresh = 0.0
        self.ejections: Counter[tuple[str, str]] = Counter()  # (instance, reason) -> times
        for pool, names in (pools or {}).items():
            for name in names:
                self._get(name, pool)

    # -- results ----------------------------------------------------------------------

    def success(self, name: str, pool: str, now: float) -> None:
        st = self._get(name, pool)
        if st.until:
            if now < st.until:
                return  # a late result of a request sent before the ejection
            self._return(name, st, now)
        st.consecutive = 0
        i = self._bucket(st, now)
        st.total[i] += 1
        if st.probation:
            st.probation -= 1
        if name in self._penalty:
            self._set_penalty(name, st, now)

    def failure(self, name: str, pool: str, now: float) -> str | None:
        """Count a failure; returns the reason when it ejected the instance."""
        st = self._get(name, pool)
        if st.until and now < st.until:
            return None  # already out: a late result of a request sent before
        if st.until:
            self._return(name, st, now)
        st.consecutive += 1
        i = self._bucket(st, now)
        st.total[i] += 1
        st.failed[i] += 1
        total, failed = self._sums(st, now)
        reason = None
        if st.probation:
            reason = REASON_PROBATION
        elif st.consecutive >= self.s.consecutive_failures:
            reason = REASON_CONSECUTIVE
        elif total >= self.s.min_requests and failed >= self.s.failure_ratio * total:
            reason = REASON_RATIO
        if reason is not None and self._may_eject(st.pool, now):
            self._eject(name, st, reason, now)
            return reason
        self._set_penalty(name, st, now, total, failed)
        return None

    # -- what selection reads -----------------------------------------------------------

    @property
    def any_ejected(self) -> bool:
        return bool(self._ejected)

    def is_ejected(self, name: str, now: float) -> bool:
        st = self._ejected.get(name)
        if st is None:
            return False
        if now < st.until:
            return True
        self._return(name, st, now)
        return False

    def penalties(self, now: float) -> dict[str, float]:
        """Instance -> selection factor in (0, 1), only for instances with failures in the window."""
        if self._penalty and now >= self._next_refresh:
            self._next_refresh = now + self._bucket_s
            for name in list(self._penalty):
                self._set_penalty(name, self._state[name], now)
        return self._penalty

    def failure_ratio(self, name: str, now: float) -> float:
        st = self._state.get(name)
        if st is None:
            return 0.0
        total, failed = self._sums(st, now)
        return failed / total if total else 0.0

    def recent(self, name: str, now: float) -> tuple[int, int]:
        """(results, failures) of ``name`` in the window."""
        st = self._state.get(name)
        return (0, 0) if st is None else self._sums(st, now)

    def ejected(self, now: float) -> list[Ejection]:
        out = []
        for name in sorted(self._ejected):
            if self.is_ejected(name, now):
                st = self._ejected[name]
                out.append(Ejection(name, st.pool, st.reason, round(st.until - now, 3), st.ejections))
        return out

    def instances(self) -> list[str]:
        return sorted(self._state)

    # -- inside -------------------------------------------------------------------------

    def _get(self, name: str, pool: str) -> _Instance:
        st = self._state.get(name)
        if st is None:
            st = self._state[name] = _Instance(pool)
            self._members.setdefault(pool, set()).add(name)
        return st

    def _bucket(self, st: _Instance, now: float) -> int:
        epoch = int(now // self._bucket_s)
        i = epoch % _BUCKETS
        if st.epochs[i] != epoch:
            st.epochs[i] = epoch
            st.total[i] = 0
            st.failed[i] = 0
        return i

    def _sums(self, st: _Instance, now: float) -> tuple[int, int]:
        epoch = int(now // self._bucket_s)
        total = failed = 0
        for i in range(_BUCKETS):
            if 0 <= epoch - st.epochs[i] < _BUCKETS:
                total += st.total[i]
                failed += st.failed[i]
        return total, failed

    def _set_penalty(self, name: str, st: _Instance, now: float, total: int = -1, failed: int = 0) -> None:
        if total < 0:
            total, failed = self._sums(st, now)
        if failed == 0 or self.s.failure_penalty == 0:
            self._penalty.pop(name, None)
            return
        self._penalty[name] = (1.0 - failed / (total + _PRIOR)) ** self.s.failure_penalty

    def _may_eject(self, pool: str, now: float) -> bool:
        share = self.s.max_ejected_share
        if share <= 0:
            return False
        n = len(self._members.get(pool, ()))
        allowed = min(n - 1, max(1, int(share * n + 1e-9)))
        out = sum(
            1 for name, st in list(self._ejected.items()) if st.pool == pool and self.is_ejected(name, now)
        )
        return out < allowed

    def _eject(self, name: str, st: _Instance, reason: str, now: float) -> None:
        if st.level and st.returned_at and now - st.returned_at >= self.s.max_ejection_s:
            st.level = 0  # stayed in a full max period since its last return: not successive
        st.level += 1
        period = min(self.s.base_ejection_s * 2.0 ** min(st.level - 1, 30), self.s.max_ejection_s)
        st.until = now + period
        st.reason = reason
        st.ejections += 1
        st.probation = 0
        st.reset_window()
        self._ejected[name] = st
        self._penalty.pop(name, None)
        self.ejections[(name, reason)] += 1

    def _return(self, name: str, st: _Instance, now: float) -> None:
        st.until = 0.0
        st.returned_at = now
        st.probation = self.s.consecutive_failures
        st.reset_window()
        self._ejected.pop(name, None)
