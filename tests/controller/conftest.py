from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from controller.loop import Reconciler
from controller.policy import AlertConfig
from controller.wiring import default_effects
from pdscope.config import Settings
from store.db import make_engine, session_factory
from store.migrate import upgrade
from tests.controller.replay import VirtualClock
from tests.controller.seed import Seeder, all_pairs, settings_yaml


class RecordingNotifier:
    def __init__(self) -> None:
        self.batches: list[list[Any]] = []
        self.sent = self.failed = self.dropped = 0

    def send(self, alerts: Any) -> None:
        if alerts:
            self.batches.append(list(alerts))
            self.sent += 1

    def close(self, timeout: float = 2.0) -> None:
        return None


@dataclass
class World:
    """A seeded store, a virtual clock and a reconciler reading that store."""

    settings: Settings
    factory: sessionmaker[Session]
    clock: VirtualClock
    seeder: Seeder
    reconciler: Reconciler
    notifier: RecordingNotifier

    def step(
        self,
        *,
        scrape: dict[str, Any] | None = None,
        handoff_s: dict[str, float] | None = None,
        prefill_s: dict[str, float] | None = None,
        suspect: set[str] | None = None,
        tick: bool = True,
        requests: bool = True,
    ) -> Any:
        """Advance 2 s: one scrape, one request per P x D pair, one tick."""
        now = self.clock.advance(2.0)
        self.seeder.scrape(now - 0.5, **(scrape or {}))
        if requests:
            self.seeder.requests(
                now - 1.9, all_pairs(), handoff_s=handoff_s, prefill_s=prefill_s, suspect=suspect
            )
        return self.reconciler.tick() if tick else None

    def weight(self, name: str) -> float:
        return next(i.weight for i in self.reconciler.table.instances if i.name == name)


@pytest.fixture
def world(store_url: str) -> Iterator[World]:
    upgrade(store_url)
    engine = make_engine(store_url)
    factory = session_factory(engine)
    settings = settings_yaml(store_url)
    clock = VirtualClock()
    notifier = RecordingNotifier()
    rec = Reconciler(
        settings,
        factory,
        effects=default_effects(settings, factory, clock=clock, notifier=notifier),
        clock=clock,
        alert_config=AlertConfig(for_s={"KVLeaseExpired": 0.0, "InstanceDown": 4.0}),
    )
    yield World(settings, factory, clock, Seeder(factory, settings), rec, notifier)
    engine.dispose()
