"""Replays of missed KV event messages, one per instance, none waiting on another (non-blocking).

vLLM's publisher may run a ROUTER replay socket: a client sends the first sequence number it
wants (8 bytes big-endian) and gets back ``[(topic,) seq, payload]`` for each message its buffer
still holds from there, then ``seq = END_SEQ``. :class:`Replays` asks those questions for the KV
events subscriber (``proxy.kvsubscriber``) without ever waiting for an answer: it opens a
DEALER socket per replay, and the subscriber's one poll loop reads the answers of every replay
in flight next to the live SUB sockets. So an instance whose replay socket is silent, slow or
hostile delays only its own events: each replay has its own deadline (``timeout_s``), at most
``max_in_flight`` run at once (the others queue, first come first served), a replay brings back
at most ``max_messages`` messages, and every socket refuses a message over ``max_message_bytes``
(ZMQ ``MAXMSGSIZE``: the peer is disconnected before the bytes are read; the replay then ends at
its deadline).

An instance whose replay failed (silent, cut short, garbage) is not asked again until its
backoff has passed (``base_backoff_s``, doubled at each failure in a row, at most
``max_backoff_s``; a replay that succeeds resets it): meanwhile its gaps are not replayed and
the subscriber rebuilds its view instead. Here only sockets and bookkeeping: what a replay's
answer means (apply it, rebuild) is the subscriber's. Nothing here raises: a ZMQ error ends
that replay as failed. One thread (the subscriber's).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import zmq

from pdscope.kvevents import END_SEQ, BadMessage, Message, decode_seq

log = logging.getLogger(__name__)

Purpose = Literal["gap", "catch_up"]

TIMEOUT_S = 2.0
MAX_IN_FLIGHT = 4
MAX_MESSAGES = 10_000
MAX_HELD = 10_000  # live messages held back per instance while its replay runs
BASE_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0


@dataclass(eq=False)
class Replay:
    """One replay: the messages ``first``..``last`` of ``instance``, and what it brought back so far.

    ``held``: the live messages heard from the instance while the replay runs, applied after it
    (in order) whatever its outcome. ``outcome`` is None while it runs."""

    instance: str
    endpoint: str
    first: int
    last: int
    purpose: Purpose
    deadline: float = 0.0
    sock: zmq.Socket[bytes] | None = None  # None while queued
    got: list[tuple[int, bytes]] = field(default_factory=list)
    held: list[Message] = field(default_factory=list)
    outcome: Literal["ended", "failed"] | None = None
    why: str = ""


class Replays:
    """The replays in flight and queued, one per instance at most. Never blocks; never raises."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        *,
        max_message_bytes: int,
        timeout_s: float = TIMEOUT_S,
        max_in_flight: int = MAX_IN_FLIGHT,
        max_messages: int = MAX_MESSAGES,
        base_backoff_s: float = BASE_BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ctx = ctx
        self.max_message_bytes = max_message_bytes
        self.timeout_s, self.max_in_flight, self.max_messages = timeout_s, max_in_flight, max_messages
        self.base_backoff_s, self.max_backoff_s = base_backoff_s, max_backoff_s
        self.clock = clock
        self.by_instance: dict[str, Replay] = {}
        self._queued: deque[Replay] = deque()
        self._by_sock: dict[zmq.Socket[bytes], Replay] = {}
        self._failures: dict[str, int] = {}  # failures in a row, per instance
        self._retry_at: dict[str, float] = {}

    # -- asking -------------------------------------------------------------------------

    def backing_off(self, instance: str) -> bool:
        """True while ``instance``'s last replay failed less than its backoff ago."""
        return self.clock() < self._retry_at.get(instance, float("-inf"))

    def ask(self, instance: str, endpoint: str, first: int, last: int, purpose: Purpose) -> Replay:
        """Start (or queue, past ``max_in_flight``) a replay of ``first``..``last``. The caller checks
        that none runs for ``instance`` (:attr:`by_instance`) and that it is not backing off."""
        replay = Replay(instance, endpoint, first, last, purpose)
        self.by_instance[instance] = replay
        self._queued.append(replay)
        self._start_queued()
        return replay

    def _start_queued(self) -> None:
        while self._queued and len(self._by_sock) < self.max_in_flight:
            replay = self._queued.popleft()
            replay.deadline = self.clock() + self.timeout_s
            try:
                sock: zmq.Socket[bytes] = self.ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
                replay.sock = sock
                self._by_sock[sock] = replay
                sock.connect(replay.endpoint)
                sock.send_multipart([b"", replay.first.to_bytes(8, "big", signed=True)], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                self._end(replay, "failed", f"zmq: {exc}")

    # -- the poll loop's side -------------------------------------------------------------

    def sockets(self) -> list[zmq.Socket[bytes]]:
        return list(self._by_sock)

    def next_deadline(self) -> float | None:
        return min((r.deadline for r in self._by_sock.values()), default=None)

    def read(self, sock: zmq.Socket[bytes]) -> Replay | None:
        """Read what ``sock`` has (never waits); the replay when this ended it, else None."""
        replay = self._by_sock.get(sock)
        if replay is None:
            return None
        try:
            while replay.outcome is None:
                frames = sock.recv_multipart(zmq.NOBLOCK)
                seq, payload = _replayed(frames)
                if seq == END_SEQ:
                    self._end(replay, "ended", "")
                elif len(replay.got) >= self.max_messages:
                    self._end(replay, "failed", f"more than {self.max_messages} messages")
                elif replay.first <= seq <= replay.last:
                    replay.got.append((seq, payload))
        except zmq.Again:
            return None
        except (zmq.ZMQError, BadMessage) as exc:
            self._end(replay, "failed", str(exc)[:200])
        return replay

    def expired(self) -> list[Replay]:
        """The replays in flight whose deadline has passed, ended as failed."""
        now = self.clock()
        late = [r for r in self._by_sock.values() if r.deadline <= now]
        for replay in late:
            self._end(replay, "failed", f"no end of replay within {self.timeout_s:g}s")
        return late

    def _end(self, replay: Replay, outcome: Literal["ended", "failed"], why: str) -> None:
        replay.outcome, replay.why = outcome, why
        if replay.sock is not None:
            self._by_sock.pop(replay.sock, None)
            replay.sock.close(0)
            replay.sock = None
        if self.by_instance.get(replay.instance) is replay:
            del self.by_instance[replay.instance]
        if outcome == "failed":
            self.failed(replay.instance)
        self._start_queued()

    def failed(self, instance: str) -> None:
        """Count a failure of ``instance``'s replay (also one the caller found incomplete): backoff."""
        n = self._failures.get(instance, 0) + 1
        self._failures[instance] = n
        delay = min(self.max_backoff_s, self.base_backoff_s * 2 ** min(n - 1, 30))
        self._retry_at[instance] = self.clock() + delay
        log.info("kv events: replay from %s failed %d time(s) in a row: next in %.1fs", instance, n, delay)

    def succeeded(self, instance: str) -> None:
        self._failures.pop(instance, None)
        self._retry_at.pop(instance, None)

    def close(self) -> None:
        for replay in [*self._by_sock.values(), *self._queued]:
            if replay.sock is not None:
                replay.sock.close(0)
        self._by_sock.clear()
        self._queued.clear()
        self.by_instance.clear()


def _replayed(frames: list[bytes]) -> tuple[int, bytes]:
    """One replay answer as a DEALER receives it: ``[b"", (topic,) seq, payload]`` -- vLLM has sent it
    with and without the topic; the end is ``seq = END_SEQ`` with an empty payload."""
    parts = frames[1:] if frames and frames[0] == b"" else frames
    if len(parts) not in (2, 3):
        raise BadMessage("frames", f"replay answer of {len(frames)} frame(s)")
    return decode_seq(parts[-2]), parts[-1]
