"""``pdscope whatif``: what it refuses (a bad candidate names the field, a range with no data), the fit of
a seeded store (--fit-only), the replay's config, and the verdict. The replays themselves run in
tests/pdscope/test_whatif_recorded.py (slow)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from controller.policy.config import POLICY_VERSION
from pdscope import cli
from pdscope.cli.whatif import (
    CANDIDATE_SECTIONS,
    EXIT_WORSE,
    Figures,
    _report,
    rel_error,
    stack_config,
    validate,
    verdict,
)
from pdscope.config import ConfigError, load_config
from store.db import make_engine, session_factory, transaction
from store.migrate import upgrade
from store.models import Decision, RequestRecord

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "examples" / "pdscope.yaml")
PAIRS = [(p, d) for p in ("prefill-0", "prefill-1") for d in ("decode-0", "decode-1", "decode-2")]


@pytest.fixture
def store(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'whatif.db'}"
    upgrade(url)
    return url


def seed(url: str, t0: float, *, seconds: int = 40, slow_p: str | None = None, from_s: float = 20.0) -> None:
    """Four requests a second over every pair; ``slow_p``'s prefill 4x slower from ``from_s``."""
    engine = make_engine(url)
    with transaction(session_factory(engine)) as s:
        for i in range(seconds * 4):
            t = t0 + i * 0.25
            p, d = PAIRS[i % len(PAIRS)]
            prefill = 0.138 * (4.0 if p == slow_p and i * 0.25 >= from_s else 1.0)
            handoff = 0.29
            s.add(
                RequestRecord(
                    request_id=f"r{i}",
                    status="ok",
                    p_instance=p,
                    d_instance=d,
                    prompt_tokens=2048,
                    completion_tokens=32,
                    kv_bytes=2048 * 327680,
                    proxy_in=t,
                    p_done=t + prefill,
                    first_token=t + prefill + handoff,
                    p_prefill_s=prefill,
                    ttft_s=prefill + handoff,
                    tpot_s=0.011,
                    slo_met=True,
                )
            )
    engine.dispose()


def whatif(url: str, *args: str) -> int:
    return cli.main(["--config", CONFIG, "whatif", "--store", url, *args])


