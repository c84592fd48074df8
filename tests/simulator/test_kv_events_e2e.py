"""A simulated instance's KV events on the wire: a plain SUB and the replay ROUTER read them with the
decoder real vLLM's events pass, and the proxy's index built from them agrees with the engine."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import zmq

from pdscope import simtokenizer
from pdscope.kvevents import (
    END_SEQ,
    AllBlocksCleared,
    BlockStored,
    Message,
    decode_batch,
    decode_message,
    decode_seq,
)
from proxy.kvindex import PrefixIndex, chain_keys
from proxy.kvsubscriber import KvEventsSubscriber, Source
from simulator.admin import MAX_QUERY_TOKENS, parse_cached_query
from simulator.testing import RunningFleet, running_fleet
from tests.support.waiting import wait_until

BS = 16
PROMPT = " ".join(f"word{i % 37}" for i in range(100))  # 100 tokens: 6 full blocks


@pytest.fixture(scope="module")
def fleet() -> Iterator[RunningFleet]:
    with running_fleet(1, 1, seed=3, latency_scale=0.0, kv_events=True, block_size=BS) as f:
        yield f


@pytest.fixture()
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=20) as c:
        yield c


def complete(client: httpx.Client, url: str, prompt: str, model: str) -> dict[str, Any]:
    r = client.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


class Sub:
    """A plain ZMQ SUB on one instance's endpoint, joined (its first message seen) before use."""

    _probe = itertools.count()

    def __init__(self, fleet: RunningFleet, client: httpx.Client, name: str) -> None:
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(fleet.kv_events[name][0])
        url, model = fleet.url_of(name), fleet.model_name

        def joined() -> bool:  # PUB drops what it sends before the subscription arrives: probe until seen
            complete(client, url, " ".join(f"probe{next(self._probe)}-{i}" for i in range(BS)), model)
            return bool(self.sock.poll(100))

        wait_until("the SUB socket to receive", joined, timeout_s=10)
        self.drain()

    def recv(self, timeout_ms: int = 2000) -> Message | None:
        if not self.sock.poll(timeout_ms):
            return None
        return decode_message(self.sock.recv_multipart())

    def drain(self) -> list[Message]:
        out = []
        while (m := self.recv(200)) is not None:
            out.append(m)
        return out

    def close(self) -> None:
        self.sock.close(0)


def stored(messages: list[Message]) -> list[BlockStored]:
    return [e for m in messages for e in m.batch.events if isinstance(e, BlockStored)]


def test_events_carry_the_prompt_blocks_and_a_repeat_stores_nothing(
    fleet: RunningFleet, client: httpx.Client
) -> None:
    sub = Sub(fleet, client, "prefill-0")
    try:
        url, model = fleet.url_of("prefill-0"), fleet.model_name
        ids = simtokenizer.text_ids(PROMPT)
        first = complete(client, url, PROMPT, model)
        got = sub.drain()
        blocks = stored(got)
        assert [t for e in blocks for t in e.token_ids] == ids[: 6 * BS]
        assert blocks[0].parent is None and all(e.block_size == BS and e.medium == "GPU" for e in blocks)
        assert all(b.parent == a.block_hashes[-1] for a, b in itertools.pairwise(blocks))
        seqs = [m.seq for m in got]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # one message per step, counted
        second = complete(client, url, PROMPT, model)
        assert stored(sub.drain()) == []  # all full blocks were already cached
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 96}
    finally:
        sub.close()


def test_the_proxy_index_built_from_the_events_agrees_with_the_engine(
    fleet: RunningFleet, client: httpx.Client
) -> None:
    """The proxy's own subscriber and index, fed by the simulator's socket, credit what the engine has."""
    index = PrefixIndex(BS, 100_000)
    lock = threading.Lock()
    name = "decode-0"
    endpoint, replay, topic = fleet.kv_events[name]
    sub = KvEventsSubscriber([Source(name, endpoint, replay, topic)], index, lock)
    sub.start()
    try:
        url, model = fleet.url_of(name), fleet.model_name
        probe = itertools.count()

        def joined() -> bool:
            complete(client, url, " ".join(f"join{next(probe)}-{i}" for i in range(BS)), model)
            return sub.counts.messages[name] > 0

        wait_until("the subscriber to receive", joined, timeout_s=10)
        prompt = " ".join(f"shared{i}" for i in range(80)) + " tail a b c d e f g h"
        ids = simtokenizer.text_ids(prompt)
        complete(client, url, prompt, model)
        truth = fleet.cached_tokens(ids)[name]
        assert truth == 80  # 88 tokens: 5 full blocks

        def credited() -> int:
            with lock:
                return index.match(chain_keys(ids, BS)).get(name, 0)

        assert wait_until("the index to credit the prompt", credited, done=lambda n: n == truth) == truth
        r = client.post(fleet.admin_url + "/admin/cached_tokens", json={"token_ids": ids})
        assert r.status_code == 200 and r.json() == {"instances": {"prefill-0": 0, name: truth}}
        assert sub.counts.dropped == {} and sub.counts.loop_errors == 0
    finally:
        sub.stop()


def replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        out = []
        for _ in range(20_000):
            assert sock.poll(5000), "no end of replay"
            frames = sock.recv_multipart()
            assert frames[0] == b""
            seq, payload = decode_seq(frames[-2]), frames[-1]
            if seq == END_SEQ:
                assert len(frames) == 3 and payload == b""
                return out
            assert len(frames) == 4  # [b"", topic, seq, payload]
            out.append((seq, payload))
        raise AssertionError("replay did not end")
    finally:
        sock.close(0)


def test_replay_answers_the_kept_messages_then_end_seq(fleet: RunningFleet, client: httpx.Client) -> None:
    name = "prefill-0"
    endpoint, replay_ep, _ = fleet.kv_events[name]
    assert replay_ep is not None
    complete(client, fleet.url_of(name), " ".join(f"replayed{i}" for i in range(40)), fleet.model_name)
    everything = replay(replay_ep, 0)
    seqs = [s for s, _ in everything]
    assert seqs and seqs == list(range(len(seqs)))  # nothing evicted from the ring yet: from 0, no gaps
    batches = [decode_batch(p) for _, p in everything]
    assert any(isinstance(e, BlockStored) for b in batches for e in b.events)
    tail = replay(replay_ep, seqs[-1])
    assert [s for s, _ in tail] == [seqs[-1]]
    assert replay(replay_ep, seqs[-1] + 100) == []
    # a malformed request is ignored; the socket goes on answering
    bad: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    bad.connect(replay_ep)
    bad.send_multipart([b"", b"short"])
    bad.close(0)
    assert [s for s, _ in replay(replay_ep, seqs[-1])] == [seqs[-1]]
    assert endpoint != replay_ep


def test_admin_cached_tokens_rejects_bad_bodies(fleet: RunningFleet, client: httpx.Client) -> None:
    url = fleet.admin_url + "/admin/cached_tokens"
    for body in (
        b"not json",
        b"[]",
        b'{"ids": [1]}',
        b'{"token_ids": "1 2"}',
        b'{"token_ids": [1, -2]}',
        b'{"token_ids": [true]}',
        b'{"token_ids": [1.5]}',
        b'{"token_ids": [1], "lora": 3}',
    ):
        r = client.post(url, content=body)
        assert r.status_code == 400, body
        assert r.json()["error"]
    assert client.post(url, json={"token_ids": []}).json() == {"instances": {"prefill-0": 0, "decode-0": 0}}
    with pytest.raises(ValueError, match="at most"):
        parse_cached_query(b'{"token_ids": [' + b"1," * MAX_QUERY_TOKENS + b"1]}")


def test_a_downed_instance_announces_its_cache_is_gone(fleet: RunningFleet, client: httpx.Client) -> None:
    name = "prefill-0"
    sub = Sub(fleet, client, name)
    try:
        prompt = " ".join(f"gone{i}" for i in range(40))
        ids = simtokenizer.text_ids(prompt)
        complete(client, fleet.url_of(name), prompt, fleet.model_name)
        assert fleet.cached_tokens(ids)[name] == 32
        sub.drain()
        fid = fleet.inject({"kind": "down", "instance": name})

        def cleared() -> bool:
            m = sub.recv(200)
            return m is not None and AllBlocksCleared() in m.batch.events

        wait_until("AllBlocksCleared from the downed instance", cleared, timeout_s=10)
        fleet.remove_fault(fid)

        def back() -> bool:
            try:
                return client.get(fleet.url_of(name) + "/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_until("the instance to come back", back, timeout_s=10)
        assert fleet.cached_tokens(ids)[name] == 0  # restarted with an empty cache
    finally:
        sub.close()
