"""KV events into the prefix index: real ZMQ sockets (PUB, and ROUTER for replays), and every way a
stream goes wrong -- garbage, gaps with and without a replay, a publisher that restarts."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import zmq

from pdscope.kvevents import END_SEQ, MAX_PAYLOAD_BYTES, Batch, BlockStored, encode_batch, encode_message
from proxy import kvsubscriber
from proxy.kvindex import PrefixIndex, chain_keys
from proxy.kvsubscriber import KvEventsSubscriber, Source
from tests.support.sockets import free_port
from tests.support.waiting import wait_until

BS = 4


def block(i: int, parent: int | None = None) -> Batch:
    """Block ``i``: tokens 4i..4i+3, hash i, chained to ``parent``."""
    return Batch(float(i), (BlockStored((i,), parent, tuple(range(4 * i, 4 * i + 4)), BS),))


def prompt(n_blocks: int) -> list[int]:
    return list(range(4 * n_blocks))


def make(replay: str | None = None) -> tuple[KvEventsSubscriber, PrefixIndex]:
    index = PrefixIndex(BS, 10_000)
    sub = KvEventsSubscriber([Source("p0", "tcp://127.0.0.1:9", replay)], index, threading.Lock())
    return sub, index


def settle(sub: KvEventsSubscriber) -> None:
    """Drive the subscriber's poll (no thread in these tests) until no replay runs."""

    def ended() -> bool:
        sub.step(20)
        return not sub.replays.by_instance

    wait_until("the replays to end", ended, timeout_s=30, every_s=0)


def cached(index: PrefixIndex, n_blocks: int) -> int:
    return index.match(chain_keys(prompt(n_blocks), BS)).get("p0", 0)


def test_a_chain_published_message_by_message_is_indexed() -> None:
    sub, index = make()
    sub.receive("p0", encode_message("", 0, block(0)))
    for i in range(1, 4):
        sub.receive("p0", encode_message("", i, block(i, parent=i - 1), "map" if i % 2 else "array"))
    assert cached(index, 4) == 16 and sub.counts.messages["p0"] == 4


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"", b"\x00" * 8], "frames"),
        ([b"", b"\x00", encode_batch(block(0))], "seq"),
        ([b"", b"\x00" * 8, b"\xc1garbage"], "msgpack"),
        ([b"", b"\x00" * 8, encode_batch(block(0))[:-4]], "msgpack"),
    ],
)
def test_garbage_is_dropped_and_counted_by_reason(frames: list[bytes], reason: str) -> None:
    sub, index = make()
    sub.receive("p0", frames)
    assert sub.counts.dropped[("p0", reason)] == 1 and len(index) == 0


def test_a_gap_without_replay_forgets_the_instance_and_rebuilds() -> None:
    sub, index = make()
    for i in range(3):
        sub.receive("p0", encode_message("", i, block(i, i - 1 if i else None)))
    assert cached(index, 3) == 12
    sub.receive("p0", encode_message("", 7, block(7, parent=None)))  # 3..6 lost
    assert sub.counts.gaps["p0"] == 1 and sub.counts.missed["p0"] == 4 and sub.counts.rebuilds["p0"] == 1
    assert cached(index, 3) == 0 and index.blocks("p0") == 1  # only what came after the gap


def test_a_publisher_that_restarts_its_sequence_starts_an_empty_cache() -> None:
    sub, index = make()
    for i in range(5, 8):
        sub.receive("p0", encode_message("", i, block(i - 5, i - 6 if i > 5 else None)))
    sub.receive("p0", encode_message("", 0, block(0)))
    assert sub.counts.restarts["p0"] == 1 and index.blocks("p0") == 1


def test_a_duplicate_is_dropped() -> None:
    sub, _ = make()
    sub.receive("p0", encode_message("", 0, block(0)))
    sub.receive("p0", encode_message("", 0, block(0)))
    assert sub.counts.dropped[("p0", "duplicate")] == 1


