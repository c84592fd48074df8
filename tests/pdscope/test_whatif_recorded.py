"""The what-if against recorded runs: the fit reproduces the actual run within a stated error.

Each test records a run: a simulated 2P+2D fleet with pdscope's proxy, collector and controller
(enforcing), 40 s of Poisson load at 4 req/s (2,048-token prompts, 32 output tokens) and one fault
from 10 s to the end — a degraded D link (``slow_link`` x8) or a slow P (``slow`` x5) — into a
SQLite store. Then ``pdscope whatif`` fits the window (never told the engine knobs or the
fault) and replays it under the same policy config, and the fit's error on goodput and p99 TTFT
must be within :data:`GOODPUT_BOUND`, and the two runs' p99 TTFT within each other's sampling (their
95 % intervals overlap). A test takes 2-3 min on two shared
cores (a recording, one or two replays).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdscope.cli import main
from pdscope.cli.whatif import EXIT_WORSE, run_load, stack_config, validate

# The errors the what-if states for its fit (docs/whatif.md): relative, fitted(old) vs observed, per
# recorded run. The degraded link's goodput is set by when the controller's admission limit cuts in
# (a discrete decision: 42 vs 25 of 177 rejected in one pair of runs), so its error has been 8-30 %
# (0.7 % with admission by prediction on, 2026-12-04); the slow P's, recorded without admission by
# prediction, has stayed under 2 %.
GOODPUT_BOUND = {"slow_link": 0.35, "slow": 0.10}
# p99 TTFT over ~160 requests is the second-worst of them, and in the degraded-link run the tail is
# only the few requests that crossed the slow link before it was cut (2 to 5 of them, 2.3-5.5 s, every
# other request under 1 s): a relative bound on it was a bet on that count (+67 % and +72 % in two runs
# of 2026-12-05, -41 % in another). The fit holds it as a sample: the fitted run's p99 and the
# observed one's are each given with their distribution-free 95 % interval, and those must overlap.

ROLES = {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode", "decode-1": "decode"}
SIM = {  # the recorded fleet's engine (what the fit must recover, never handed to it)
    "link_bandwidth_bytes_per_s": 2.5e9,
    "lease_duration_s": 3.0,
    "prefill_tokens_per_s": 16000.0,
    "seed": 1,
}
BASE: dict[str, Any] = {
    "model": {"name": "sim-llama-70b", "kv_bytes_per_token": 327680},
    "pools": {
        "prefill": {"role": "prefill", "instances": [{"name": "p", "url": "http://127.0.0.1:1"}]},
        "decode": {"role": "decode", "instances": [{"name": "d", "url": "http://127.0.0.1:2"}]},
    },
    "slo": {"ttft": {"target_ms": 2000}, "tpot": {"target_ms": 100}, "window_s": 30},
    "collector": {"scrape_interval_s": 1.0, "scrape_timeout_s": 0.8},
    "controller": {"interval_s": 1.0, "window_s": 10.0, "mode": "enforce", "kv_lease_s": 3.0},
    "proxy": {
        "policy": "weighted",
        "routing_poll_s": 0.5,
        "admission": {"max_inflight_requests": 256, "queue_timeout_s": 1.0},
        "timeouts": {"prefill_s": 30, "decode_first_token_s": 30, "decode_total_s": 60},
    },
}


def _record(
    tmp: Path, fault: dict[str, Any], capsys: pytest.CaptureFixture[str], predict: bool = True
) -> tuple[Path, float, float]:
    raw = BASE if predict else {**BASE, "proxy": {**BASE["proxy"], "predict": {"admit": False}}}
    base = validate(raw, "base")
    rec = tmp / "recorded"
    rec.mkdir()
    cfg = stack_config(base, ROLES, SIM, f"sqlite:///{rec / 'store.db'}")
    cfg["collector"]["spool_dir"] = str(rec / "collector-spool")
    rng = random.Random(7)
    t, plan = 0.0, []
    while True:
        t += rng.expovariate(4.0)
        if t >= 40.0:
            break
        plan.append((t, 2048, 32))
    run = run_load(cfg, rec, plan, [fault])
    # the config that ran, as the operator has it: the recorded store, no simulator section
    ran = {k: v for k, v in cfg.items() if k != "simulator"}
    path = tmp / "ran.yaml"
    path.write_text(yaml.safe_dump(ran), encoding="utf-8")
    with capsys.disabled():
        print(f"recorded: {len(plan)} requests, simulator loop lag max {run.loop_lag_max_s}s")
    return path, run.since, run.until


def _whatif(
    capsys: pytest.CaptureFixture[str], config: Path, lo: float, hi: float, *more: str, code: int = 0
) -> dict[str, Any]:
    args = ["--config", str(config), "whatif", "--from", str(lo), "--until", str(hi), "--json", *more]
    got = main(args)
    out = capsys.readouterr().out
    assert got == code, out
    return dict(json.loads(out))


def _found(result: dict[str, Any], fault: dict[str, Any], where: Callable[[dict[str, Any]], bool]) -> None:
    """The fit found the fault: on its instance or pair, from about 10 s to the end, its factor within
    25%; anything else it fitted of that kind is a blip (under 10 s)."""
    faults = [f for f in result["fit"]["faults"] if f["kind"] == fault["kind"]]
    [hit] = [f for f in faults if where(f)] or [None]
    assert hit is not None, result["fit"]["faults"]
    assert abs(hit["at"] - fault["at"]) <= 5.0 and hit["at"] + hit["duration"] >= 35.0, hit
    assert hit["factor"] == pytest.approx(fault["factor"], rel=0.25), hit
    assert all(f["duration"] < 10.0 for f in faults if f is not hit), faults


def _check(result: dict[str, Any], capsys: pytest.CaptureFixture[str], kind: str) -> None:
    err = result["fit_error"]
    fig = result["figures"]
    with capsys.disabled():
        print(json.dumps({"figures": fig, "fit_error": err, "faults": result["fit"]["faults"]}, indent=1))
    assert fig["observed"]["requests"] > 100
    assert err["goodput"] is not None and abs(err["goodput"]) <= GOODPUT_BOUND[kind], err
    assert err["ttft_p99_within_sampling"] is True, (err, fig)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_whatif_reproduces_a_degraded_d_link(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fault = {"kind": "slow_link", "prefill": "prefill-0", "decode": "decode-1", "factor": 8.0, "at": 10.0}
    config, lo, hi = _record(tmp_path, fault, capsys)
    result = _whatif(capsys, config, lo, hi)
    links = [f for f in result["fit"]["faults"] if f["kind"] == "slow_link"]
    assert [(f["prefill"], f["decode"]) for f in links] == [("prefill-0", "decode-1")], result["fit"][
        "faults"
    ]
    _check(result, capsys, "slow_link")


@pytest.mark.slow
@pytest.mark.timeout(540)
def test_whatif_reproduces_a_slow_p(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """... and a candidate that routes round robin (no weights, no outlier ejection) past the slow P
    is flagged: it would have cut goodput."""
    fault = {"kind": "slow", "instance": "prefill-1", "factor": 5.0, "at": 10.0}
    # Without admission by prediction: its rejections are discrete decisions on a noisy margin (5 to
    # 39 of 177 in one recording and its replays on a busy machine), like the link test's limit cut;
    # this test holds the fit of a slow P to its 10 %, the link test covers the predictor's replay.
    config, lo, hi = _record(tmp_path, fault, capsys, predict=False)
    candidate = tmp_path / "candidate.yaml"
    candidate.write_text("proxy:\n  policy: round-robin\n")
    result = _whatif(capsys, config, lo, hi, "--candidate", str(candidate), code=EXIT_WORSE)
    _found(result, fault, lambda f: f.get("instance") == "prefill-1")
    _check(result, capsys, "slow")
    assert result["worse"] is True and result["verdict"].startswith("WORSE"), result["verdict"]
