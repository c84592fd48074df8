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


def _route_each(v: ApproxView, texts: list[str], inst: str = "p0") -> None:
    for i, text in enumerate(texts):
        v.routed(prompt(v, text), [inst], float(i))


CONVS = [f"conv{i:04d}" * 4 for i in range(6)]  # six 4-block prompts, nothing shared


def test_a_prediction_that_did_not_come_true_is_counted_and_changes_nothing_else() -> None:
    """A miss is no eviction signal the view can trust (a turn sent before its previous one was
    prefilled misses too): it is counted for the health metrics, and the view keeps its entries."""
    v, _ = make(capacity_tokens=1000)
    _route_each(v, CONVS)
    assert v.verify("p0", 8, 0) == "miss" and v.verify("p0", 8, None) == "unchecked"
    assert v.blocks("p0") == 24 and v.cached(prompt(v, CONVS[1]), ["p0"]) == {"p0": 8}
    assert v.trust.counts == {("p0", "miss"): 1}


def test_the_checked_tokens_are_counted_per_instance() -> None:
    v, _ = make()
    v.verify("p0", 8, 8)
    v.verify("p0", 8, 2)
    v.verify("d1", 6, 10)  # more than predicted: counted as far as the prediction went
    assert v.trust.tokens == {
        ("p0", "predicted"): 16,
        ("p0", "reported"): 10,
        ("d1", "predicted"): 6,
        ("d1", "reported"): 6,
    }
    assert v.trust.counts == {("p0", "hit"): 1, ("p0", "miss"): 1, ("d1", "hit"): 1}


def test_reported_tokens_are_compared_in_the_views_own_estimate() -> None:
    """A ``chars_per_token`` that overestimates tokens 3x: the view predicts 3x what vLLM can report
    even on a full hit; scaled by the prompt's two counts it is a hit."""
    v, _ = make(capacity_tokens=1000)
    assert v.verify("p0", 24, 8, (48, 16)) == "hit"  # 8 of 16 real tokens: 24 of 48 estimated
    assert v.trust.tokens[("p0", "reported")] == 24
    assert make()[0].verify("p0", 24, 8) == "miss"  # unscaled it would have looked like one


def test_chars_per_token_is_learnt_from_the_prompt_lengths_vllm_counts() -> None:
    """Issue 33: a view that overestimates every prompt 2x (chars_per_token 4 for text of 8 characters
    a token) made admission by prediction reject what the fleet could serve, and sent to P what D
    alone would have served; vLLM's own counts correct the estimate."""
    v, _ = make()
    text = "abcdefg " * 40  # 320 characters, 40 tokens for the model
    assert prompt(v, text).tokens == 80
    for _ in range(300):
        v.verify("p0", 0, None, (prompt(v, text).tokens, 40))
    p = prompt(v, text)
    assert abs(p.tokens - 40) <= 1 and p.block_tokens == 1
    assert abs(v.chars_per_token - 8.0) < 0.2


def test_the_learnt_chars_per_token_stays_within_a_factor_of_the_configured_one() -> None:
    v, _ = make()
    for _ in range(500):
        v.verify("p0", 0, None, (1000, 1))
    assert v.chars_per_token == CPT * 8  # 1,000 estimated tokens were 1 for the model: capped
