"""What the controller serves between two ticks: the table recomposed after each operator change.

An operator's change (an instance weight override set, replaced or cleared, a drain or undrain, a
pool weight override) is served at once: the controller recomposes the routing table from the
carried policy state and the overrides in the store then, without a policy step (a
:class:`Refresh`). The next tick starts from that table and from what it served, so a replay must
apply the same refreshes, in order, to re-derive it: a drain and an undrain between two ticks leave
the same content but two new routing versions, and a change that began and ended between two ticks
is never seen by a tick's overrides at all.

:func:`recompose` is the one rule both sides follow: ``controller.loop`` calls it to serve, and
``controller.policy.replay`` to re-derive. :class:`Between` is what the tick record keeps of them,
bounded (an API client can change overrides faster than a tick: past :data:`MAX_REFRESHES` the
oldest are dropped and counted, and a replay then takes the run's table as recorded).

Pure: no I/O, no clock (``Refresh.now`` is the time the controller read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from controller.policy.routes import InstanceSpec, Override, PoolSpec, ServedInstance
from controller.policy.tick import PolicyState, TickOutput, compose
from pdscope.routing import RoutingTable

MAX_REFRESHES = 64  # refreshes kept per tick record; an operator acts a few times between ticks


@dataclass(frozen=True)
class Refresh:
    """The table recomposed at ``now`` with ``overrides`` (the active ones in the store then)."""

    now: float
    overrides: tuple[Override, ...] = ()


@dataclass(frozen=True)
class Between:
    """The refreshes since the tick before, oldest first; ``dropped``: how many older ones were not kept."""

    refreshes: tuple[Refresh, ...] = ()
    dropped: int = 0

    def add(self, r: Refresh, limit: int = MAX_REFRESHES) -> Between:
        """These refreshes and ``r``, keeping the newest ``limit`` and counting the rest."""
        kept = (*self.refreshes, r)
        over = max(0, len(kept) - limit)
        return Between(kept[over:], self.dropped + over)


NOTHING_BETWEEN = Between()  # no refresh since the tick before


def recompose(
    state: PolicyState,
    last: TickOutput | None,
    r: Refresh,
    instances: tuple[InstanceSpec, ...],
    pools: tuple[PoolSpec, ...],
    mode: Literal["advisory", "enforce"],
) -> tuple[RoutingTable, dict[str, ServedInstance]]:
    """The table and the served weights after ``r``, from the carried ``state`` and ``last``, this
    process's last tick (its reasons label the policy's weights and limits; None: no tick yet)."""
    reasons = {} if last is None else {d.instance: d.reason for d in last.weights}
    limit_reasons = {} if last is None else {d.pool: d.reason for d in last.pools}
    table, served, _ = compose(state, r.overrides, instances, pools, mode, r.now, reasons, limit_reasons)
    return table, served
