"""The approximate view: prefixes learnt from the proxy's own routing, bounded by TTL and capacity."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.approx import ApproxView, block_keys, chat_text
from proxy.prefixview import Prompt
from proxy.prompts import CHAT, COMPLETIONS

BC = 8  # characters per block
CPT = 4.0  # 2 tokens per block


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(
    ttl_s: float = 100.0, capacity_tokens: int = 1000, max_entries: int = 1000, clock: Clock | None = None
) -> tuple[ApproxView, Clock]:
    c = clock or Clock()
    return ApproxView(BC, CPT, ttl_s, capacity_tokens, max_entries, clock=c), c


def prompt(v: ApproxView, text: str, model: str = "m") -> Prompt:
    p = v.prompt(COMPLETIONS, {"model": model, "prompt": text})
    assert p is not None
    return p


A = "aaaaaaaabbbbbbbbccccccccdddddddd"  # four blocks
A_FORK = "aaaaaaaabbbbbbbbXXXXXXXXdddddddd"  # shares two


def test_a_prompt_is_its_full_blocks_of_text_with_token_estimates() -> None:
    v, _ = make()
    p = prompt(v, A + "eee")
    assert len(p.keys) == 4 and p.block_tokens == 2 and p.tokens == round(35 / CPT)
    assert p.token_ids is None
    assert list(p.keys) == block_keys(A, BC, "m")
    assert prompt(v, A).keys == p.keys  # the partial last block is not keyed
    assert prompt(v, "abc").keys == () and prompt(v, "").tokens == 1


@pytest.mark.parametrize(
    ("routed", "asked", "want"),
    [
        ([], A, {"p0": 0, "p1": 0}),
        ([(A, ["p0", "d0"])], A, {"p0": 8, "p1": 0, "d0": 8}),
        ([(A, ["p0"])], A_FORK, {"p0": 4, "p1": 0, "d0": 0}),
        ([(A[:16], ["p0"])], A, {"p0": 4, "p1": 0}),
        ([(A, ["p0"]), (A_FORK, ["p1"])], A_FORK, {"p0": 4, "p1": 8}),
        ([(A, ["p0", "p0"])], A, {"p0": 8}),  # D alone: one instance named twice
        ([("Z" + A[1:], ["p0"])], A, {"p0": 0}),  # a different first block shares nothing
    ],
)
def test_cached_after_routed(routed: list[tuple[str, list[str]]], asked: str, want: dict[str, int]) -> None:
    v, _ = make()
    for text, instances in routed:
        v.routed(prompt(v, text), instances, 0.0)
    assert v.cached(prompt(v, asked), list(want)) == want


def test_prompts_of_another_model_share_nothing() -> None:
    v, _ = make()
    v.routed(prompt(v, A, model="base"), ["p0"], 0.0)
    assert v.cached(prompt(v, A, model="sql-adapter"), ["p0"]) == {"p0": 0}
    assert v.cached(prompt(v, A, model="base"), ["p0"]) == {"p0": 8}


@pytest.mark.parametrize(
    ("age", "hit"), [(0.0, True), (99.0, True), (100.0, True), (100.5, False), (1e6, False)]
)
def test_an_entry_older_than_the_ttl_is_not_counted_and_is_pruned(age: float, hit: bool) -> None:
    v, clock = make(ttl_s=100.0)
    v.routed(prompt(v, A), ["p0"], 0.0)
    clock.now = age
    assert v.cached(prompt(v, A), ["p0"]) == {"p0": 8 if hit else 0}
    assert len(v) == (4 if hit else 0)
    assert v.expired == (0 if hit else 4)


def test_routing_again_renews_the_ttl() -> None:
    v, clock = make(ttl_s=100.0)
    v.routed(prompt(v, A), ["p0"], 0.0)
    v.routed(prompt(v, A[:16]), ["p0"], 90.0)  # the first two blocks used again
    clock.now = 150.0
    assert v.cached(prompt(v, A), ["p0"]) == {"p0": 4}


def test_an_instance_holds_at_most_its_capacity_and_forgets_the_least_recent_first() -> None:
    v, _ = make(capacity_tokens=6)  # three blocks
    v.routed(prompt(v, A), ["p0"], 0.0)  # four blocks: only the first three fit
    assert v.blocks("p0") == 3 and v.cached(prompt(v, A), ["p0"]) == {"p0": 6}
    b = "bbbbbbbbccccccccdddddddd"
    v.routed(prompt(v, b), ["p0"], 1.0)
    assert v.blocks("p0") == 3 and v.cached(prompt(v, A), ["p0"]) == {"p0": 0}
    assert v.cached(prompt(v, b), ["p0"]) == {"p0": 6}
    assert v.evicted == 3


def test_eviction_shortens_a_chain_from_its_tail() -> None:
    v, _ = make(capacity_tokens=6)  # three blocks
    v.routed(prompt(v, A[:16]), ["p0"], 0.0)
    v.routed(prompt(v, "xxxxxxxxyyyyyyyy"), ["p0"], 1.0)  # one of A's two must go: its second
    assert v.cached(prompt(v, A), ["p0"]) == {"p0": 2}


def test_capacity_is_per_instance() -> None:
    v, _ = make(capacity_tokens=8)
    v.routed(prompt(v, A), ["p0", "p1"], 0.0)
    v.routed(prompt(v, "q" * 32), ["p1"], 1.0)
    assert v.cached(prompt(v, A), ["p0", "p1"]) == {"p0": 8, "p1": 0}


def test_the_whole_view_is_bounded_in_entries() -> None:
    v, _ = make(max_entries=10)
    for i in range(50):
        v.routed(prompt(v, f"{i:08d}" * 4), [f"p{i % 3}", "d0"], float(i))
        assert len(v) <= 10
        assert sum(v.blocks(f"p{j}") for j in range(3)) + v.blocks("d0") == len(v)
    last = prompt(v, f"{49:08d}" * 4)
    assert v.cached(last, ["p1", "d0"]) == {"p1": 8, "d0": 8}  # the newest survive
    assert v.cached(prompt(v, f"{0:08d}" * 4), ["p0", "d0"]) == {"p0": 0, "d0": 0}


def chat(*messages: tuple[str, Any]) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}


def test_a_chat_that_resends_its_history_hits_the_blocks_of_its_last_turn() -> None:
    v, _ = make()
    turn1 = [("system", "You are a helpful assistant. " * 4), ("user", "What is the capital of France?")]
    turn2 = [*turn1, ("assistant", "Paris."), ("user", "And of Spain?")]
    p1 = v.prompt(CHAT, chat(*turn1))
    p2 = v.prompt(CHAT, chat(*turn2))
    assert p1 is not None and p2 is not None and len(p2.keys) > len(p1.keys) > 0
    v.routed(p1, ["p0"], 0.0)
    assert v.cached(p2, ["p0"]) == {"p0": len(p1.keys) * 2}
    text1 = chat_text(chat(*turn1)["messages"])
    assert len(p1.keys) == len(text1) // BC


def test_chat_text_is_canonical_and_joins_text_parts() -> None:
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    assert chat_text(msgs) == "user\nhi\x1eassistant\n\x1e"
    v, _ = make()
    parts = chat(("user", [{"type": "text", "text": "hello"}, {"type": "text", "text": "world, again"}]))
    plain = chat(("user", "hello\nworld, again"))
    assert v.prompt(CHAT, parts) == v.prompt(CHAT, plain) is not None


def test_a_chats_tools_come_first_in_its_text() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    assert chat_text(msgs, [{"b": 1, "a": 2}]) == 'tools\n[{"a": 2, "b": 1}]\x1euser\nhi\x1e'
    v, _ = make()
    body = chat(("user", "what is the weather in Paris today?"))
    with_tools = v.prompt(CHAT, {**body, "tools": [{"type": "function", "function": {"name": "weather"}}]})
    without = v.prompt(CHAT, body)
    assert with_tools is not None and without is not None
    v.routed(without, ["p0"], 0.0)
    assert v.cached(with_tools, ["p0"]) == {"p0": 0}  # the template renders them ahead: nothing shared
    limited = ApproxView(BC, CPT, 100.0, 1000, 1000, clock=Clock(), max_chars=200)
    assert limited.prompt(CHAT, {**body, "tools": ["x" * 200]}) is None
    assert limited.refused == {"too_long": 1}


@pytest.mark.parametrize(
    ("endpoint", "body", "reason"),
    [
        (COMPLETIONS, {"prompt": [1, 2, 3]}, "token_ids"),
        (COMPLETIONS, {"prompt": ["a", "b"]}, "batch"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "multimodal"),
        (COMPLETIONS, {"prompt": "x" * 101}, "too_long"),
        (COMPLETIONS, {"prompt": "x" * 10, "truncate_prompt_tokens": 5}, "truncate"),
    ],
)
def test_what_it_cannot_key_is_none_and_counted(endpoint: str, body: dict[str, Any], reason: str) -> None:
    v = ApproxView(BC, CPT, 100.0, 1000, 1000, clock=Clock(), max_chars=100)
    assert v.prompt(endpoint, body) is None
    assert v.refused == {reason: 1}


@pytest.mark.parametrize(
    ("block_chars", "chars_per_token", "block_tokens"),
    [(64, 4.0, 16), (8, 3.3, 2), (2, 4.0, 1), (1, 100.0, 1)],
)
def test_block_tokens_is_rounded_and_at_least_one(
    block_chars: int, chars_per_token: float, block_tokens: int
) -> None:
    assert ApproxView(block_chars, chars_per_token, 1.0, 100, 100).block_tokens == block_tokens


@pytest.mark.parametrize("bad", [0, -1])
def test_bounds_must_be_positive(bad: int) -> None:
    for args in [
        (bad, 4.0, 1.0, 1, 1),
        (8, bad, 1.0, 1, 1),
        (8, 4.0, bad, 1, 1),
        (8, 4.0, 1.0, bad, 1),
        (8, 4.0, 1.0, 1, bad),
    ]:
        with pytest.raises(ValueError):
            ApproxView(*args)
