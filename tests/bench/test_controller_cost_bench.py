"""The controller cost bench on PostgreSQL (``--pg``): a small fleet's ticks on a database of its own, the
whole-read run on a copy made from it, the SLO and tenant figures equal, the server's CPU counted, and
the databases gone after (``pg`` tier: it needs the server)."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest

from bench import controller_cost


def _databases(admin: str) -> set[str]:
    with psycopg.connect(admin.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        return {name for (name,) in conn.execute("SELECT datname FROM pg_database")}


@pytest.mark.pg
def test_the_bench_runs_on_postgresql_and_leaves_no_database(pg_admin_url: str, tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    argv = ["--sizes", "12", "--ticks", "2", "--history-s", "40", "--tenants", "--pg", pg_admin_url]
    assert controller_cost.main([*argv, "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["store"] == "postgresql" and got["args"]["pg"] is not None
    (size,) = got["sizes"]
    assert size["slo_figures_equal"] and size["window_rows"] > 0
    assert 0.0 <= size["tick_server_cpu_s"] <= size["tick_cpu_s"]
    # a server on this machine (as `make test` starts it) has its processes' CPU counted in the tick's
    assert got["server_cpu"] == (controller_cost.local_postgres_cpu() > 0)
    # the settings the figures depend on, as the server reports them (its buffer cache above all)
    assert set(got["server_settings"]) == set(controller_cost.SERVER_SETTINGS)
    assert got["server_settings"]["shared_buffers"][:1].isdigit()
    assert not {d for d in _databases(pg_admin_url) if d.startswith("pdscope_cost_")}  # its two dropped


def test_a_ratio_whose_baseline_measured_no_cpu_prints_as_a_dash(capsys: pytest.CaptureFixture[str]) -> None:
    """A tiny fleet's scan can cost nothing at the clock's resolution: its ratios are None, printed "–"."""
    size = {
        "instances": 12,
        "tick_cpu_s": 0.01,
        "tick_cpu_ms_per_instance": 0.8,
        "tick_share_of_interval": 0.005,
        "baseline_scan_cpu_s": 0.0,
        "tick_vs_scan": None,
        "whole_read_tick_cpu_s": 0.0,
        "tick_vs_whole_read": None,
        "record_bytes": 100,
        "record_mb_per_day": 1.0,
        "record_cpu_s": 0.0,
        "record_share_of_tick": None,
        "replay_decode_cpu_s": 0.0,
    }
    controller_cost._print_tables([size])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| 12 |")]
    assert len(lines) == 2 and lines[0].count("| – |") == 2 and lines[0].endswith("| – |")
    assert "| – |" in lines[1]


def test_the_targets_are_the_issues_at_the_sizes_it_names() -> None:
    """At most 20 % of the interval at 1,000 instances, 100 % at 10,000, growth at most linear between them;
    a size the run did not measure has no verdict."""

    def size(n: int, tick: float) -> dict[str, float]:
        return {"instances": n, "tick_cpu_s": tick, "tick_share_of_interval": tick / 2.0}

    got = controller_cost.tick_targets([size(100, 0.05), size(1000, 0.38), size(10_000, 6.9)])
    assert [(t["met"], round(t["measured"], 3)) for t in got] == [(True, 0.19), (False, 3.45), (False, 1.259)]
    assert [t["met"] for t in controller_cost.tick_targets([size(1000, 0.5), size(10_000, 1.9)])] == [
        False,
        True,
        True,  # 3.8x for 10x: exponent 0.58
    ]
    assert controller_cost.tick_targets([size(300, 0.1)]) == []
