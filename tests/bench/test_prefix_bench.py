"""The prefix bench: its pure parts (workloads, phase figures, targets, the oracle's keys) on made-up
inputs, and one ``--quick`` smoke run of the whole harness (fleet tier: it starts processes)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import pytest

from bench.prefix.client import _Talks
from bench.prefix.measure import PStats, Snapshot, phase
from bench.prefix.oracle import OracleView
from bench.prefix.report import summarize, table
from bench.prefix.workloads import (
    ASSISTANT_TOKENS,
    CHAT_OVERHEAD,
    SYSTEM_PROMPTS,
    SYSTEM_TOKENS,
    THINK_S,
    WORKLOADS,
    Conversation,
    hot_prefix,
    live_chat,
    mean_prompt_tokens,
    multi_turn,
    request_tokens,
    system_prompts,
    unique,
    zipf_weights,
)
from pdscope import simtokenizer
from proxy.kvindex import chain_keys

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_workloads_are_seeded_bounded_and_sorted(name: str) -> None:
    make = WORKLOADS[name]
    a, b = make(4.0, 30.0, 7), make(4.0, 30.0, 7)
    assert a == b
    assert a != make(4.0, 30.0, 8)
    assert a and all(0 <= p.at < 30.0 for p in a)
    assert [p.at for p in a] == sorted(p.at for p in a)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_planned_token_counts_are_the_simulator_tokenizers(name: str) -> None:
    for p in WORKLOADS[name](2.0, 20.0, 3)[:20]:
        if "messages" in p.body:
            assert len(simtokenizer.chat_ids(p.body["messages"])) == p.prompt_tokens
        else:
            assert len(simtokenizer.text_ids(p.body["prompt"])) == p.prompt_tokens


def test_system_prompts_share_sixteen_long_prefixes_with_zipf_popularity() -> None:
    plan = system_prompts(20.0, 60.0, 1)
    groups = {p.group for p in plan}
    assert groups <= {f"system-{i}" for i in range(SYSTEM_PROMPTS)} and len(groups) > 10
    by_group: dict[str, set[str]] = {}
    for p in plan:
        assert p.body["messages"][0]["role"] == "system"
        assert len(p.body["messages"][0]["content"].split()) == SYSTEM_TOKENS
        by_group.setdefault(p.group, set()).add(p.body["messages"][0]["content"])
    assert all(len(texts) == 1 for texts in by_group.values())  # one text per prefix
    first = sum(p.group == "system-0" for p in plan) / len(plan)
    assert abs(first - zipf_weights(SYSTEM_PROMPTS, 1.0)[0]) < 0.06
    assert len({p.body["messages"][1]["content"] for p in plan}) == len(plan)  # questions are unique


def test_hot_prefix_carries_half_the_traffic() -> None:
    plan = hot_prefix(20.0, 60.0, 2)
    share = sum(p.group == "system-0" for p in plan) / len(plan)
    assert 0.44 < share < 0.56


def test_each_chat_turn_resends_the_previous_turn_as_its_prefix() -> None:
    plan = multi_turn(6.0, 60.0, 3)
    turns: dict[str, list[list[dict[str, str]]]] = {}
    for p in plan:
        turns.setdefault(p.group, []).append(p.body["messages"])
    assert any(len(t) >= 4 for t in turns.values())
    for conv in turns.values():
        for before, after in itertools.pairwise(conv):
            assert after[: len(before)] == before
            assert [m["role"] for m in after[len(before) :]] == ["assistant", "user"]
            ids_b, ids_a = simtokenizer.chat_ids(before), simtokenizer.chat_ids(after)
            assert ids_a[: len(ids_b)] == ids_b  # so the blocks of the earlier turn are a prefix


def test_unique_prompts_share_no_first_block() -> None:
    plan = unique(10.0, 20.0, 4)
    firsts = {chain_keys(simtokenizer.text_ids(p.body["prompt"]), 16)[0] for p in plan}
    assert len(firsts) == len(plan)
    assert mean_prompt_tokens(plan) == 2000


def test_live_chat_plans_conversations_whose_answers_the_fleet_writes() -> None:
    plan = live_chat(8.0, 30.0, 5)
    assert all(isinstance(c, Conversation) for c in plan) and len(plan) > 10
    for c in plan:
        roles = [r for r, _ in c.history]
        assert roles[0] == "system" and roles[1:] == ["user", "assistant"] * ((len(roles) - 1) // 2)
        assert len(c.thinks) == len(c.users) - 1 and len(c.answers) == len(c.users)
        assert all(ASSISTANT_TOKENS[0] <= a <= ASSISTANT_TOKENS[1] for a in c.answers)
        assert all(THINK_S[0] <= t <= THINK_S[1] for t in c.thinks)
        assert c.prompt_tokens == len(simtokenizer.chat_ids(c.body["messages"]))
    assert any(len(c.history) > 1 for c in plan) and any(len(c.history) == 1 for c in plan)
    assert len(request_tokens(plan)) == sum(len(c.users) for c in plan)


class _Stream:
    def __init__(self, lines: list[str]) -> None:
        self.status_code, self.lines = 200, lines

    async def aiter_lines(self) -> Any:
        for line in self.lines:
            yield line


class _Fleet:
    """Answers every chat with "a<n> b<n>" (streamed in two chunks) and keeps the bodies it got."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def post(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        self.bodies.append(body)
        n = len(self.bodies)
        chunks = [
            {"choices": [{"delta": {"content": f" a{n}"}}]},
            {"choices": [{"delta": {"content": f" b{n}"}}]},
            {"choices": [], "usage": {"completion_tokens": 2}},
        ]
        lines = [f"data: {json.dumps(c)}" for c in chunks] + ["data: [DONE]"]

        @contextlib.asynccontextmanager
        async def answer() -> Any:
            yield _Stream(lines)

        return answer()


