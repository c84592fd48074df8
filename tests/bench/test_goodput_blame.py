"""The blame matrix of the goodput bench (``bench/goodput/blame.py``): who was cut, against who was
faulty, per controlled run, from a result file's figures."""

from __future__ import annotations

import json
from typing import Any

from bench.goodput.blame import blame_markdown, blame_rows
from bench.goodput.report import main


def _run(min_weight: dict[str, float], wrong: list[tuple[str, str]], reaction: int | None) -> dict[str, Any]:
    return {
        "min_weight": min_weight,
        "healthy_cut_detail": [{"subject": s, "reason": r, "tick": 30} for s, r in wrong],
        "reaction_ticks": reaction,
    }


RESULT: dict[str, Any] = {
    "cells": {
        "2p4d:90:p_nic": {
            "faulty": ["prefill-1"],
            "seeds": {
                "1": {"contenders": {"controller": _run({"prefill-1": 0.02, "prefill-0": 1.0}, [], 3)}},
                "2": {
                    "contenders": {
                        "controller": _run(
                            {"prefill-1": 0.5, "prefill-0": 0.31},
                            [("prefill-0", "SlowPrefill"), ("prefill-0", "SlowPrefill")],
                            4,
                        ),
                        "static": {"goodput_rps": 5.0},
                    }
                },
            },
        },
        "2p4d:90:bad_pair": {  # one seed: the contenders sit on the cell itself
            "faulty": ["decode-3", "prefill-0"],
            "contenders": {"controller": _run({"decode-3": 0.6}, [], 9)},
        },
        "2p4d:90:burst": {
            "faulty": [],
            "contenders": {"controller": _run({}, [("decode", "HandoffBacklog")], 2)},
        },
    }
}


def test_each_controlled_run_says_who_was_cut_against_who_was_faulty() -> None:
    rows = {(r["cell"], r["seed"]): r for r in blame_rows(RESULT)}
    assert set(rows) == {
        ("2p4d:90:p_nic", "1"),
        ("2p4d:90:p_nic", "2"),
        ("2p4d:90:bad_pair", "-"),
        ("2p4d:90:burst", "-"),
    }
    clean = rows["2p4d:90:p_nic", "1"]
    assert clean["cut"] == {"prefill-1": 0.02} and clean["healthy_cut"] == {} and clean["passed"]
    wrong = rows["2p4d:90:p_nic", "2"]
    assert wrong["healthy_cut"] == {"prefill-0": ["SlowPrefill"]} and not wrong["passed"]
    late = rows["2p4d:90:bad_pair", "-"]
    assert late["cut"] == {"decode-3": 0.6} and not late["passed"]  # cut, but 9 ticks after onset
    pool = rows["2p4d:90:burst", "-"]
    assert pool["healthy_cut"] == {"decode": ["HandoffBacklog"]} and not pool["passed"]


def test_the_report_prints_the_blame_matrix(capsys: Any, tmp_path: Any) -> None:
    path = tmp_path / "goodput.json"
    path.write_text(json.dumps(RESULT))
    assert main(["--blame", str(path)]) == 0
    text = capsys.readouterr().out
    assert text == blame_markdown(RESULT) + "\n"
    assert (
        "| 2p4d:90:p_nic | 2 | controller | prefill-1 | prefill-0 0.31, prefill-1 0.50 | "
        "prefill-0 (SlowPrefill) | 4t | MISS |" in text
    )
    assert "1 of 4 runs pass" in text
