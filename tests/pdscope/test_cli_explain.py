"""``pdscope explain``: the top reasons from a seeded store, --json, and the ranges it refuses."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pdscope import cli
from pdscope.config import load_config
from store.db import make_engine, session_factory
from store.migrate import upgrade
from tests.controller.seed import Seeder, all_pairs

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "examples" / "pdscope.yaml")


@pytest.fixture
def store(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'explain.db'}"
    upgrade(url)
    return url


def seed(url: str, *, slow_p: str | None, n: int = 4, healthy: int = 4) -> float:
    """``healthy`` rounds of requests over every pair, then ``n`` with ``slow_p`` slow.

    Returns when the first slow one arrived."""
    engine = make_engine(url)
    seeder = Seeder(session_factory(engine), load_config(CONFIG))
    t = time.time() - 600
    for k in range(healthy):
        seeder.requests(t + k, all_pairs())
    for k in range(n if slow_p else 0):
        seeder.requests(t + healthy + k, all_pairs(), prefill_s={slow_p or "": 2.5})
    engine.dispose()
    return t + healthy


def explain(url: str, *args: str) -> int:
    return cli.main(["--config", CONFIG, "explain", "--store", url, *args])


def test_prints_the_top_reasons(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    seed(store, slow_p="prefill-1")
    assert explain(store, "--since", "30m") == 0
    out = capsys.readouterr().out
    assert "16 of 64 requests missed their SLO" in out
    assert "The top reasons we missed:\n  1. prefill on prefill-1: 100% of the excess since " in out


def test_json_is_the_api_s_answer(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    first = seed(store, slow_p="prefill-0")
    assert explain(store, "--since", "1h", "--json", "--misses", "2") == 0
    body = json.loads(capsys.readouterr().out)
    assert body["top"][0]["place"] == "prefill-0" and body["top"][0]["since"] == pytest.approx(first)
    assert body["missed"] == 16 and body["misses_shown"] == 2 and body["truncated"] is False


def test_no_misses_is_an_answer(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    seed(store, slow_p=None)
    assert explain(store) == 0  # --since 30m by default
    assert "no request missed its SLO (32 requests)" in capsys.readouterr().out


def test_a_range_with_no_data_says_so_and_fails(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    seed(store, slow_p="prefill-1")
    assert explain(store, "--from", "1000", "--until", "2000") == 1
    err = capsys.readouterr().err
    assert "no request records from 1970-01-01 00:16:40 UTC to 1970-01-01 00:33:20 UTC" in err


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (("--since", "soon"), "--since"),
        (("--since", "9d"), "--since"),
        (("--since", "5m", "--from", "1"), "--since"),
        (("--from", "2000", "--until", "1000"), "--from"),
        (("--limit", "0"), "--limit"),
        (("--misses", "-1"), "--misses"),
    ],
)
def test_a_bad_range_names_the_flag(
    store: str, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], flag: str
) -> None:
    assert explain(store, *args) == 2
    assert capsys.readouterr().err.startswith(f"pdscope explain: {flag}: ")


def test_an_unreadable_store_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"  # no tables: never migrated
    assert explain(url) == 1
    assert "pdscope explain: the store cannot be read" in capsys.readouterr().err


def test_help_lists_explain() -> None:
    assert "    explain " in cli.build_parser().format_help()


def _predict(url: str, *, slow_predicted_s: float) -> None:
    """As a proxy with proxy.predict writes them: every request predicted at 0.2 s against a 1 s
    target, the slow ones (over 2 s) at ``slow_predicted_s``."""
    from sqlalchemy import text

    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE request_records SET ttft_target_s = 1.0, predict_source = 'table',"
                " predicted_ttft_s = CASE WHEN ttft_s > 2 THEN :slow ELSE 0.2 END"
            ),
            {"slow": slow_predicted_s},
        )
    engine.dispose()


def test_says_when_the_misses_were_mispredicted(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    seed(store, slow_p="prefill-1")
    _predict(store, slow_predicted_s=0.2)  # the slow ones were predicted within their target
    assert explain(store, "--since", "30m") == 0
    out = capsys.readouterr().out
    assert "The predictor: 16 of 16 TTFT misses (100%) were mispredicted" in out
    assert "over 64 requests): the fleet changed under the predictor." in out


def test_is_quiet_about_the_predictor_when_the_misses_were_predicted_late(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    seed(store, slow_p="prefill-1")
    _predict(store, slow_predicted_s=2.6)  # predicted over the target, admitted anyway
    assert explain(store, "--since", "30m") == 0
    out = capsys.readouterr().out
    assert "The top reasons we missed:" in out and "predictor" not in out
