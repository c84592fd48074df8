"""The precise view: a request tokenized as vLLM will, matched against the blocks its events stored."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdscope import simtokenizer
from pdscope.kvevents import Batch, BlockStored
from proxy.kvindex import PrefixIndex, chain_keys
from proxy.precise import PreciseView, adapter_of
from proxy.prompts import CHAT, COMPLETIONS
from proxy.tokenize import load_tokenizer

BS = 4
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizer"
SIM = load_tokenizer(simtokenizer.NAME)


class CountingLock:
    """A lock that counts how often it is taken, and says whether it is held."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.taken = 0
        self.held = False

    def __enter__(self) -> None:
        self._lock.acquire()
        self.taken += 1
        self.held = True

    def __exit__(self, *exc: object) -> None:
        self.held = False
        self._lock.release()


def store(index: PrefixIndex, instance: str, ids: list[int], blocks: int, lora: str | None = None) -> None:
    """``instance`` reports it stored the first ``blocks`` blocks of ``ids`` (vLLM's hashes: 1, 2, ...)."""
    hashes = tuple(range(1, blocks + 1))
    event = BlockStored(hashes, None, tuple(ids[: blocks * BS]), BS, lora)
    index.apply(instance, Batch(1.0, (event,)))


def view(tokenizer: Any = SIM, base_model: str | None = "m") -> tuple[PreciseView, PrefixIndex]:
    index = PrefixIndex(BS, 10_000)
    return PreciseView(tokenizer, index, threading.Lock(), base_model=base_model), index


CHAT_1 = [
    {"role": "system", "content": "you are a terse helpful assistant " * 3},
    {"role": "user", "content": "hi"},
]
CHAT_2 = [
    *CHAT_1,
    {"role": "assistant", "content": "hello there"},
    {"role": "user", "content": "more please"},
]


def test_the_prompt_is_the_tokenizers_ids_cut_into_the_indexs_blocks() -> None:
    v, _ = view()
    body = {"model": "m", "messages": CHAT_1}
    p = v.prompt(CHAT, body)
    ids = simtokenizer.chat_ids(CHAT_1)
    assert p is not None
    assert p.token_ids == tuple(ids) and p.tokens == len(ids) and p.block_tokens == BS
    assert list(p.keys) == chain_keys(ids, BS) and len(p.keys) == len(ids) // BS


def test_cached_is_what_each_instance_stored_of_the_prompt() -> None:
    v, index = view()
    ids = simtokenizer.chat_ids(CHAT_2)
    store(index, "p0", ids, 3)
    store(index, "d0", ids, len(ids) // BS)
    p = v.prompt(CHAT, {"messages": CHAT_2})
    assert p is not None
    assert v.cached(p, ["p0", "p1", "d0"]) == {"p0": 12, "p1": 0, "d0": (len(ids) // BS) * BS}


def test_a_resent_history_hits_the_blocks_its_last_turn_stored() -> None:
    v, index = view()
    first = simtokenizer.chat_ids(CHAT_1)
    store(index, "p0", first, len(first) // BS)  # what vLLM stored for turn 1's prompt
    p = v.prompt(CHAT, {"messages": CHAT_2})
    assert p is not None
    assert v.cached(p, ["p0"]) == {"p0": (len(first) // BS) * BS}


def test_an_adapters_blocks_count_only_for_requests_naming_that_adapter() -> None:
    v, index = view(base_model="base")
    body = {"prompt": "a b c d e f g h i"}
    ids = simtokenizer.text_ids(body["prompt"])
    store(index, "p0", ids, 2, lora="sql")
    store(index, "p1", ids, 2)
    cases = [
        ({"model": "sql"}, {"p0": 8, "p1": 0}),
        ({"model": "base"}, {"p0": 0, "p1": 8}),
        ({}, {"p0": 0, "p1": 8}),
    ]
    for extra, want in cases:
        p = v.prompt(COMPLETIONS, {**body, **extra})
        assert p is not None
        assert v.cached(p, ["p0", "p1"]) == want, extra


def test_adapter_of() -> None:
    assert adapter_of({"model": "sql"}, "base") == "sql"
    assert adapter_of({"model": "base"}, "base") is None
    assert adapter_of({}, "base") is None
    assert adapter_of({"model": ""}, "base") is None
    assert adapter_of({"model": 3}, "base") is None
    assert adapter_of({"model": "sql"}, None) is None  # no base model named: no adapter can be told apart


def test_a_stale_instance_is_credited_nothing() -> None:
    v, index = view()
    ids = simtokenizer.text_ids("a b c d e f g h")
    store(index, "p0", ids, 2)
    index.mark_stale("p0")
    p = v.prompt(COMPLETIONS, {"prompt": "a b c d e f g h"})
    assert p is not None and v.cached(p, ["p0"]) == {"p0": 0}


def test_the_fixture_tokenizer_end_to_end() -> None:
    tok = load_tokenizer(str(FIXTURE))
    v, index = view(tokenizer=tok)
    body = {"messages": [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]}
    ids = tok.ids(CHAT, body)
    assert ids is not None and len(ids) >= 3 * BS
    store(index, "p0", ids, 3)
    p = v.prompt(CHAT, body)
    assert p is not None and p.token_ids == tuple(ids)
    assert v.cached(p, ["p0"]) == {"p0": 12}
    completion = v.prompt(COMPLETIONS, {"prompt": "The quick brown fox jumps over the lazy dog."})
    assert completion is not None and v.cached(completion, ["p0"]) == {"p0": 0}  # another path, other ids


def test_the_lock_is_taken_for_the_match_only() -> None:
    index = PrefixIndex(BS, 100)
    lock = CountingLock()
    v = PreciseView(SIM, index, lock, base_model="m")  # type: ignore[arg-type]
    p = v.prompt(COMPLETIONS, {"prompt": "a b c d e f g h"})
    assert p is not None and lock.taken == 0  # tokenizing and keying run outside it
    seen: list[bool] = []
    real_match = index.match

    def match(*args: Any) -> dict[str, int]:
        seen.append(lock.held)
        return real_match(*args)

    index.match = match  # type: ignore[method-assign]
    v.cached(p, ["p0"])
    assert lock.taken == 1 and seen == [True] and not lock.held


class Refusing:
    refused: Counter[str] = Counter()

    def ids(self, endpoint: str, body: Mapping[str, Any]) -> list[int] | None:
        return None


class Broken:
    refused: Counter[str] = Counter()

    def ids(self, endpoint: str, body: Mapping[str, Any]) -> list[int] | None:
        raise RuntimeError("a tokenizer bug")


def test_what_it_cannot_key_is_none_and_counted_never_an_error() -> None:
    v, _ = view(tokenizer=Refusing())
    assert v.prompt(COMPLETIONS, {"prompt": "x"}) is None and v.refused == {"tokenizer": 1}
    v, _ = view(tokenizer=Broken())
    assert v.prompt(COMPLETIONS, {"prompt": "x"}) is None and v.refused == {"error": 1}
    v, _ = view()
    assert v.prompt(CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}) is None


def test_a_prompt_shorter_than_a_block_has_no_keys_and_routed_learns_nothing() -> None:
    v, index = view()
    p = v.prompt(COMPLETIONS, {"prompt": "a b"})
    assert p is not None and p.keys == () and p.tokens == 2
    v.routed(p, ["p0"], 0.0)
    assert len(index) == 0 and v.cached(p, ["p0"]) == {"p0": 0}