@pytest.fixture
def replay_server() -> Iterator[tuple[str, dict[int, bytes], list[int]]]:
    """A ROUTER socket answering replays from ``buffer`` as vLLM's publisher does (``asked``: the starts)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    buffer: dict[int, bytes] = {}
    asked: list[int] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not sock.poll(50):
                continue
            client, _, start = sock.recv_multipart()
            first = int.from_bytes(start, "big", signed=True)
            asked.append(first)
            for seq in sorted(buffer):
                if seq >= first:
                    sock.send_multipart([client, b"", seq.to_bytes(8, "big", signed=True), buffer[seq]])
            sock.send_multipart([client, b"", END_SEQ.to_bytes(8, "big", signed=True), b""])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield f"tcp://127.0.0.1:{port}", buffer, asked
    stop.set()
    t.join(2)
    sock.close(0)


def test_a_gap_is_replayed_from_the_replay_socket(
    replay_server: tuple[str, dict[int, bytes], list[int]],
) -> None:
    url, buffer, asked = replay_server
    sub, index = make(replay=url)
    for i in range(6):
        buffer[i] = encode_batch(block(i, i - 1 if i else None))
    sub.receive("p0", encode_message("", 0, block(0)))
    sub.receive("p0", encode_message("", 1, block(1, 0)))
    sub.receive("p0", encode_message("", 5, block(5, 4)))  # 2..4 lost, and replayed
    settle(sub)
    assert asked == [2] and sub.counts.replays[("p0", "ok")] == 1
    assert sub.counts.rebuilds["p0"] == 0 and cached(index, 6) == 24


def test_a_replay_that_cannot_give_the_gap_rebuilds(
    replay_server: tuple[str, dict[int, bytes], list[int]],
) -> None:
    url, buffer, _ = replay_server
    sub, index = make(replay=url)
    assert len(index) == 0
    buffer[3] = encode_batch(block(3, 2))  # 2 is gone from the publisher's buffer too
    sub.receive("p0", encode_message("", 0, block(0)))
    sub.receive("p0", encode_message("", 1, block(1, 0)))
    sub.receive("p0", encode_message("", 4, block(4, 3)))
    settle(sub)
    assert sub.counts.replays[("p0", "failed")] == 1 and sub.counts.rebuilds["p0"] == 1


def test_a_replay_socket_that_does_not_answer_rebuilds_within_the_timeout() -> None:
    sub, _ = make(replay=f"tcp://127.0.0.1:{free_port()}")
    sub.receive("p0", encode_message("", 0, block(0)))
    sub.receive("p0", encode_message("", 3, block(3)))
    settle(sub)
    assert sub.counts.replays[("p0", "failed")] == 1 and sub.counts.rebuilds["p0"] == 1


def test_the_thread_reads_a_real_publisher() -> None:
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = PrefixIndex(BS, 10_000)
    lock = threading.Lock()
    sub = KvEventsSubscriber([Source("p0", f"tcp://127.0.0.1:{port}", None, "kv")], index, lock)
    sub.start()
    try:
        seq = 0

        def published_and_seen() -> bool:
            nonlocal seq
            # a SUB socket misses what was sent before it joined: send until one arrives
            pub.send_multipart(encode_message("kv", seq, block(seq % 50)))
            pub.send_multipart(encode_message("other-topic", 0, block(99)))  # filtered out
            seq += 1
            return sub.counts.messages["p0"] > 0

        wait_until("the subscriber to join", published_and_seen, timeout_s=30, every_s=0.05)
        with lock:
            assert index.blocks("p0") >= 1
        assert sub.alive and sub.counts.loop_errors == 0
        assert all(inst == "p0" for inst in sub.counts.messages)
        sub.stop()
        assert not sub.alive
        heard = sub.counts.messages["p0"]
        sub.start()  # again, after a stop: a new thread that reads on
        wait_until(
            "the restarted subscriber to read",
            lambda: published_and_seen() and sub.counts.messages["p0"] > heard,
            timeout_s=30,
            every_s=0.05,
        )
        assert sub.alive
    finally:
        sub.stop()
        pub.close(0)
    assert not sub.alive


def test_the_queue_bound_is_each_socket_s_high_water_mark() -> None:
    sub = KvEventsSubscriber(
        [Source("p0", "tcp://127.0.0.1:9")], PrefixIndex(BS, 10), threading.Lock(), queue_max=7
    )
    sockets = sub._sockets()
    try:
        assert [s.getsockopt(zmq.RCVHWM) for s in sockets] == [7]
    finally:
        for s in sockets:
            s.close(0)


def test_a_message_for_an_instance_not_configured_is_counted_and_dropped() -> None:
    sub, index = make()
    sub.receive("elsewhere", encode_message("", 0, block(0)))
    assert sub.counts.dropped[("elsewhere", "unknown_instance")] == 1
    assert len(index) == 0 and sub.counts.messages["elsewhere"] == 0


def test_the_first_message_heard_is_preceded_by_what_the_buffer_holds(
    replay_server: tuple[str, dict[int, bytes], list[int]],
) -> None:
    """A proxy that starts (or restarts) while the instance already holds blocks learns them from
    the replay buffer before the first message it hears, not only what is stored afterwards."""
    url, buffer, asked = replay_server
    sub, index = make(replay=url)
    for i in range(5):
        buffer[i] = encode_batch(block(i, i - 1 if i else None))
    sub.receive("p0", encode_message("", 5, block(5, 4)))
    settle(sub)
    assert asked == [0] and sub.counts.replays[("p0", "catch_up")] == 1
    assert cached(index, 6) == 24 and sub.counts.gaps["p0"] == 0 and sub.counts.rebuilds["p0"] == 0


def test_a_catch_up_applies_only_the_run_that_ends_just_before_the_first_message(
    replay_server: tuple[str, dict[int, bytes], list[int]],
) -> None:
    """The buffer has rolled past the chain's start, and has a hole: only the contiguous tail is
    applied, and blocks whose parents it never saw are orphans (no credit), never a false hit."""
    url, buffer, _ = replay_server
    sub, index = make(replay=url)
    buffer[1] = encode_batch(block(1, 0))  # 0 is gone; 1 is before the hole at 2
    buffer[3] = encode_batch(block(10))  # a new root chain, stored after the hole
    buffer[4] = encode_batch(block(11, 10))
    sub.receive("p0", encode_message("", 5, block(12, 11)))
    settle(sub)
    assert sub.counts.replays[("p0", "catch_up")] == 1
    assert index.blocks("p0") == 3  # 10, 11, 12; not 1 (before the hole)
    chain = list(range(40, 52))  # block 10's tokens, then 11's and 12's
    assert index.match(chain_keys(chain, BS)).get("p0") == 12
    assert cached(index, 2) == 0


def test_a_catch_up_that_fails_starts_from_the_first_message() -> None:
    sub, index = make(replay=f"tcp://127.0.0.1:{free_port()}")  # nothing answers
    sub.receive("p0", encode_message("", 9, block(0)))
    settle(sub)
    assert sub.counts.replays[("p0", "failed")] == 1 and index.blocks("p0") == 1


@pytest.fixture
def silent_replay() -> Iterator[tuple[str, zmq.Socket[bytes]]]:
    """A ROUTER replay socket that takes the question and never answers."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}", sock
    sock.close(0)


