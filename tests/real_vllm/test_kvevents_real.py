"""vLLM's own KV cache events, from a real CPU P/D pair, into pdscope's prefix index.

The module starts its own pair (the session's shared one publishes no events) with
``--kv-events-config`` (ZMQ PUB on an ``ipc://`` endpoint each instance binds, a replay ROUTER on
a loopback port) and ``--enable-prompt-tokens-details``, and subscribes to both instances with
:class:`proxy.kvsubscriber.KvEventsSubscriber` into one :class:`proxy.kvindex.PrefixIndex`.
Prompt token ids come from vLLM's own ``POST /tokenize``, so only the tokenizer's own check
depends on pdscope's tokenizer. What it shows:

- real ``BlockStored`` events decode (``pdscope.kvevents.decode_message``): 128-token blocks
  carrying the prompt's token ids, nothing dropped or skipped;
- a repeated prompt is predicted as cached on P with exactly the tokens vLLM reports it reused
  (``usage.prompt_tokens_details.cached_tokens`` and the rise of ``vllm:prefix_cache_hits_total``),
  and D, after pulling the prompt over NIXL, holds the same blocks (it caches them through the
  same path and publishes them);
- pdscope's own tokenizer (``proxy.tokenize``, ``model.tokenizer`` = the model directory) gives
  vLLM's ids for a completion and a chat, and the chat's blocks match P's events under them;
- recovery after the subscriber stops: a fresh subscriber and index (a restarted proxy) catch up
  from vLLM's replay buffer before the first message they hear, so they know the prompt sent
  while none ran (without that they never would: P reusing a prefix publishes nothing unless the
  request asks, ``vllm_xargs`` ``kv_cache_report_mode: full``); a subscriber that resumes with the
  old one's sequence state sees the gap and gets the missed messages from the replay socket.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from pdscope.kvevents import BlockStored, Message, decode_message
from proxy.kvindex import PrefixIndex, chain_keys
from proxy.kvsubscriber import KvEventsSubscriber, Source
from tests.real_vllm import pd_client as pc
from tests.real_vllm.conftest import own_pair
from tests.real_vllm.pair import BLOCK_SIZE, MODEL_NAME, RealPair
from tests.real_vllm.prompts import unique_prompt
from tests.support.waiting import wait_until

pytestmark = pytest.mark.real_vllm

MAX_TOKENS = 4
EVENT_WAIT_S = 30.0


class RecordingSubscriber(KvEventsSubscriber):
    """The real subscriber, also keeping every message it decoded (for the shape checks)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.decoded: list[tuple[str, Message]] = []

    def receive(self, instance: str, frames: list[bytes]) -> None:
        try:
            self.decoded.append((instance, decode_message(frames)))
        except ValueError:
            pass  # counted by the real receive below
        super().receive(instance, frames)


@dataclass
class KvPair:
    pair: RealPair
    client: httpx.Client
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def p(self) -> str:
        return self.pair.prefill.name

    @property
    def d(self) -> str:
        return self.pair.decode.name

    def sources(self) -> list[Source]:
        return [
            Source(i.name, str(i.kv_events_endpoint), i.kv_events_replay_endpoint)
            for i in (self.pair.prefill, self.pair.decode)
        ]

    def subscriber(self, index: PrefixIndex) -> RecordingSubscriber:
        sub = RecordingSubscriber(self.sources(), index, self.lock)
        sub.start()
        return sub

    def tokenize(self, body: dict[str, Any]) -> list[int]:
        """Token ids of a request body by vLLM's own ``POST /tokenize`` (on P)."""
        req = {"model": MODEL_NAME}
        req.update({"messages": body["messages"]} if "messages" in body else {"prompt": body["prompt"]})
        r = self.client.post(self.pair.prefill.url + "/tokenize", json=req)
        r.raise_for_status()
        return [int(t) for t in r.json()["tokens"]]

    def match(self, index: PrefixIndex, ids: list[int]) -> dict[str, int]:
        with self.lock:
            return index.match(chain_keys(ids, BLOCK_SIZE), [self.p, self.d])

    def logs(self) -> str:
        return f"logs in {self.pair.logs_dir}\n{self.pair.log_tails(30)}"


def prompt_with_full_blocks(kp: KvPair, blocks: int, tag: str) -> tuple[dict[str, Any], list[int]]:
    """A unique completion body whose prompt has ``blocks`` full blocks and a partial one
    (vLLM never reuses a prompt's last token, so a whole number of blocks would lose one)."""
    words = 120
    for _ in range(12):
        body = pc.request_body("completions", unique_prompt(words, tag), MAX_TOKENS)
        ids = kp.tokenize(body)
        lo, hi = blocks * BLOCK_SIZE + 8, (blocks + 1) * BLOCK_SIZE - MAX_TOKENS - 8
        if lo <= len(ids) <= hi:
            return body, ids
        words += 12 if len(ids) < lo else -12
    raise AssertionError(f"no prompt of {blocks} full blocks found (last: {len(ids)} tokens, {words} words)")


