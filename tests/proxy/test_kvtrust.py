"""Predicted prefix hits checked against what vLLM reported: a forged ``BlockStored`` is bounded."""

from __future__ import annotations

import threading
from typing import Any, cast

from pdscope.kvevents import Batch, BlockStored
from proxy.gate import KvRouting
from proxy.kvaware import CostModel, Decision
from proxy.kvindex import PrefixIndex, chain_keys
from proxy.kvtrust import HitCheck
from proxy.metrics import ProxyMetrics
from proxy.precise import PreciseView
from proxy.prefixview import Prompt
from proxy.protocol import PrefillAnswer
from proxy.request import RequestState
from proxy.routing import Target
from proxy.tokenize import Tokenizer

BS = 16
TOKENS = list(range(100, 164))  # four blocks


def test_misses_in_a_row_distrust_for_a_backoff_then_probation_decides() -> None:
    check = HitCheck(BS, misses_to_distrust=3, base_s=30, max_s=600)
    assert [check.observe("d1", 64, 0, 0.0) for _ in range(3)] == ["miss", "miss", "distrusted"]
    assert check.distrusted(29.9) == {"d1"} and check.distrusted(30.0) == set()  # probation
    assert check.observe("d1", 64, 0, 31.0) == "distrusted"  # one miss on probation is enough
    assert check.distrusted(90.9) == {"d1"} and check.distrusted(91.0) == set()  # 60 s: doubled
    assert check.observe("d1", 64, 48, 92.0) == "trusted"  # a full hit less the last block
    assert check.counts[("d1", "trusted")] == 1


def test_a_hit_resets_the_run_and_small_or_unreported_predictions_are_not_evidence() -> None:
    check = HitCheck(BS)
    for _ in range(5):
        assert check.observe("d1", 64, 0, 0.0) == "miss"
        assert check.observe("d1", 64, 64, 0.0) == "hit"
    assert check.observe("d1", 8, 0, 0.0) == "unchecked"  # under one block
    assert check.observe("d1", 64, None, 0.0) == "unchecked"  # vLLM did not report it
    assert check.observe("d1", 32, 16, 0.0) == "hit"  # within one block of the prediction
    assert check.distrusted(0.0) == set()


def _view(now: list[float]) -> tuple[PreciseView, PrefixIndex]:
    index = PrefixIndex(BS, 10_000)
    tokenizer = cast(Tokenizer, object())  # never called: the prompts are keyed here
    return PreciseView(tokenizer, index, threading.Lock(), base_model=None, clock=lambda: now[0]), index


def test_a_forged_block_stored_wins_only_until_its_hits_fail_to_come_true() -> None:
    """Whoever answers d1's publisher address says d1 holds a hot prompt. It is credited (and would be
    chosen) for 3 requests, whose reported cached tokens are 0; then d1's events are credited nothing
    for 30 s, then one probation request, then 60 s. Of 12 requests in the first 30 s: 3 (was: 12)."""
    now = [0.0]
    view, index = _view(now)
    hashes = tuple(range(4))
    index.apply("d1", Batch(0.0, (BlockStored(hashes, None, tuple(TOKENS), BS),)))
    prompt = Prompt(tuple(chain_keys(TOKENS, BS)), len(TOKENS), BS, tuple(TOKENS))
    credited = 0
    for _ in range(12):
        got = view.cached(prompt, ["d1", "d2"])
        if got["d1"] > 0:
            credited += 1
            view.verify("d1", got["d1"], 0)  # vLLM: nothing of it was cached
        now[0] += 1.0
    assert credited == 3 and "d1" in index.stale
    now[0] = 33.0  # distrusted at 2.0, for 30 s
    assert view.cached(prompt, ["d1"]) == {"d1": 64}  # probation
    assert view.verify("d1", 64, 0) == "distrusted"
    now[0] = 90.0
    assert view.cached(prompt, ["d1"]) == {"d1": 0}


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int | None, tuple[int, int] | None]] = []

    def verify(
        self, instance: str, predicted: int, reported: int | None, counted: tuple[int, int] | None = None
    ) -> str:
        self.calls.append((instance, predicted, reported, counted))
        return "hit"


def test_the_gate_checks_the_chosen_p_and_a_decode_only_d_but_not_after_a_retry() -> None:
    rec = _Recorder()
    kv = KvRouting(cast(Any, rec), CostModel(), ProxyMetrics())
    p, d, other = (Target(n, "pool", "http://x", 1.0) for n in ("p1", "d1", "p2"))
    req = RequestState("/v1/completions", "r1")
    req.route = Decision(p, d, 48, 32, None, 48, "cost", 64, 0.1)
    req.p, req.d = p, d
    req.prefill = PrefillAnswer(None, 64, 4, None, cached_tokens=16)
    kv.settled(req)
    req.route = Decision(None, d, 0, 64, None, 64, "decode_only_cached", 64, 0.1)
    req.d_cached_tokens, req.d_prompt_tokens = 60, 66
    kv.settled(req)
    req.route = Decision(p, d, 48, 32, None, 48, "cost", 64, 0.1)
    req.p = other  # retried on another P: its count says nothing of the prediction
    kv.settled(req)
    assert rec.calls == [("p1", 48, 16, (64, 64)), ("d1", 64, 60, (64, 66))]


def test_an_approximate_view_that_overestimates_tokens_learns_vllms_count_and_serves_a_short_turn_on_d() -> (
    None
):
    """Issue 33's cause: an approximate view whose chars_per_token (4) overestimates this text's tokens
    (8 characters a token) sees a conversation's new part as 2x longer than it is, so a turn D could
    serve alone (under max_uncached_tokens) went through P, and admission by prediction (same token
    counts) predicted late what was not. Each settled request now teaches the view vLLM's count."""
    from proxy.approx import ApproxView
    from proxy.kvaware import REASON_DECODE_ONLY_SHORT, Candidate, choose

    view = ApproxView(64, 4.0, 300.0, 100_000, 100_000, clock=lambda: 0.0)
    kv = KvRouting(view, CostModel(decode_only=True, max_uncached_tokens=256), ProxyMetrics())
    p, d = Target("p0", "prefill", "http://p", 1.0), Target("d0", "decode", "http://d", 1.0)
    history = "abcdefg " * 200  # 1,600 characters: 200 tokens for the model
    turn = history + "hijklmn " * 150  # 150 more tokens: D, which holds the history, computes 150
    old = view.prompt("/v1/completions", {"model": "m", "prompt": history})
    assert old is not None
    view.routed(old, ["p0", "d0"], 0.0)

    def decide() -> str:
        prompt = view.prompt("/v1/completions", {"model": "m", "prompt": turn})
        assert prompt is not None
        cached = view.cached(prompt, ["p0", "d0"])
        got = choose(prompt, cached, [Candidate(p, 1.0, 0)], [Candidate(d, 1.0, 0)], kv.model)
        assert got is not None
        return got.reason

    assert decide() != REASON_DECODE_ONLY_SHORT  # estimated: D would compute 300 tokens, over 256
    for i in range(200):  # requests of this traffic settle: P counts 350 tokens (the view said 700 at first)
        sent = view.prompt("/v1/completions", {"model": "m", "prompt": turn})
        assert sent is not None
        req = RequestState("/v1/completions", f"r{i}")
        req.route = Decision(p, d, 0, 0, None, 0, "load", sent.tokens, 0.1)
        req.p, req.d = p, d
        req.prefill = PrefillAnswer(None, 350, 22, None, cached_tokens=0)
        kv.settled(req)
    assert abs(view.chars_per_token - 8.0) < 0.3
    assert decide() == REASON_DECODE_ONLY_SHORT
