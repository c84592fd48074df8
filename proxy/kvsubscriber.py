"""The KV events of every instance that publishes them, into the prefix index (one thread).

One ZMQ SUB socket per instance with a ``kv_events_endpoint`` (the topic filter its
``kv_events_topic``), polled by a single daemon thread that decodes each message
(``pdscope.kvevents``) and applies it to the :class:`proxy.kvindex.PrefixIndex` under the
index's lock. The proxy's event loop never waits on it: it only reads the index, under the
same lock, for a few microseconds per request.

Bounded: ZMQ keeps at most ``queue_max`` (``proxy.kv_aware.event_queue_max``) messages per
socket; a subscriber that falls behind loses the newest, which shows as a gap in the sequence. A gap with a
``kv_events_replay_endpoint`` is asked for again (the replay socket answers the missed messages,
then ``END_SEQ``), within ``REPLAY_TIMEOUT_S``; without one, or when the replay fails, the
instance's entries are forgotten and rebuilt from what it stores next (a cache pdscope only
partly knows would credit blocks vLLM has dropped). The first message heard from an instance
(a proxy that just started, or restarted) is preceded by a catch-up replay of what the
instance's buffer still holds before it, so a restarted proxy knows the blocks vLLM stored
before it subscribed, not only what it stores next. A publisher whose sequence restarts
lower has restarted with an empty cache: its entries are forgotten too. Every drop, gap,
replay and restart is counted per instance (:class:`Counts`), and so is a message for an
instance the subscriber was not configured with (dropped, reason ``unknown_instance``); nothing
here raises into the proxy, and a failure of the thread is logged and counted, and the thread
goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import zmq

from pdscope.kvevents import END_SEQ, BadMessage, SeqTracker, decode_batch, decode_message, decode_seq
from proxy.kvindex import PrefixIndex

log = logging.getLogger(__name__)

RCV_HWM = 10_000
REPLAY_TIMEOUT_S = 2.0
MAX_REPLAY = 10_000  # messages one replay may bring back
POLL_MS = 200


@dataclass(frozen=True, slots=True)
class Source:
    instance: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


@dataclass
class Counts:
    """Per instance, what the subscriber saw (read by the proxy's /metrics)."""

    messages: Counter[str] = field(default_factory=Counter)
    dropped: Counter[tuple[str, str]] = field(default_factory=Counter)  # (instance, reason)
    skipped_events: Counter[str] = field(default_factory=Counter)
    gaps: Counter[str] = field(default_factory=Counter)
    missed: Counter[str] = field(default_factory=Counter)
    replays: Counter[tuple[str, str]] = field(default_factory=Counter)  # (instance, ok|catch_up|failed)
    restarts: Counter[str] = field(default_factory=Counter)
    rebuilds: Counter[str] = field(default_factory=Counter)
    last_message: dict[str, float] = field(default_factory=dict)
    loop_errors: int = 0


class KvEventsSubscriber:
    def __init__(
        self,
        sources: list[Source],
        index: PrefixIndex,
        lock: threading.Lock,
        *,
        clock: Callable[[], float] = time.time,
        queue_max: int = RCV_HWM,
    ) -> None:
        self.sources = {s.instance: s for s in sources}
        self.queue_max = queue_max  # proxy.kv_aware.event_queue_max: messages ZMQ queues per socket
        self.index = index
        self.lock = lock
        self.clock = clock
        self.counts = Counts()
        self.seq: dict[str, SeqTracker] = {s.instance: SeqTracker() for s in sources}
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- life -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread (again, after :meth:`stop`: the sequences seen so far are kept, so what
        was published meanwhile shows as a gap and is replayed)."""
        if self._thread is None and self.sources:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the thread -------------------------------------------------------------------

    def _sockets(self) -> dict[zmq.Socket[bytes], str]:
        out: dict[zmq.Socket[bytes], str] = {}
        for s in self.sources.values():
            sock: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.RCVHWM, self.queue_max)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, s.topic.encode())
            sock.connect(s.endpoint)
            out[sock] = s.instance
        return out

    def _run(self) -> None:
        sockets = self._sockets()
        poller = zmq.Poller()
        for sock in sockets:
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                try:
                    ready = dict(poller.poll(POLL_MS))
                    for sock, instance in sockets.items():
                        while sock in ready and not self._stop.is_set():
                            try:
                                frames = sock.recv_multipart(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            self.receive(instance, frames)
                except Exception:  # never dies silently: logged, counted, and on to the next poll
                    self.counts.loop_errors += 1
                    log.exception("kv events: the subscriber loop failed; going on")
                    self._stop.wait(0.5)
        finally:
            for sock in sockets:
                sock.close(0)

    # -- one message (also the tests' entry) --------------------------------------------

    def receive(self, instance: str, frames: list[bytes]) -> None:
        c = self.counts
        tracker = self.seq.get(instance)
        if tracker is None:  # not an instance of the config: counted, never applied
            c.dropped[(instance, "unknown_instance")] += 1
            return
        try:
            msg = decode_message(frames)
        except BadMessage as exc:
            c.dropped[(instance, exc.reason)] += 1
            log.debug("kv events from %s dropped: %s", instance, exc)
            return
        c.messages[instance] += 1
        c.last_message[instance] = self.clock()
        if tracker.expected is None and msg.seq > 0:  # the first message heard from this instance
            self._catch_up(instance, msg.seq)
        seen = tracker.see(msg.seq)
        if seen == "duplicate":
            c.dropped[(instance, "duplicate")] += 1
            return
        if seen == "restart":
            c.restarts[instance] += 1
            log.warning(
                "kv events: %s restarted its sequence (seq %d): forgetting its cache", instance, msg.seq
            )
            self._rebuild(instance)
        elif seen == "gap":
            first, last = tracker.gaps[-1]
            c.gaps[instance] += 1
            c.missed[instance] += last - first + 1
            if not self._replay(instance, first, last):
                log.warning(
                    "kv events: %s skipped messages %d..%d and they could not be replayed: forgetting its "
                    "cache, rebuilding from its next events",
                    instance,
                    first,
                    last,
                )
                self._rebuild(instance)
        c.skipped_events[instance] += msg.batch.skipped
        with self.lock:
            self.index.apply(instance, msg.batch)

    def _rebuild(self, instance: str) -> None:
        self.counts.rebuilds[instance] += 1
        with self.lock:
            self.index.clear(instance)

    def _catch_up(self, instance: str, seq: int) -> None:
        """Before the first message heard from ``instance`` (this proxy just started, or the instance
        was added): replay what its buffer still holds before ``seq``, so the index knows the blocks
        it stored before we subscribed (vLLM keeps its last ``buffer_steps`` batches, 10,000 by
        default). Only a contiguous run ending at ``seq - 1`` is applied: an older block whose
        storing is no longer buffered stays unknown (its children are orphans, never a false hit).
        Without a replay endpoint, or when the replay fails, the index starts from what comes next."""
        got = self._fetch(instance, max(0, seq - MAX_REPLAY), seq - 1)
        if got is None:
            return
        run: list[tuple[int, bytes]] = []
        for s, payload in sorted(got, reverse=True):
            if s != seq - 1 - len(run):
                break
            run.append((s, payload))
        if not run:
            self.counts.replays[(instance, "failed")] += 1
            return
        if self._apply_replayed(instance, sorted(run)):
            self.counts.replays[(instance, "catch_up")] += 1

    def _replay(self, instance: str, first: int, last: int) -> bool:
        """Ask the instance's replay socket for ``first``..``last`` and apply them; False when it cannot."""
        got = self._fetch(instance, first, last)
        if got is None:
            return False
        if {s for s, _ in got} != set(range(first, last + 1)):
            self.counts.replays[(instance, "failed")] += 1
            return False
        if not self._apply_replayed(instance, sorted(got)):
            return False
        self.counts.replays[(instance, "ok")] += 1
        return True

    def _fetch(self, instance: str, first: int, last: int) -> list[tuple[int, bytes]] | None:
        """The messages ``first``..``last`` the instance's replay socket still has (bounded in count and
        time), or None when there is no replay endpoint or the replay failed (counted)."""
        src = self.sources[instance]
        if src.replay_endpoint is None:
            return None
        sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        got: list[tuple[int, bytes]] = []
        try:
            sock.connect(src.replay_endpoint)
            sock.send_multipart([b"", first.to_bytes(8, "big", signed=True)])
            deadline = time.monotonic() + REPLAY_TIMEOUT_S
            while len(got) <= MAX_REPLAY:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not sock.poll(left_ms):
                    raise TimeoutError("no end of replay")
                seq, payload = _replayed(sock.recv_multipart())
                if seq == END_SEQ:
                    break
                if first <= seq <= last:
                    got.append((seq, payload))
        except (zmq.ZMQError, BadMessage, TimeoutError) as exc:
            self.counts.replays[(instance, "failed")] += 1
            log.info("kv events: replay from %s failed: %s", src.replay_endpoint, exc)
            return None
        finally:
            sock.close(0)
        return got

    def _apply_replayed(self, instance: str, got: list[tuple[int, bytes]]) -> bool:
        """Decode every replayed message before applying any (a bad one fails the replay whole)."""
        batches = []
        for _seq, payload in got:
            try:
                batches.append(decode_batch(payload))
            except BadMessage as exc:
                self.counts.dropped[(instance, exc.reason)] += 1
                self.counts.replays[(instance, "failed")] += 1
                return False
        with self.lock:
            for batch in batches:
                self.index.apply(instance, batch)
        return True


def _replayed(frames: list[bytes]) -> tuple[int, bytes]:
    """One replay answer as a DEALER receives it: ``[b"", (topic,) seq, payload]`` -- vLLM has sent it
    with and without the topic; the end is ``seq = END_SEQ`` with an empty payload."""
    parts = frames[1:] if frames and frames[0] == b"" else frames
    if len(parts) not in (2, 3):
        raise BadMessage("frames", f"replay answer of {len(frames)} frame(s)")
    return decode_seq(parts[-2]), parts[-1]


def sources_of(instances: Mapping[str, tuple[str | None, str | None, str]]) -> list[Source]:
    """Sources from ``{instance: (endpoint, replay_endpoint, topic)}``, skipping those without an endpoint."""
    return [Source(n, ep, rep, topic) for n, (ep, rep, topic) in instances.items() if ep]
