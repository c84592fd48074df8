"""The blame matrix of the goodput bench (``bench/goodput/blame.py``): who was cut, against who was
faulty, per controlled run, from a result file's figures."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from bench.goodput.blame import blame_markdown, blame_rows
from bench.goodput.explained import names_faulty, top_reason
from bench.goodput.pairs import fault_pair, pair_share, read_pair_counts
from bench.goodput.report import main
from pdscope.config import load_config
from store.db import opened, transaction
from store.migrate import upgrade
from store.models import RequestRecord
from tests.controller.seed import Seeder, all_pairs

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "pdscope.yaml"


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
                "1": {
                    "contenders": {
                        "controller": {
                            **_run({"prefill-1": 0.02, "prefill-0": 1.0}, [], 3),
                            "explain_top": {
                                "stage": "handoff",
                                "place": "prefill-1->*",
                                "cause": "x",
                                "share": 0.5,
                            },
                        }
                    }
                },
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
        "2p4d:90:stuck_decode": {  # one seed: the contenders sit on the cell itself
            "faulty": ["decode-3"],
            "contenders": {"controller": _run({"decode-3": 0.6}, [], 9)},
        },
        "2p4d:90:bad_pair": {
            "faulty": ["decode-3", "prefill-0"],
            "injections": [{"kind": "slow_link", "prefill": "prefill-0", "decode": "decode-3", "factor": 10}],
            "seeds": {
                "1": {
                    "contenders": {
                        "controller": {
                            **_run({}, [], None),
                            "pair_share": 0.2,
                            "explain_top": {
                                "stage": "handoff",
                                "place": "prefill-0->decode-3",
                                "cause": "slow_handoff",
                                "share": 0.61,
                            },
                        }
                    }
                },
                "2": {
                    "contenders": {
                        "controller": {
                            **_run({"prefill-0": 0.5}, [], 3),
                            "pair_share": 0.1,
                            "explain_top": {
                                "stage": "handoff",
                                "place": "*->decode-3",
                                "cause": "x",
                                "share": 0.4,
                            },
                        }
                    }
                },
                "3": {"contenders": {"controller": {**_run({}, [], None), "pair_share": 0.9}}},
            },
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
        ("2p4d:90:stuck_decode", "-"),
        ("2p4d:90:bad_pair", "1"),
        ("2p4d:90:bad_pair", "2"),
        ("2p4d:90:bad_pair", "3"),
        ("2p4d:90:burst", "-"),
    }
    clean = rows["2p4d:90:p_nic", "1"]
    assert clean["cut"] == {"prefill-1": 0.02} and clean["healthy_cut"] == {} and clean["passed"]
    wrong = rows["2p4d:90:p_nic", "2"]
    assert wrong["healthy_cut"] == {"prefill-0": ["SlowPrefill"]} and not wrong["passed"]
    late = rows["2p4d:90:stuck_decode", "-"]
    assert late["cut"] == {"decode-3": 0.6} and not late["passed"]  # cut, but 9 ticks after onset
    # a slow link: avoided with neither end cut passes; an end cut for it, or the pair still used, does not
    avoided = rows["2p4d:90:bad_pair", "1"]
    assert avoided["faulty"] == ["prefill-0 x decode-3"] and avoided["passed"]
    end_cut = rows["2p4d:90:bad_pair", "2"]
    assert end_cut["healthy_cut"] == {"prefill-0": ["cut for its pair"]} and not end_cut["passed"]
    assert not rows["2p4d:90:bad_pair", "3"]["passed"]
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
        "prefill-0 (SlowPrefill) | 4t | – | MISS |" in text
    )
    assert "2 of 7 runs pass" in text
    assert (
        "| 2p4d:90:bad_pair | 1 | controller | prefill-0 x decode-3 | none; "
        "the pair carried ×0.20 an even share" in text
    )


def test_a_fault_on_one_link_names_its_pair() -> None:
    assert fault_pair([{"kind": "slow_link", "prefill": "prefill-0", "decode": "decode-3"}]) == (
        "prefill-0",
        "decode-3",
    )
    assert fault_pair([{"kind": "slow_nic", "prefill": "prefill-1", "factor": 10}]) is None
    assert fault_pair([{"kind": "down", "instance": "decode-1"}]) is None


def test_the_pair_share_is_read_from_the_stored_records(tmp_path: Any) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade(url)
    rows = [("prefill-0", "decode-0", 50.0)] * 6 + [("prefill-0", "decode-1", 50.0)] * 6
    rows += [("prefill-0", "decode-1", 10.0)] * 9  # before ``since``: not counted
    rows += [("prefill-1", "decode-0", 60.0)] * 7 + [("prefill-1", "decode-1", 60.0)]
    with opened(url) as factory, transaction(factory) as s:
        for i, (p, d, ts) in enumerate(rows):
            s.add(RequestRecord(request_id=f"r{i}", status="ok", p_instance=p, d_instance=d, proxy_in=ts))
    counts = read_pair_counts(url, since=20.0)
    assert counts == {
        ("prefill-0", "decode-0"): 6,
        ("prefill-0", "decode-1"): 6,
        ("prefill-1", "decode-0"): 7,
        ("prefill-1", "decode-1"): 1,
    }
    assert pair_share(counts, ("prefill-1", "decode-1"), 4) == 0.2  # 1 of 20 against an even 5
    assert pair_share({}, ("prefill-1", "decode-1"), 4) is None


def test_explains_top_reason_is_read_against_the_faulty_side() -> None:
    rows = {(r["cell"], r["seed"]): r for r in blame_rows(RESULT)}
    assert rows["2p4d:90:p_nic", "1"]["explain_agrees"] is True  # the faulty P's row
    assert rows["2p4d:90:bad_pair", "1"]["explain_agrees"] is True  # the pair
    assert rows["2p4d:90:bad_pair", "2"]["explain_agrees"] is False  # the D's column, not the pair
    assert rows["2p4d:90:bad_pair", "3"]["explain_agrees"] is None  # nothing read
    text = blame_markdown(RESULT)
    assert "| *->decode-3 (handoff, x, 40%) ✗ | MISS |" in text
    assert (
        "names the faulty side (the instance, its row P->*, its column *->D, or the pair) in 2 of 3 runs"
        in text
    )
    assert names_faulty("decode-3", ["decode-3"], None) and names_faulty("*->decode-3", ["decode-3"], None)
    assert not names_faulty("prefill-0->*", ["decode-3"], None) and not names_faulty(
        "proxy", ["decode-3"], None
    )


def test_explains_top_reason_is_read_from_the_runs_store(tmp_path: Any) -> None:
    """The same attribution ``pdscope explain`` prints, over the faulty phase: a D whose handoffs all
    take 3 s is charged (its column, or itself) and named as the faulty side."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade(url)
    t = time.time() - 600
    with opened(url) as factory:
        seeder = Seeder(factory, load_config(CONFIG))
        for k in range(4):
            seeder.requests(t + k, all_pairs())
        for k in range(4):
            seeder.requests(t + 4 + k, all_pairs(), handoff_s={"decode-3": 3.0})
    top = top_reason(url, CONFIG, t + 4, t + 10)
    assert top is not None and top["share"] > 0.5, top
    assert names_faulty(top["place"], ["decode-3"], None), top
    assert top_reason(url, CONFIG, t, t + 3.5) is None  # the healthy phase: nothing missed
