"""Replay on the dashboard's seed data: a real controller run over the seeded fleet (its D degrading
half-way) is reproduced exactly by the stored config, and a candidate parts where the D is cut."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import func, select

from controller.loop import Reconciler
from controller.replay import Candidate, replay_window
from controller.wiring import default_effects
from devdata.seed import SeedSpec, fleet_config_yaml, seed_store
from pdscope.config import parse_config
from store.db import make_engine, session_factory, transaction
from store.models import Decision
from tests.controller.conftest import RecordingNotifier
from tests.controller.replay import T0, VirtualClock

pytestmark = pytest.mark.slow  # ~15 s: 240 ticks of a real controller over the seeded store


def test_a_controller_run_over_the_seed_is_replayed_exactly(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'seed.db'}"
    spec = SeedSpec(end=T0, duration_s=600.0, degrade_at=0.5, controller_history=False, cache_clear=None)
    seed_store(url, spec)
    settings = parse_config(fleet_config_yaml(spec, url), "seed.yaml")
    engine = make_engine(url)
    factory = session_factory(engine)
    start = T0 - spec.duration_s
    clock = VirtualClock(start + 120.0)
    rec = Reconciler(
        settings,
        factory,
        effects=default_effects(settings, factory, clock=clock, notifier=RecordingNotifier()),
        clock=clock,
    )
    while clock.now < T0 - 60.0:  # through the degradation at half-way and two minutes past it
        rec.tick()
        clock.advance(settings.controller.interval_s)
    with transaction(factory) as s:
        cuts = s.scalars(
            select(Decision).where(Decision.subject == spec.degraded, Decision.field == "weight")
        ).all()
        decisions = s.scalar(select(func.count()).select_from(Decision))
        result = replay_window(s, start, T0)
        gentle = replay_window(s, start, T0, Candidate(changes={"max_weight_step": 0.05}))
    engine.dispose()
    assert cuts and min(d.new_value or 1.0 for d in cuts) < 1.0, "the seeded degradation is cut"
    assert result.ticks > 100 and result.reproduced is True, result.mismatches[:3]
    assert sum(a for a, _ in result.decisions.values()) == decisions
    first = gentle.first_divergence
    assert first is not None and first.subject == spec.degraded, gentle.divergences[:3]
