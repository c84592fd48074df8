"""bench/attribution_links.py runs end to end on a few windows and writes its table's JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import analysis.attribution as attribution
from bench.attribution_links import CASES, main


def test_the_bench_writes_every_case_and_restores_the_rule(tmp_path: Path) -> None:
    own = attribution._holds
    out = tmp_path / "links.json"
    assert main(["--windows", "20", "--out", str(out)]) == 0
    assert attribution._holds is own
    got = json.loads(out.read_text())
    assert [(c["fault"], c["share_p0"], c["requests"]) for c in got["cases"]] == list(CASES)
    assert all(0.0 <= c["link_now"] <= 1.0 and 0.0 <= c["link_before"] <= 1.0 for c in got["cases"])
    # where nine in ten of a D's requests came through one P, the rule before read its queue as a link
    busy = next(c for c in got["cases"] if (c["fault"], c["share_p0"], c["requests"]) == ("queue", 0.9, 200))
    assert busy["link_now"] < busy["link_before"]


@pytest.mark.parametrize(
    "args", [["--windows", "0"], ["--windows", "x"], ["--stray", "nan"], ["--queue-miss", "1.5"]]
)
def test_the_bench_refuses_what_it_cannot_run(args: list[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*args, "--out", str(tmp_path / "links.json")])
    assert exc.value.code == 2
    assert not (tmp_path / "links.json").exists()
