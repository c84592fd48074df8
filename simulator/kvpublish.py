"""One simulated instance's KV cache events on ZMQ, in vLLM's wire format (``ZmqEventPublisher``).

A PUB socket bound at the instance's ``kv_events_endpoint`` sends each engine step's events as
one message ``[topic, seq (8 bytes big-endian), msgpack EventBatch]`` encoded by
``pdscope.kvevents.encode_message`` (an array-like batch of tagged-map events, as vLLM 0.32's msgspec
structs encode), ``seq`` counting
from 0. The last ``buffer_steps`` messages are kept in a ring; with a ``replay_endpoint`` a ROUTER
socket answers a request ``[start seq (8 bytes big-endian)]`` (from a DEALER: ``[b"", start]``) with
every kept message from ``start`` on, each ``[b"", topic, seq, payload]``, then ``[b"", END_SEQ,
b""]``, as vLLM's replay socket does.

Publishing never blocks the engine loop: the PUB send is NOBLOCK, and a send that fails is
counted in ``dropped`` (a PUB socket itself drops silently for a subscriber past its high-water
mark; the subscriber sees that as a gap in ``seq`` and asks the replay socket). The replay socket
is served by its own daemon thread (the ring is shared under a lock); a malformed replay request
is counted in ``bad_requests`` and answered with nothing. The endpoints may use port ``*`` (a free
port); ``endpoint`` / ``replay_endpoint`` are then the bound ones.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import zmq

from pdscope.kvevents import END_SEQ, Batch, Event, encode_message

logger = logging.getLogger(__name__)

BUFFER_STEPS = 10_000  # vLLM KVEventsConfig.buffer_steps
SND_HWM = 100_000  # vLLM KVEventsConfig.hwm
POLL_MS = 100


class KvEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        buffer_steps: int = BUFFER_STEPS,
        hwm: int = SND_HWM,
        dp_rank: int | None = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.topic = topic
        self.dp_rank = dp_rank
        self.clock = clock
        self.seq = 0
        self.sent = 0
        self.dropped = 0
        self.bad_requests = 0
        self.replays = 0
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._router: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        try:
            self._pub.bind(endpoint)
            self.endpoint = _bound(self._pub)
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                router: zmq.Socket[bytes] = self._ctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                router.setsockopt(zmq.SNDHWM, buffer_steps + 16)  # a whole replay fits
                self._router = router
                router.bind(replay_endpoint)
                self.replay_endpoint = _bound(router)
        except zmq.ZMQError:
            self.close()
            raise
        if self._router is not None:
            # the ROUTER is used by the replay thread only from here on
            self._thread = threading.Thread(target=self._serve, name=f"kv-replay-{topic}", daemon=True)
            self._thread.start()

    # -- publishing (the engine loop) ------------------------------------------------------

    def publish(self, events: Sequence[Event]) -> None:
        """Send one step's events as one message; never blocks, never raises."""
        if not events:
            return
        seq = self.seq
        self.seq += 1
        try:
            frames = encode_message(self.topic, seq, Batch(self.clock(), tuple(events), self.dp_rank), "vllm")
        except (ValueError, TypeError, OverflowError):
            self.dropped += 1
            logger.exception("kv events: could not encode a batch of %d event(s)", len(events))
            return
        with self._lock:
            self._ring.append((seq, frames[2]))
        try:
            self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
            self.sent += 1
        except zmq.ZMQError:  # Again (high-water mark) or a closed socket: counted, never raised
            self.dropped += 1

    # -- replay (its own thread) -----------------------------------------------------------

    def replay_from(self, start: int) -> list[tuple[int, bytes]]:
        """The kept messages from ``start`` on, oldest first."""
        with self._lock:
            return [(s, p) for s, p in self._ring if s >= start]

    def _serve(self) -> None:
        router = self._router
        assert router is not None
        while not self._stop.is_set():
            try:
                if not router.poll(POLL_MS):
                    continue
                frames = router.recv_multipart(zmq.NOBLOCK)
                self._answer(router, frames)
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:
                if self._stop.is_set() or exc.errno == zmq.ENOTSOCK:
                    return
                logger.warning("kv events: replay socket error: %s", exc)
                self._stop.wait(0.1)
            except Exception:  # a bug must not end the thread silently
                logger.exception("kv events: the replay thread failed; going on")
                self._stop.wait(0.1)

    def _answer(self, router: zmq.Socket[bytes], frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.bad_requests += 1
            return
        client = frames[0]
        start = int.from_bytes(frames[2], "big", signed=True)
        topic = self.topic.encode()
        for seq, payload in self.replay_from(start):
            router.send_multipart([client, b"", topic, seq.to_bytes(8, "big", signed=True), payload])
        router.send_multipart([client, b"", END_SEQ.to_bytes(8, "big", signed=True), b""])
        self.replays += 1

    # -- life ------------------------------------------------------------------------------

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * POLL_MS / 1000 + 1.0)
            self._thread = None
        if self._router is not None:
            self._router.close(0)
            self._router = None
        self._pub.close(0)


def _bound(sock: zmq.Socket[bytes]) -> str:
    raw = sock.getsockopt(zmq.LAST_ENDPOINT)
    return raw.decode() if isinstance(raw, bytes) else str(raw)