def test_fit_only_prints_the_fitted_fleet(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.time() - 600
    seed(store, t0, slow_p="prefill-1")
    assert whatif(store, "--from", str(t0), "--until", str(t0 + 40), "--fit-only") == 0
    body = json.loads(capsys.readouterr().out)
    fit = body["fit"]
    assert fit["requests"] == 160 and fit["rate_per_s"] == pytest.approx(4.0)
    [fault] = fit["faults"]
    assert (fault["kind"], fault["instance"]) == ("slow", "prefill-1")
    assert fault["at"] == pytest.approx(20.0, abs=0.5)  # halfway to the last healthy sample
    assert fault["at"] + fault["duration"] == pytest.approx(40.0)
    assert fault["factor"] == pytest.approx(4.0, rel=0.02)
    assert set(fit["simulator"]["instances"]) == {
        "prefill-0",
        "prefill-1",
        "decode-0",
        "decode-1",
        "decode-2",
    }
    assert body["compression"] == 1
    assert body["policies_in_window"] == [] and "policy_note" not in body


def test_fit_only_says_when_the_config_file_is_not_the_policy_that_ran(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    t0 = time.time() - 600
    seed(store, t0)
    engine = make_engine(store)
    with transaction(session_factory(engine)) as s:
        s.add(
            Decision(
                ts=t0 + 5, tick=1, mode="enforce", subject_kind="instance", subject="prefill-0",
                field="weight", reason="Healthy", message="", policy="v1:0123456789abcdef",
            )
        )  # fmt: skip
    engine.dispose()
    cand = tmp_path / "c.yaml"
    cand.write_text("controller:\n  min_weight: 0.3\n")
    args = ("--from", str(t0), "--until", str(t0 + 40), "--fit-only", "--candidate", str(cand))
    assert whatif(store, *args) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["policies_in_window"] == ["v1:0123456789abcdef"]
    assert body["policy_old"] in body["policy_note"] and "v1:0123456789abcdef" in body["policy_note"]
    assert (
        body["policy_candidate"].startswith(f"v{POLICY_VERSION}:")
        and body["policy_candidate"] != body["policy_old"]
    )


def test_a_long_window_is_thinned_to_the_bound(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.time() - 600
    seed(store, t0, seconds=100)
    args = ("--from", str(t0), "--until", str(t0 + 100), "--fit-only", "--max-replay-s", "30")
    assert whatif(store, *args) == 0
    assert json.loads(capsys.readouterr().out)["compression"] == 4


def test_a_range_with_no_data_says_so_and_fails(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    seed(store, time.time() - 600)
    assert whatif(store, "--from", "1000", "--until", "2000") == 1
    err = capsys.readouterr().err
    assert "no request record in the window from 1970-01-01 00:16:40 UTC to 1970-01-01 00:33:20 UTC" in err


def test_an_empty_store_says_so_and_fails(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert whatif(store, "--since", "30m") == 1
    assert "no request record" in capsys.readouterr().err


def test_a_store_that_cannot_be_read_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'none' / 'x.db'}"
    assert whatif(url, "--since", "30m") == 1
    assert "the store cannot be read" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (("--since", "soon"), "--since"),
        (("--from", "2000", "--until", "1000"), "--from"),
        (("--since", "5m", "--max-replay-s", "0"), "--max-replay-s"),
        (("--since", "5m", "--tolerance", "1.5"), "--tolerance"),
        (("--since", "5m", "--bucket-s", "-1"), "--bucket-s"),
    ],
)
def test_bad_ranges_are_usage_errors(
    store: str, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], flag: str
) -> None:
    assert whatif(store, *args) == 2
    assert f"pdscope whatif: {flag}: " in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("controller:\n  min_weight: 2\n", "controller.min_weight: Input should be less than or equal to 1"),
        ("controller:\n  mode: sometimes\n", "controller.mode: Input should be 'advisory' or 'enforce'"),
        ("controller:\n  no_such_knob: 1\n", "controller.no_such_knob: Extra inputs are not permitted"),
        ("proxy:\n  admission:\n    max_inflight_requests: -3\n", "proxy.admission.max_inflight_requests"),
        ("store:\n  url: sqlite:///x.db\n", "store: a candidate changes only controller, proxy, alerts"),
        ("controller: 3\n", "controller: expected a mapping"),
        ("- controller\n", "expected a mapping of sections"),
        ("controller: [\n", "not valid YAML"),
    ],
)
def test_a_candidate_that_fails_validation_names_the_field(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, problem: str
) -> None:
    t0 = time.time() - 600
    seed(store, t0)
    cand = tmp_path / "candidate.yaml"
    cand.write_text(text)
    assert whatif(store, "--from", str(t0), "--until", str(t0 + 40), "--candidate", str(cand)) == 1
    err = capsys.readouterr().err
    assert f"{cand}: " in err and problem in err, err


