"""The Controller page's replay section (AppTest) against a real controller API over recorded ticks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from streamlit.testing.v1 import AppTest

from controller.api import create_app
from dashboard.replayview import headline, timeline_frame
from tests.controller.conftest import World, world  # noqa: F401 - a fixture, used by name
from tests.controller.replay import T0
from tests.support.controllers import FakeController
from tests.support.serving import serve_in_thread

TIMEOUT = 60


@pytest.fixture
def controller_url(world: World) -> Iterator[str]:  # noqa: F811 - the fixture above
    for _ in range(3):
        world.step()
    for _ in range(5):
        world.step(handoff_s={"decode-2": 0.5}, scrape={"decode_2": {"xfer_s": 0.1}})
    with serve_in_thread(create_app(world.reconciler, token="t0ken", notifier=world.notifier)) as url:
        yield url


def _section(url: str, start: float, end: float) -> None:
    from dashboard import replayview

    replayview.render(url, start, end)


def _app(url: str) -> AppTest:
    return AppTest.from_function(
        _section, kwargs={"url": url, "start": T0 - 10, "end": T0 + 3600}, default_timeout=TIMEOUT
    )


def test_the_stored_config_and_a_candidate_side_by_side(controller_url: str) -> None:
    at = _app(controller_url).run()
    assert not at.exception
    assert not at.success and "Re-runs the policy" in at.caption[0].value, "nothing replays before asked"
    at.button[0].click().run()
    assert not at.exception
    assert "reproduces all 8 ticks exactly" in at.success[0].value
    at.text_input(key="replay_set").input("max_weight_step=0.05")  # a form: sent by its button
    at.button[0].click().run()
    assert not at.exception
    msg = at.info[0].value
    assert "The candidate parts from the run on" in msg and "decode-2 served_weight" in msg
    table = at.dataframe[0].value
    slow = table[table["instance"] == "decode-2"].iloc[0]
    assert slow["mean (replay)"] > slow["mean (run)"]


def test_a_bad_setting_is_shown_not_raised(controller_url: str) -> None:
    at = _app(controller_url)
    at.query_params["replay"] = "min_wieght=0.1"
    at.run()
    assert not at.exception
    assert "HTTP 400" in at.warning[0].value and "not a policy setting" in at.warning[0].value


def test_no_controller_is_a_warning() -> None:
    at = _app("http://127.0.0.1:1")
    at.query_params["replay"] = "min_weight=0.1"
    at.run()
    assert not at.exception and "Replay not available" in at.warning[0].value


def test_headline_and_frame_from_a_body() -> None:
    body = {
        "ticks": 3,
        "candidate": None,
        "reproduced": False,
        "mismatch_count": 1,
        "mismatches": [
            {"ts": T0, "subject": "d-1", "field": "weight", "actual": "1 -> 0.5", "replayed": "1 -> 0.75"}
        ],
    }
    kind, text = headline(body)
    assert kind == "error" and "did NOT reproduce" in text and "d-1 weight" in text
    df = timeline_frame({"d-1": [[T0, 1.0, 1.0], [T0 + 2, 0.5, 0.75]], "d-2": [[T0, 1.0, 1.0]]}, {"d-1"})
    assert list(df["series"]) == ["run", "replay", "run", "replay"] and set(df["instance"]) == {"d-1"}


def test_an_answer_that_is_not_a_replay_is_a_warning(fake_controller: FakeController) -> None:
    """A controller of another version (here the fake one, answering every GET with its own body)."""
    at = _app(fake_controller.url)
    at.query_params["replay"] = "min_weight=0.1"
    at.run()
    assert not at.exception and "lacks" in at.warning[0].value