def test_each_turn_carries_the_answer_the_fleet_returned_to_the_turn_before() -> None:
    conv = Conversation(0.0, (("system", "s"),), ("u1", "u2", "u3"), (0.01, 0.01), (5, 6, 7), "conv-0")
    fleet = _Fleet()
    talks = _Talks(cast(Any, fleet), "http://x/v1/chat/completions", time.perf_counter(), 30.0, 5.0, "m", "t")
    asyncio.run(talks.talk(conv))
    assert [b["max_tokens"] for b in fleet.bodies] == [5, 6, 7]
    assert fleet.bodies[2]["messages"] == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": " a1 b1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": " a2 b2"},
        {"role": "user", "content": "u3"},
    ]
    assert all(r.ok and r.output_tokens == 2 and r.ttft_s is not None for r in talks.results)


def test_the_oracle_keys_a_prompt_as_the_simulator_tokenizes_it() -> None:
    view = OracleView("http://127.0.0.1:9", 16)
    chat = {"messages": [{"role": "system", "content": "a b c"}, {"role": "user", "content": "d"}]}
    p = view.prompt("/v1/chat/completions", chat)
    assert p is not None
    assert p.token_ids == tuple(simtokenizer.chat_ids(chat["messages"]))
    assert p.tokens == 3 + 1 + 2 * CHAT_OVERHEAD
    assert view.prompt("/v1/completions", {"prompt": ["not", "text"]}) is None
    long = {"prompt": " ".join(["w1"] * 40)}
    q = view.prompt("/v1/completions", long)
    assert q is not None and len(q.keys) == 2 and q.block_tokens == 16
    # Nothing answers on port 9: the question fails, counts, and credits nothing.
    assert view.cached(q, ["p0", "p1"]) == {"p0": 0, "p1": 0}
    assert view.errors == 1


def _stats(hits: float, queries: float, waits: dict[float, float]) -> PStats:
    return PStats(hits, queries, dict(waits), max(waits.values()))


def test_phase_figures_are_the_differences_over_the_measured_phase() -> None:
    inf = float("inf")
    a = Snapshot(
        p={"p0": _stats(100, 1000, {1.0: 5, 1.5: 5, inf: 5}), "p1": _stats(0, 0, {1.0: 0, 1.5: 0, inf: 0})},
        computed=5000,
        routes={"pd": 10},
    )
    b = Snapshot(
        p={
            "p0": _stats(700, 2000, {1.0: 9, 1.5: 10, inf: 12}),
            "p1": _stats(300, 1000, {1.0: 4, 1.5: 4, inf: 4}),
        },
        computed=6500,
        routes={"pd": 16, "decode_only": 2},
    )
    got = phase(a, b, ttft_budget_s=1.5, prompt_tokens=4000)
    assert got["reuse"] == pytest.approx(1 - 1500 / 4000)
    assert got["p_hit_rate"] == pytest.approx(900 / 2000)
    assert got["per_p"]["p0"]["hit_rate"] == pytest.approx(0.6)
    assert got["per_p"]["p0"]["queue_over_budget"] == 2  # 7 waits, 5 of them <= 1.5 s
    assert got["per_p"]["p0"]["queue_max_le_s"] == inf
    assert got["per_p"]["p1"]["queue_over_budget"] == 0 and got["per_p"]["p1"]["queue_max_le_s"] == 1.0
    assert got["queue_over_budget"] == 2
    assert got["routes"] == {"pd": 6, "decode_only": 2}
    assert got["decode_only_share"] == pytest.approx(0.25)