def test_a_missing_candidate_file_fails(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert whatif(store, "--since", "5m", "--candidate", str(tmp_path / "nope.yaml")) == 1
    assert "cannot read" in capsys.readouterr().err


def test_the_replay_config_keeps_the_policy_and_moves_every_address(tmp_path: Path) -> None:
    base = load_config(CONFIG)
    roles = {"prefill-0": "prefill", "decode-0": "decode", "decode-9": "decode"}
    cfg = stack_config(base, roles, {"prefill_tokens_per_s": 9000.0}, f"sqlite:///{tmp_path / 's.db'}")
    s = validate(cfg, "replay")
    assert s.controller.min_weight == base.controller.min_weight and s.slo == base.slo
    assert s.controller.mode == base.controller.mode
    names = {name: pool for pool, inst in s.instances() for name in [inst.name]}
    assert names["prefill-0"] == base.pool_of("prefill-0") and names["decode-9"] == "decode"
    urls = [inst.url for _, inst in s.instances()]
    assert all(u.startswith("http://127.0.0.1:") for u in urls) and len(set(urls)) == 3
    assert s.simulator.prefill_tokens_per_s == 9000.0 and s.simulator.tracing
    assert s.proxy.controller_url == f"http://127.0.0.1:{s.controller.port}"
    assert s.store.url.endswith("s.db")
    assert set(CANDIDATE_SECTIONS) <= set(cfg)


def test_validate_names_the_source_and_field() -> None:
    with pytest.raises(ConfigError) as exc:
        validate({"model": {"name": "m"}, "pools": {}, "controller": {"min_weight": -1}}, "cand.yaml")
    assert any(p.startswith("cand.yaml: controller.min_weight: ") for p in exc.value.problems)


OLD = Figures(100, 100, 4.0, 0.9, 1.0)


@pytest.mark.parametrize(
    ("cand", "tolerance", "worse", "start"),
    [
        (Figures(100, 100, 3.0, 0.7, 2.0), 0.05, True, "WORSE: the candidate would have cut goodput"),
        (Figures(100, 100, 3.9, 0.88, 1.1), 0.05, False, "NOT WORSE"),  # -2.5%: within the tolerance
        (Figures(100, 100, 3.9, 0.88, 1.1), 0.0, True, "WORSE"),
        (Figures(100, 100, 4.4, 0.95, 0.8), 0.05, False, "NOT WORSE"),
    ],
)
def test_verdict(cand: Figures, tolerance: float, worse: bool, start: str) -> None:
    line, got = verdict(OLD, cand, tolerance)
    assert got is worse and line.startswith(start)
    assert "4.000 -> " in line


def test_verdict_when_the_old_run_met_nothing() -> None:
    line, worse = verdict(Figures(10, 10, 0.0, 0.0, 9.0), OLD, 0.05)
    assert not worse and "cannot be compared" in line


@pytest.mark.parametrize(
    ("fitted", "observed", "err"), [(4.4, 4.0, 0.1), (3.0, 4.0, -0.25), (None, 4.0, None), (1.0, 0.0, None)]
)
def test_rel_error(fitted: float | None, observed: float | None, err: float | None) -> None:
    got = rel_error(fitted, observed)
    assert got == (None if err is None else pytest.approx(err))


def test_the_report_flags_a_worse_candidate_with_its_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from pdscope.cli.whatif import RunResult

    args = argparse.Namespace(json=False, tolerance=0.05)
    result = {
        "window": {"since": 1000.0, "until": 1040.0},
        "fit": {"faults": [{"kind": "slow", "instance": "prefill-1"}], "notes": []},
    }
    cols = {
        "observed": Figures(160, 160, 3.8, 0.95, 1.2),
        "fitted(old)": OLD,
        "candidate": Figures(160, 160, 2.0, 0.5, 3.0),
    }
    run = RunResult(1.0, 41.0, "sqlite://", 160, 0.01)
    assert _report(args, result, cols, run, 1) == EXIT_WORSE
    out = capsys.readouterr().out
    assert "fit error on the actual run: goodput +5.3%, p99 TTFT -16.7%" in out
    assert "WORSE: the candidate would have cut goodput: goodput 4.000 -> 2.000 req/s (-50.0%)" in out
    assert "observed   fitted(old)     candidate" in out


@pytest.mark.parametrize(
    ("fitted", "said"),
    [((2.2, 5.6), "(within sampling: the runs' 95 % intervals overlap)"), ((0.7, 1.1), "(beyond sampling)")],
)
def test_the_report_judges_the_p99_against_both_runs_sampling(
    capsys: pytest.CaptureFixture[str], fitted: tuple[float, float], said: str
) -> None:
    """A p99 over 160 requests is set by the worst few: the fit error says whether the two runs' p99
    could be one process's (their 95 % intervals overlap), and the JSON carries the verdict."""
    import argparse

    from pdscope.cli.whatif import RunResult

    args = argparse.Namespace(json=True, tolerance=0.05)
    result = {"window": {"since": 1000.0, "until": 1040.0}, "fit": {"faults": [], "notes": []}}
    cols = {
        "observed": Figures(160, 160, 3.8, 0.95, 3.1, (2.3, 5.51)),
        "fitted(old)": Figures(160, 160, 3.8, 0.95, 5.2 if fitted[0] > 2 else 0.9, fitted),
    }
    assert _report(args, result, cols, RunResult(1.0, 41.0, "sqlite://", 160, 0.01), 1) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["fit_error"]["ttft_p99_within_sampling"] is (fitted[0] > 2)
    assert got["figures"]["observed"]["ttft_p99_interval_s"] == [2.3, 5.51]
    args.json = False
    _report(args, result, cols, RunResult(1.0, 41.0, "sqlite://", 160, 0.01), 1)
    assert said in capsys.readouterr().out