def cached_tokens(body: dict[str, Any]) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` of a response (``--enable-prompt-tokens-details``)."""
    details = (body.get("usage") or {}).get("prompt_tokens_details")
    assert isinstance(details, dict), f"no usage.prompt_tokens_details in {body.get('usage')!r}"
    return int(details["cached_tokens"])


@pytest.fixture(scope="module")
def kv_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvPair]:
    pair = own_pair(tmp_path_factory, "kvevents", kv_events=True)
    try:
        with httpx.Client(timeout=120.0) as client:
            yield KvPair(pair, client)
    finally:
        pair.stop()


@pytest.fixture(scope="module")
def index() -> PrefixIndex:
    return PrefixIndex(BLOCK_SIZE, max_blocks=100_000)


@pytest.fixture(scope="module")
def subscriber(kv_pair: KvPair, index: PrefixIndex) -> Iterator[RecordingSubscriber]:
    """Subscribed to P and D, and known to receive from both: ZMQ drops what a PUB sends before
    the SUB has joined, so warm-up requests (their own prompts) go out until both were heard."""
    sub = kv_pair.subscriber(index)

    def heard_both() -> bool:
        body, _ = prompt_with_full_blocks(kv_pair, 1, "warm")
        pc.two_step(kv_pair.client, kv_pair.pair.prefill.url, kv_pair.pair.decode.url, "completions", body)
        return sub.counts.messages[kv_pair.p] > 0 and sub.counts.messages[kv_pair.d] > 0

    try:
        wait_until("KV events from both P and D", heard_both, timeout_s=120, every_s=0.5)
        yield sub
    finally:
        sub.stop()


def test_real_events_decode_into_the_index(
    kv_pair: KvPair, index: PrefixIndex, subscriber: RecordingSubscriber
) -> None:
    body, ids = prompt_with_full_blocks(kv_pair, 2, "decode")
    keys = chain_keys(ids, BLOCK_SIZE)
    assert len(keys) == 2
    first = len(subscriber.decoded)
    pc.two_step(kv_pair.client, kv_pair.pair.prefill.url, kv_pair.pair.decode.url, "completions", body)
    wait_until(
        "P and D to hold the prompt's two blocks",
        lambda: kv_pair.match(index, ids),
        done=lambda m: m[kv_pair.p] == m[kv_pair.d] == 2 * BLOCK_SIZE,
        timeout_s=EVENT_WAIT_S,
    )
    # The events themselves: 128-token blocks carrying the prompt's own token ids, from both.
    stored = [
        (inst, ev)
        for inst, msg in subscriber.decoded[first:]
        for ev in msg.batch.events
        if isinstance(ev, BlockStored)
    ]
    for name in (kv_pair.p, kv_pair.d):
        mine = [ev for inst, ev in stored if inst == name]
        assert mine, f"no BlockStored from {name}"
        assert {ev.block_size for ev in mine} == {BLOCK_SIZE}
        blocks = {
            ev.token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
            for ev in mine
            for i in range(len(ev.block_hashes))
        }
        for b in range(2):
            assert tuple(ids[b * BLOCK_SIZE : (b + 1) * BLOCK_SIZE]) in blocks, (
                f"{name}'s BlockStored events do not carry block {b} of the prompt's token ids"
            )
    c = subscriber.counts
    assert not c.dropped and not sum(c.skipped_events.values()) and not c.loop_errors
    assert not c.gaps and not c.restarts


def test_repeated_prompt_predicted_with_the_tokens_vllm_reuses(
    kv_pair: KvPair, index: PrefixIndex, subscriber: RecordingSubscriber
) -> None:
    body, ids = prompt_with_full_blocks(kv_pair, 2, "repeat")
    client, p_url, d_url = kv_pair.client, kv_pair.pair.prefill.url, kv_pair.pair.decode.url
    assert kv_pair.match(index, ids) == {kv_pair.p: 0, kv_pair.d: 0}
    first, _ = pc.two_step(client, p_url, d_url, "completions", body)
    assert first.body["usage"]["prompt_tokens"] == len(ids)
    assert cached_tokens(first.body) == 0
    predicted = wait_until(
        "the index to hold the prompt on P and D",
        lambda: kv_pair.match(index, ids),
        done=lambda m: m[kv_pair.p] > 0 and m[kv_pair.d] > 0,
        timeout_s=EVENT_WAIT_S,
    )
    before = pc.scrape(client, p_url)
    second, _ = pc.two_step(client, p_url, d_url, "completions", body)
    after = pc.scrape(client, p_url)
    reported = cached_tokens(second.body)
    hits = after.value("vllm:prefix_cache_hits_total") - before.value("vllm:prefix_cache_hits_total")
    queries = after.value("vllm:prefix_cache_queries_total") - before.value("vllm:prefix_cache_queries_total")
    assert queries == len(ids)
    assert predicted[kv_pair.p] == reported == hits == 2 * BLOCK_SIZE, (predicted, reported, hits)
    # D pulled the prompt over NIXL and cached what it received: the same blocks.
    assert predicted[kv_pair.d] == 2 * BLOCK_SIZE


def test_pdscope_tokenizer_keys_prompts_as_vllm_caches_them(
    kv_pair: KvPair, index: PrefixIndex, subscriber: RecordingSubscriber
) -> None:
    """``model.tokenizer`` pointed at the model's directory gives vLLM's own ids, for a completion and
    for a chat (its template rendered by pdscope), so the precise view's keys are the events' keys."""
    from proxy.tokenize import load_tokenizer

    tok = load_tokenizer(str(kv_pair.pair.env_dir / "tiny-llama"))
    completion, completion_ids = prompt_with_full_blocks(kv_pair, 2, "tok")
    assert tok.ids("/v1/completions", completion) == completion_ids
    chat = pc.request_body("chat", completion["prompt"], MAX_TOKENS)
    chat_ids = kv_pair.tokenize(chat)
    assert tok.ids("/v1/chat/completions", chat) == chat_ids
    assert len(chat_ids) >= 2 * BLOCK_SIZE
    first, _ = pc.two_step(kv_pair.client, kv_pair.pair.prefill.url, kv_pair.pair.decode.url, "chat", chat)
    assert first.body["usage"]["prompt_tokens"] == len(chat_ids)
    wait_until(
        "P's events to hold the chat's blocks under the keys of pdscope's ids",
        lambda: kv_pair.match(index, chat_ids)[kv_pair.p],
        done=lambda n: n == (len(chat_ids) // BLOCK_SIZE) * BLOCK_SIZE,
        timeout_s=EVENT_WAIT_S,
    )


def test_recovery_after_the_subscriber_restarts(
    kv_pair: KvPair, index: PrefixIndex, subscriber: RecordingSubscriber
) -> None:
    client, p_url, d_url = kv_pair.client, kv_pair.pair.prefill.url, kv_pair.pair.decode.url
    subscriber.stop()
    missed_body, missed = prompt_with_full_blocks(kv_pair, 2, "missed")
    pc.two_step(client, p_url, d_url, "completions", missed_body)
    assert kv_pair.match(index, missed)[kv_pair.p] == 0

    # 1. A fresh subscriber and index (a restarted proxy): before the first message it hears from an
    # instance it replays what that instance's buffer holds, so it learns the prompt it missed.
    fresh_index = PrefixIndex(BLOCK_SIZE, max_blocks=100_000)
    fresh = kv_pair.subscriber(fresh_index)
    nonce = uuid.uuid4().hex[:8]
    try:

        def sent_and_indexed() -> bool:
            """Send a new prompt; True once the fresh index holds one on P (it is listening then)."""
            body, ids = prompt_with_full_blocks(kv_pair, 1, f"join-{nonce}-{uuid.uuid4().hex[:4]}")
            pc.two_step(client, p_url, d_url, "completions", body)
            try:
                wait_until(
                    "one new prompt in the fresh index",
                    lambda: kv_pair.match(fresh_index, ids)[kv_pair.p],
                    timeout_s=5,
                )
            except AssertionError:
                return False  # published before the SUB had joined: send another
            return True

        wait_until("the fresh subscriber to be listening", sent_and_indexed, timeout_s=120, every_s=0.2)
        assert fresh.counts.replays[(kv_pair.p, "catch_up")] == 1, fresh.counts
        assert not fresh.counts.gaps[kv_pair.p] and not fresh.counts.rebuilds[kv_pair.p]
        assert kv_pair.match(fresh_index, missed)[kv_pair.p] == 2 * BLOCK_SIZE
        second, _ = pc.two_step(client, p_url, d_url, "completions", missed_body)
        assert cached_tokens(second.body) == 2 * BLOCK_SIZE  # what the index predicted, vLLM reused
    finally:
        fresh.stop()

    # 2. A subscriber that resumes the old one's sequences (and index) sees the gap on the next
    # message and replays the missed ones from vLLM's replay socket.
    missed2_body, missed2 = prompt_with_full_blocks(kv_pair, 2, "missed2")
    pc.two_step(client, p_url, d_url, "completions", missed2_body)
    resumed = RecordingSubscriber(kv_pair.sources(), index, kv_pair.lock)
    resumed.seq = subscriber.seq
    resumed.start()
    try:

        def replayed() -> int:
            body, _ = prompt_with_full_blocks(kv_pair, 1, f"after-{nonce}")
            pc.two_step(client, p_url, d_url, "completions", body)
            return resumed.counts.replays[(kv_pair.p, "ok")]

        wait_until("a replay from P", replayed, timeout_s=120, every_s=0.5)
        assert resumed.counts.gaps[kv_pair.p] >= 1
        assert not resumed.counts.replays[(kv_pair.p, "failed")]
        assert not resumed.counts.rebuilds[kv_pair.p]
        got = kv_pair.match(index, missed2)
        assert got[kv_pair.p] == 2 * BLOCK_SIZE, (got, kv_pair.logs())
        assert kv_pair.match(index, missed)[kv_pair.p] == 2 * BLOCK_SIZE
    finally:
        resumed.stop()
