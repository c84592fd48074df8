"""``pdscope replay``: reproduces a recorded run, compares a candidate file or --set, and refuses
bad input with a message and a non-zero exit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import select

from controller.policy.config import POLICY_VERSION
from pdscope import cli
from store.db import transaction
from store.models import TickRecord
from tests.controller.conftest import World
from tests.controller.replay import T0

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "pdscope.yaml"
RANGE = ["--from", str(T0 - 10), "--until", str(T0 + 3600)]


@pytest.fixture
def recorded(world: World) -> str:
    for _ in range(3):
        world.step()
    for _ in range(5):
        world.step(handoff_s={"decode-2": 0.5}, scrape={"decode_2": {"xfer_s": 0.1}})
    return world.settings.store.url


def replay(url: str, *args: str) -> int:
    return cli.main(["--config", str(CONFIG), "replay", "--store", url, *args])


def _candidate(tmp_path: Path, controller_lines: str) -> str:
    text = CONFIG.read_text().replace("controller:\n", "controller:\n" + controller_lines, 1)
    path = tmp_path / "candidate.yaml"
    path.write_text(text)
    return str(path)


def test_the_stored_config_reproduces(recorded: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert replay(recorded, *RANGE) == 0
    out = capsys.readouterr().out
    assert out.startswith("replayed 8 ticks, ")
    assert "the stored decisions are reproduced exactly" in out


def test_a_candidate_file_and_set_say_where_they_part(
    recorded: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _candidate(tmp_path, "  max_weight_step: 0.05\n")
    assert replay(recorded, *RANGE, "--candidate", path) == 0
    out = capsys.readouterr().out
    assert "ticks differ; the first at " in out and "weight decode-2 served_weight: run " in out
    assert "decode-2: mean " in out
    assert replay(recorded, *RANGE, "--set", "max_weight_step=0.05", "--json") == 0
    body = json.loads(capsys.readouterr().out)
    assert body["first_divergence"]["subject"] == "decode-2" and body["reproduced"] is True


def test_an_invalid_candidate_names_the_field(
    recorded: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _candidate(tmp_path, "  max_weight_step: 3\n")
    assert replay(recorded, *RANGE, "--candidate", path) == 2
    err = capsys.readouterr().err
    assert "candidate config is not valid" in err and "controller.max_weight_step" in err
    assert replay(recorded, *RANGE, "--set", "max_step=1") == 2
    assert "--set max_step: not a policy setting" in capsys.readouterr().err


def test_an_evidence_setting_is_refused_naming_it(recorded: str, capsys: pytest.CaptureFixture[str]) -> None:
    # the replay decides on the recorded observation: a setting of the evidence step could not act
    assert replay(recorded, *RANGE, "--set", "pair_min_samples=3") == 2
    err = capsys.readouterr().err
    assert "--set pair_min_samples: acts only in the evidence step" in err and "whatif" in err


def test_no_ticks_bad_ranges_and_other_versions_exit_non_zero(
    recorded: str, world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    assert replay(recorded, "--from", str(T0 - 100), "--until", str(T0 - 50)) == 1
    assert "no controller tick was recorded in the window" in capsys.readouterr().err
    assert replay(recorded, "--since", "soon") == 2
    assert "--since:" in capsys.readouterr().err
    with transaction(world.factory) as s:
        row = s.scalars(select(TickRecord)).first()
        assert row is not None
        row.policy_version = POLICY_VERSION + 1
    assert replay(recorded, *RANGE) == 2
    assert f"decided by policy version {POLICY_VERSION + 1}" in capsys.readouterr().err


def test_a_replay_that_does_not_reproduce_exits_3(
    recorded: str, world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    from store.models import Decision

    with transaction(world.factory) as s:
        d = s.scalars(
            select(Decision).where(Decision.field == "weight", Decision.subject == "decode-2")
        ).first()
        assert d is not None
        d.reason = "SlowPrefill"
    assert replay(recorded, *RANGE) == 3
    assert "NOT REPRODUCED: 1 mismatch(es)" in capsys.readouterr().out
