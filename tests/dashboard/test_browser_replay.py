"""A real Chromium shows the Controller page's replay, side by side, from a real controller.

A real controller ran over the dashboard's seed data (its decode-2 degrading half-way: the seed's
own history left out), its API serves ``/v1/replay``; ``pdscope dashboard`` points at it and the
page, opened with ``?replay=max_weight_step=0.05``, draws the run beside the candidate.
With PDSCOPE_SAVE_SCREENSHOTS=1 the screenshot is written to docs/screenshots/controller_replay.png.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.api import create_app
from controller.loop import Reconciler
from controller.wiring import default_effects
from devdata.seed import SeedSpec, fleet_config_yaml, seed_store
from pdscope.config import parse_config
from store.db import make_engine, session_factory
from tests.controller.conftest import RecordingNotifier
from tests.controller.replay import VirtualClock
from tests.support.serving import serve_in_thread
from tests.support.sockets import bound_socket

from .browser import REPO, Browser, running_dashboard

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    tmp = tmp_path_factory.mktemp("replay")
    url = f"sqlite:///{tmp / 'store.db'}"
    spec = SeedSpec(
        end=time.time() - 60.0, duration_s=600.0, degrade_at=0.5, controller_history=False, cache_clear=None
    )
    seed_store(url, spec)
    sock = bound_socket()
    path = tmp / "pdscope.yaml"
    path.write_text(fleet_config_yaml(spec, url, controller_port=sock.getsockname()[1]))
    settings = parse_config(path.read_text(), str(path))
    engine = make_engine(url)
    clock = VirtualClock(spec.end - spec.duration_s + 120.0)
    factory = session_factory(engine)
    effects = default_effects(settings, factory, clock=clock, notifier=RecordingNotifier())
    rec = Reconciler(settings, factory, effects=effects, clock=clock)
    while clock.now < spec.end - 30.0:  # a real controller over the seeded window, ticking on its clock
        rec.tick()
        clock.advance(settings.controller.interval_s)
    try:
        with serve_in_thread(create_app(rec, token="t0ken"), sock=sock):
            yield path
    finally:
        engine.dispose()


def test_the_controller_page_draws_the_replay_beside_the_run(
    config: Path, browser: Browser, tmp_path: Path
) -> None:
    with running_dashboard(config, tmp_path / "dashboard.log") as base:
        shot = browser.shoot(
            f"{base}/controller?range=1h&live=0&replay=max_weight_step%3D0.05",
            timeout_s=180,
            scroll_to="Replay",
        )
    probe = shot.probe
    out = tmp_path / "controller_replay.png"
    out.write_bytes(shot.png)
    if os.environ.get("PDSCOPE_SAVE_SCREENSHOTS") == "1":
        shutil.copyfile(out, REPO / "docs" / "screenshots" / "controller_replay.png")
    assert probe["state"] == "notRunning" and probe["exceptions"] == 0, probe
    assert probe["title"] == "Controller" and probe["scrolled"] is True, probe
    assert "The candidate parts from the run on" in probe["text"], probe["text"][-1500:]
    assert "decode-2 served_weight" in probe["text"]
    assert probe["charts"] >= 2 and probe["drawn"] >= 2, probe
