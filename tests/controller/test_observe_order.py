"""The order of observe's reads makes a collector round that commits between them harmless.

The collector stores a restarted P's first up scrape and its ``restarted_at`` in one transaction. A tick
reads the snapshots and the restarts in two statements; that round can commit between them. Read
snapshots-then-restarts, the tick sees P down and restarted: a fresh P either way, so D's failed pulls
during P's outage are not charged to D (``controller.policy.stale``). The other order saw P up and not
restarted, and D was cut for the outage's failed transfers (a real-vLLM CI run, stop 45).
"""

from __future__ import annotations

from typing import Any

import pytest

from controller import observe as observe_mod
from tests.controller.conftest import World


def test_the_snapshots_are_read_before_the_restarts(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    real_snaps, real_restarts = observe_mod._snapshots, observe_mod._restarts

    def snaps(*a: Any, **k: Any) -> Any:
        order.append("snapshots")
        return real_snaps(*a, **k)

    def restarts(*a: Any, **k: Any) -> Any:
        order.append("restarts")
        return real_restarts(*a, **k)

    monkeypatch.setattr(observe_mod, "_snapshots", snaps)
    monkeypatch.setattr(observe_mod, "_restarts", restarts)
    world.step()
    assert order[:2] == ["snapshots", "restarts"], order


def test_a_restart_committed_between_the_reads_reads_as_a_fresh_p(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The collector's round (P's restart) commits right after the tick's first read: the observation has
    P either down or restarted, never up without its restart."""
    from store.models import InstanceRow

    world.step()
    world.step()
    p = next(
        n
        for n, role in ((i.name, world.settings.pools[pool].role) for pool, i in world.settings.instances())
        if role == "prefill"
    )
    real = observe_mod._snapshots
    committed: list[float] = []

    def snaps_then_restart(*a: Any, **k: Any) -> Any:
        out = real(*a, **k)
        if not committed:
            at = world.clock() - 0.1
            with world.factory() as s, s.begin():  # the collector's round: P's row with its restart
                s.add(
                    InstanceRow(
                        name=p,
                        pool="prefill",
                        role="prefill",
                        url="http://p",
                        labels={},
                        first_seen=at,
                        last_seen=at,
                        restarted_at=at,
                    )
                )
            committed.append(at)
        return out

    monkeypatch.setattr(observe_mod, "_snapshots", snaps_then_restart)
    world.step()
    obs = world.reconciler.view().obs
    assert obs is not None and committed
    [seen] = [i for i in obs.instances if i.name == p]
    assert seen.restarted_at == committed[0]  # read after the round that committed between the reads
