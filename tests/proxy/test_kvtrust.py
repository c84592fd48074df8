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
