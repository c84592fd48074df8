"""Fixtures for the dashboard tests: a seeded store with its config, and the fake controller
API (tests.support.controllers) served on a free port, recording every request."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from devdata.seed import SeedSpec, SeedSummary, fleet_config_yaml, seed_store
from tests.dashboard.browser import Browser, chromium_path
from tests.support.controllers import FakeController
from tests.support.serving import serve_in_thread

APP = Path(__file__).resolve().parents[2] / "dashboard" / "app.py"
TOKEN = "test-token-123"
USER_TOKEN = "carol-token-456"  # a user's own controller API token (identity "carol")


@dataclass
class Seeded:
    url: str
    config: Path
    summary: SeedSummary
    spec: SeedSpec


def make_seeded(tmp: Path, controller_port: int = 1, **spec_kw: Any) -> Seeded:
    spec = SeedSpec(end=time.time(), **spec_kw)
    url = f"sqlite:///{tmp / 'store.db'}"
    summary = seed_store(url, spec)
    config = tmp / "pdscope.yaml"
    config.write_text(fleet_config_yaml(spec, url, controller_port=controller_port))
    return Seeded(url, config, summary, spec)


@pytest.fixture(scope="session")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Seeded:
    """A 30-minute history of a 2P+3D fleet (one D degrades), ending now; read-only for tests."""
    return make_seeded(tmp_path_factory.mktemp("seeded"))


@pytest.fixture
def fake_controller() -> Iterator[FakeController]:
    """A fake controller API on a free port (in a thread: AppTest runs the page synchronously)
    that knows the two test tokens and serves a one-instance routing table."""
    ctl = FakeController(
        {
            "version": 42,
            "generated_at": time.time(),
            "mode": "advisory",
            "enforce": False,
            "pools": [],
            "instances": [
                {
                    "name": "decode-2",
                    "pool": "decode",
                    "role": "decode",
                    "url": "http://x",
                    "weight": 0.25,
                    "drained": False,
                    "reason": "NixlSlowTransfers",
                }
            ],
        },
        identities={TOKEN: "api", USER_TOKEN: "carol"},  # as the controller's api_tokens_env
    )
    with serve_in_thread(ctl.app()) as url:
        ctl.url = url
        yield ctl


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    """A headless Chromium for the ``browser`` tier (skipped, saying why, without one)."""
    if chromium_path() is None:
        pytest.skip("browser tier skipped: no chromium on PATH (apt-get install chromium)")
    with Browser(tmp_path_factory.mktemp("chromium-profile")) as b:
        yield b
