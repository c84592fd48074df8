"""Helpers of the leadership tests: a lock held in the test's hand, collector writes without a tick,
and what the store holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select

from store.db import transaction
from store.models import AuditEvent, Decision, WeightOverride
from tests.controller.conftest import World
from tests.controller.seed import all_pairs


@dataclass
class HandLock:
    """One lock two contenders share; the test takes it away (``owner = None``) as a lost session would."""

    owner: str | None = None


class HandLeadership:
    def __init__(self, lock: HandLock, holder: str) -> None:
        self.lock = lock
        self.holder = holder

    def acquire(self) -> bool:
        if self.lock.owner in (None, self.holder):
            self.lock.owner = self.holder
            return True
        return False

    def held(self) -> bool:
        return self.lock.owner == self.holder

    def release(self) -> None:
        if self.lock.owner == self.holder:
            self.lock.owner = None


def feed(world: World, **kw: Any) -> None:
    """2 s of collector writes (one scrape, one request per pair), no tick."""
    now = world.clock.advance(2.0)
    world.seeder.scrape(now - 0.5, **kw.pop("scrape", {}))
    world.seeder.requests(now - 1.9, all_pairs(), **kw)


def decisions(world: World) -> list[tuple[int, int | None]]:
    """``(id, leader_epoch)`` of every stored decision, oldest first."""
    with transaction(world.factory) as s:
        return [(d.id, d.leader_epoch) for d in s.scalars(select(Decision).order_by(Decision.id))]


def writes(world: World) -> tuple[int, int, int]:
    """How many decisions, overrides and audit events are stored."""
    with transaction(world.factory) as s:
        return (
            s.scalar(select(func.count()).select_from(Decision)) or 0,
            s.scalar(select(func.count()).select_from(WeightOverride)) or 0,
            s.scalar(select(func.count()).select_from(AuditEvent)) or 0,
        )


def served(table: Any) -> dict[str, tuple[float, bool]]:
    """A routing table's instances as ``name -> (weight, drained)``."""
    return {i.name: (i.weight, i.drained) for i in table.instances}
