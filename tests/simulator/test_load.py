"""``pdscope load`` end to end against a simulated 2P+4D fleet (small and bounded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdscope.cli import main
from simulator.testing import running_fleet


def test_load_against_2p4d_fleet_prints_summary_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with running_fleet(2, 4, seed=0, latency_scale=0.2) as fleet:
        cfg = tmp_path / "pdscope.yaml"
        cfg.write_text(fleet.config_yaml())
        out = tmp_path / "load.json"
        code = main(
            [
                "--config",
                str(cfg),
                "load",
                "--direct",
                "--rate",
                "40",
                "-n",
                "40",
                "--duration",
                "20",
                "--prompt-len",
                "uniform:50,400",
                "--output-len",
                "lognormal:16,0.5",
                "--seed",
                "3",
                "--timeout",
                "20",
                "--sim-admin",
                fleet.admin_url,
                "-o",
                str(out),
            ]
        )
    captured = capsys.readouterr()
    assert code == 0
    assert "40/40 done" in captured.err  # the progress bar
    assert "goodput" in captured.out and "SLO attainment" in captured.out and "TTFT" in captured.out
    data = json.loads(out.read_text())
    s = data["summary"]
    assert s["requests"] == 40 and s["completed"] == 40 and s["failed"] == 0
    assert 0 < s["goodput_rps"] <= s["throughput_rps"]
    assert s["ttft_s"]["p50"] <= s["ttft_s"]["p99"] <= s["e2e_s"]["p99"]
    assert "trustworthy" in s["simulator"]
    reqs = data["requests"]
    assert len(reqs) == 40 and all(r["ok"] and r["ttft_s"] > 0 for r in reqs)
    assert all(r["output_tokens"] == r["max_tokens"] for r in reqs)  # ignore_eos: every token asked for
    assert len({r["max_tokens"] for r in reqs}) > 5 and len({r["prompt_tokens"] for r in reqs}) > 5


def test_load_chat_against_a_url_counts_failures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with running_fleet(1, 1, seed=0, latency_scale=0.0) as fleet:
        out = tmp_path / "load.json"
        # straight to D (no P step): it computes locally; a bad model name fails every request
        code = main(
            [
                "load",
                "--url",
                fleet.decode_urls[0],
                "--endpoint",
                "chat",
                "--rate",
                "50",
                "-n",
                "10",
                "--arrival",
                "bursty",
                "--burst",
                "5",
                "--output-len",
                "fixed:4",
                "--no-progress",
                "-o",
                str(out),
            ]
        )
        assert code == 0
        ok = json.loads(out.read_text())["summary"]
        assert ok["completed"] == 10 and ok["tpot_s"]["p50"] is not None
        code = main(
            [
                "load",
                "--url",
                fleet.decode_urls[0],
                "--model",
                "nope",
                "--rate",
                "50",
                "-n",
                "5",
                "--no-progress",
                "-o",
                str(out),
            ]
        )
        assert code == 1
        bad = json.loads(out.read_text())["summary"]
        assert bad["failed"] == 5 and bad["errors"] == {"HTTP 404": 5}
    capsys.readouterr()
