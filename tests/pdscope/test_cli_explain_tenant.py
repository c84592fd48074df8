"""``pdscope explain --tenant``: one tenant's window in plain words (demand, service, rejections by
reason, attainment against its own target, fair share against what it got, where its misses spent
their time), --json, and the tenants it refuses."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from pdscope import cli
from pdscope.config import load_config
from store.db import make_engine, session_factory
from store.migrate import upgrade
from tests.controller.seed import Seeder, all_pairs

REPO = Path(__file__).resolve().parents[2]
TENANTS = {
    "enabled": True,
    "tenants": {
        "team-a": {"weight": 2, "slo": {"ttft_ms": 1000}},
        "team-b": {"weight": 1},
        "batch": {"weight": 1, "priority": "batch"},
    },
}


@pytest.fixture
def setup(tmp_path: Path) -> tuple[str, str]:
    url = f"sqlite:///{tmp_path / 'explain.db'}"
    upgrade(url)
    data = yaml.safe_load((REPO / "examples" / "pdscope.yaml").read_text())
    data["tenants"] = TENANTS
    config = tmp_path / "pdscope.yaml"
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    engine = make_engine(url)
    seeder = Seeder(session_factory(engine), load_config(str(config)))
    t = time.time() - 600
    for k in range(4):  # team-a: prefill-1 slow (TTFT ~1.55 s: over its 1 s, under the fleet's 2 s)
        seeder.requests(t + k, all_pairs(), prefill_s={"prefill-1": 1.5}, tenant="team-a")
        seeder.requests(t + k, all_pairs(), tenant="team-b")
        seeder.requests(t + k, all_pairs(), tenant="batch", status="rejected", reject_reason="queue_full")
    engine.dispose()
    return url, str(config)


def explain(setup: tuple[str, str], *args: str) -> int:
    url, config = setup
    return cli.main(["--config", config, "explain", "--store", url, *args])


def test_a_tenant_missing_its_own_target_in_plain_words(
    setup: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert explain(setup, "--tenant", "team-a") == 0
    out = capsys.readouterr().out
    assert "Tenant team-a (class interactive, weight 2), " in out
    assert "Demand: 32 request(s) (0 refused as the client's mistake)." in out
    assert "Served 32, none rejected, 0 failed" in out
    assert "16 of 32 served requests met its targets (TTFT 1000 ms, TPOT 100 ms): attainment 50% " in out
    assert "against 90%, under target" in out
    # weights 2:1:1 among three tenants asking; team-a and team-b were served alike, batch nothing
    assert "its fair share 50% among the 3 tenant(s) asking; it got 50% of the service" in out
    assert "1. prefill on prefill-1: 100% of the excess since " in out


def test_a_starved_tenant_says_what_refused_it(
    setup: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert explain(setup, "--tenant", "batch") == 0
    out = capsys.readouterr().out
    assert "Served 0, 32 rejected (32 queue_full)" in out
    assert "SLO: none served, so no attainment." in out
    assert "starved (TenantStarved)" in out


def test_json_is_the_apis_answer_with_the_attribution(
    setup: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert explain(setup, "--tenant", "team-a", "--json", "--misses", "1") == 0
    body = json.loads(capsys.readouterr().out)
    (t,) = body["tenants"]
    assert (t["tenant"], t["served"], t["met"], t["ttft_target_ms"]) == ("team-a", 32, 16, 1000.0)
    assert body["attribution"]["missed"] == 16 and body["attribution"]["misses_shown"] == 1


@pytest.mark.parametrize(
    ("tenant", "words"),
    [("intruder", "is not declared"), ("bad\nid", "is not a tenant id"), ("x" * 5000, "is not a tenant id")],
)
def test_an_undeclared_or_malformed_tenant_is_refused(
    setup: tuple[str, str], capsys: pytest.CaptureFixture[str], tenant: str, words: str
) -> None:
    assert explain(setup, "--tenant", tenant) == 2
    err = capsys.readouterr().err
    assert words in err and len(err) < 400


def test_a_tenant_with_no_request_in_the_range_fails(
    setup: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert explain(setup, "--tenant", "default") == 1
    assert "no request of tenant default" in capsys.readouterr().err