def test_a_phase_without_queries_has_no_hit_rate() -> None:
    got = phase(Snapshot(p={"p0": PStats()}), Snapshot(p={"p0": PStats()}), 1.5)
    assert got["p_hit_rate"] is None and got["decode_only_share"] is None and got["reuse"] is None


def _cell(reuse: float, goodput: float, over: float = 0) -> dict[str, object]:
    return {
        "reuse": reuse,
        "p_hit_rate": reuse / 2,
        "goodput_rps": goodput,
        "queue_over_budget": over,
        "errors": {},
    }


def test_targets_pass_and_miss_against_the_same_runs_baselines() -> None:
    cells: dict[str, dict[str, dict[str, object]]] = {
        "system_prompts": {
            "load_only": _cell(0.3, 4.0),
            "precise": _cell(0.85, 5.6),
            "approximate": _cell(0.7, 5.0),
            "oracle": _cell(0.9, 5.8),
        },
        "multi_turn": {"load_only": _cell(0.2, 4.0), "precise": {"missing": "proxy.kv_aware"}},
        "unique": {"load_only": _cell(0.0, 4.0), "precise": _cell(0.0, 3.7), "approximate": _cell(0.0, 3.9)},
        "hot_prefix": {"precise": _cell(0.8, 4.0, over=0), "approximate": _cell(0.8, 4.0, over=3)},
    }
    got = {
        (t["workload"], t["contender"], t["target"].split()[0]): t["verdict"]
        for t in summarize(cells)["targets"]
    }
    assert got[("system_prompts", "precise", "reuse")] == "PASS"  # 0.85 / 0.9 = 0.94
    assert got[("system_prompts", "approximate", "reuse")] == "MISS"  # 0.78
    assert got[("system_prompts", "precise", "goodput")] == "PASS"  # 1.4
    assert got[("system_prompts", "approximate", "goodput")] == "MISS"  # 1.25
    assert got[("multi_turn", "precise", "reuse")] == "n/a"  # its run is missing; no oracle either
    assert got[("unique", "precise", "goodput")] == "MISS"  # 0.925
    assert got[("unique", "approximate", "goodput")] == "PASS"  # 0.975
    assert got[("hot_prefix", "precise", "no")] == "PASS"
    assert got[("hot_prefix", "approximate", "no")] == "MISS"
    assert cells["system_prompts"]["precise"]["goodput_x_load_only"] == pytest.approx(1.4)
    assert cells["system_prompts"]["precise"]["hit_rate_of_oracle"] == pytest.approx(0.85 / 0.9)
    text = table({"cells": cells, "workloads": {}, "summary": summarize(cells)})
    assert "| multi_turn (-/s) | precise | proxy.kv_aware |" in text


@pytest.mark.fleet
@pytest.mark.timeout(240)
def test_quick_run_measures_every_contender_this_checkout_has(tmp_path: Path) -> None:
    out = tmp_path / "prefix.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.prefix",
            "--quick",
            "--workloads",
            "system_prompts",
            "--contenders",
            "load_only,precise,oracle",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    cells = result["cells"]["system_prompts"]
    for name, cell in cells.items():
        assert "error" not in cell, (name, cell)
        if "missing" in cell:
            continue
        assert cell["requests"] > 0 and cell["completed"] == cell["requests"], (name, cell)
        assert cell["p_queries_tokens"] > 0 and cell["reuse"] is not None
    assert "load_only" in cells and "missing" not in cells["load_only"]
    if "missing" not in cells.get("oracle", {"missing": ""}):
        assert cells["oracle"]["reuse"] > 0  # the sixteen prompts repeat even in a few seconds
    assert "| target |" in proc.stdout


def test_the_sweeps_table_shows_approximate_over_precise_with_its_verdict() -> None:
    from bench.prefix.sweep import table as sweep_table

    def row(x: float, a: float, p: float) -> dict[str, Any]:
        ratio = a / p
        return {
            "x": x,
            "rate_rps": 10.0 * x,
            "load_only": {"goodput_rps": 5.0},
            "approximate": {"goodput_rps": a, "p_hit_rate": 0.2},
            "precise": {"goodput_rps": p, "p_hit_rate": 0.4},
            "approx_of_precise": ratio,
            "approx_x_load_only": a / 5.0,
            "verdict": "PASS" if ratio >= 0.9 else "MISS",
        }

    text = sweep_table(
        {"cells": {"live_chat": [row(0.85, 9.5, 10.0), row(1.3, 5.35, 9.45)]}, "not_run": ["x 1.6x"]}
    )
    assert "| live_chat | 0.85 (8.50/s) | 5.00 / 9.50 / 10.00 | 0.95 | PASS | 0.20 / 0.40 | 1.90 |" in text
    assert "| 0.57 | MISS |" in text and "Not run (past --max-wall): x 1.6x" in text