def _publish_until(pub: zmq.Socket[bytes], frames: list[bytes], seen: Callable[[], bool]) -> None:
    """A SUB socket misses what was sent before it joined: send until the subscriber has it."""

    def sent_and_seen() -> bool:
        pub.send_multipart(frames)
        return seen()

    wait_until("the subscriber to read it", sent_and_seen, timeout_s=30, every_s=0.05)


def test_a_silent_replay_on_one_instance_never_delays_another_s_events(
    silent_replay: tuple[str, zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's gap is asked of a replay socket that never answers; B's events are applied while A's
    replay is still pending (was: the one thread waited out A's replay before reading B)."""
    monkeypatch.setattr(kvsubscriber, "REPLAY_TIMEOUT_S", 120.0)  # A's replay outlives the test
    url, router = silent_replay
    ctx = zmq.Context.instance()
    pubs = {name: ctx.socket(zmq.PUB) for name in ("A", "B")}
    ports = {name: pub.bind_to_random_port("tcp://127.0.0.1") for name, pub in pubs.items()}
    index, lock = PrefixIndex(BS, 10_000), threading.Lock()
    sub = KvEventsSubscriber(
        [Source("A", f"tcp://127.0.0.1:{ports['A']}", url), Source("B", f"tcp://127.0.0.1:{ports['B']}")],
        index,
        lock,
    )
    sub.start()
    try:
        _publish_until(pubs["A"], encode_message("", 0, block(0)), lambda: sub.counts.messages["A"] > 0)
        pubs["A"].send_multipart(encode_message("", 5, block(5)))  # 1..4 lost: A's replay is asked
        wait_until("A's replay to be asked", lambda: router.poll(0), timeout_s=30)
        with lock:
            b_before = index.blocks("B")
        assert b_before == 0
        _publish_until(pubs["B"], encode_message("", 0, block(7)), lambda: sub.counts.messages["B"] > 0)
        wait_until("B's event applied", lambda: index.blocks("B") == 1, timeout_s=30)
        assert "A" in sub.replays.by_instance and sub.counts.replays[("A", "failed")] == 0
        assert "A" in index.stale and "B" not in index.stale  # A's view has a hole: no credit meanwhile
        assert index.blocks("A") == 1  # A's own message after the gap waits for its replay
    finally:
        sub.stop()
        for pub in pubs.values():
            pub.close(0)


def test_a_message_over_the_size_bound_never_arrives_and_is_counted() -> None:
    """17 MiB where the bound is 16 MiB: ZMQ cuts the connection before reading it (MAXMSGSIZE);
    it is never decoded (was: received whole, then dropped as ``size``), and the cut is counted."""
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index, lock = PrefixIndex(BS, 10_000), threading.Lock()
    sub = KvEventsSubscriber([Source("p0", f"tcp://127.0.0.1:{port}")], index, lock)
    sub.start()
    try:
        _publish_until(pub, encode_message("", 0, block(0)), lambda: sub.counts.messages["p0"] > 0)
        assert sub.counts.dropped[("p0", "disconnected")] == 0
        pub.send_multipart([b"", (1).to_bytes(8, "big"), b"\x00" * (MAX_PAYLOAD_BYTES + 2**20)])
        wait_until("the cut", lambda: sub.counts.dropped[("p0", "disconnected")] >= 1, timeout_s=30)
        # the publisher is read again after ZMQ reconnects; the oversized message never arrived
        _publish_until(pub, encode_message("", 2, block(1)), lambda: sub.counts.gaps["p0"] > 0)
        assert sub.counts.dropped[("p0", "size")] == 0  # seq 1 never arrived: it shows as a gap
        assert sub.counts.missed["p0"] == 1 and sub.counts.loop_errors == 0
    finally:
        sub.stop()
        pub.close(0)


def test_a_failed_replay_is_not_asked_again_until_its_backoff_ends() -> None:
    """Nothing answers: the first gap's replay fails; the next gap, within the backoff, is not asked
    (counted ``backoff``; rebuilt at once); after the backoff it is asked again."""
    now = [0.0]
    index = PrefixIndex(BS, 10_000)
    sub = KvEventsSubscriber(
        [Source("p0", "tcp://127.0.0.1:9", f"tcp://127.0.0.1:{free_port()}")],
        index,
        threading.Lock(),
        replay_timeout_s=0.05,
        monotonic=lambda: now[0],
    )
    sub.receive("p0", encode_message("", 0, block(0)))
    sub.receive("p0", encode_message("", 3, block(3)))
    now[0] += 1.0  # past the replay's deadline
    settle(sub)
    assert sub.counts.replays[("p0", "failed")] == 1 and sub.counts.rebuilds["p0"] == 1
    sub.receive("p0", encode_message("", 6, block(6)))  # within the backoff (1 s)
    assert sub.counts.replays[("p0", "backoff")] == 1 and sub.counts.rebuilds["p0"] == 2
    assert not sub.replays.by_instance
    now[0] += 1.5
    sub.receive("p0", encode_message("", 9, block(9)))
    assert "p0" in sub.replays.by_instance
    sub.replays.close()


def test_messages_held_during_a_replay_are_bounded_and_counted() -> None:
    sub = KvEventsSubscriber(
        [Source("p0", "tcp://127.0.0.1:9", f"tcp://127.0.0.1:{free_port()}")],
        PrefixIndex(BS, 10_000),
        threading.Lock(),
        queue_max=3,
    )
    sub.receive("p0", encode_message("", 0, block(0)))
    for seq in range(5, 12):  # the gap's replay runs (nothing answers): these are held
        sub.receive("p0", encode_message("", seq, block(seq)))
    assert len(sub.replays.by_instance["p0"].held) == 3
    assert sub.counts.dropped[("p0", "held_overflow")] == 4
    sub.replays.close()
