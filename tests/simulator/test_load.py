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


async def test_load_sends_each_request_as_its_tenant_in_turn() -> None:
    """``--tenant a --tenant b``: request i carries tenants[i % 2] in the config's tenants.header."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from simulator.loadgen import LoadTarget, run_load
    from simulator.workload import Planned
    from tests.support.serving import serve

    seen: list[tuple[str, str | None]] = []

    async def completions(request: Request) -> Response:
        seen.append((request.headers["x-request-id"], request.headers.get("x-team")))
        chunk = '{"choices":[{"index":0,"text":"w1"}]}'
        return Response(f"data: {chunk}\n\ndata: [DONE]\n\n", media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    async with serve(app) as url:
        target = LoadTarget(url=url, tenants=("a", "b"), tenant_header="x-team")
        planned = [Planned(0.0, 8, 2) for _ in range(4)]
        results, _ = await run_load(target, planned, timeout_s=10, seed=1)
    assert all(r.ok for r in results)
    assert sorted(seen) == [(f"load-1-{i}", "ab"[i % 2]) for i in range(4)]


def test_a_tenant_that_is_no_tenant_id_is_refused_before_any_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["load", "--url", "http://127.0.0.1:9", "--tenant", "a b", "-o", str(tmp_path / "x.json")])
    assert code == 1 and "--tenant: 'a b' is not a tenant id" in capsys.readouterr().err
