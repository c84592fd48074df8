"""The KV events of every instance that publishes them, into the prefix index (one thread).

One ZMQ SUB socket per instance with a ``kv_events_endpoint`` (the topic filter its
``kv_events_topic``), polled by a single daemon thread that decodes each message
(``pdscope.kvevents``) and applies it to the :class:`proxy.kvindex.PrefixIndex` under the
index's lock. The proxy's event loop never waits on it: it only reads the index, under the
same lock, for a few microseconds per request.

One bad instance costs only itself. The thread never waits on one instance: a gap replay
(:mod:`proxy.kvreplay`) is a DEALER socket read by the same poll as the live sockets, with its
own deadline; while it runs, that instance's live messages are held back (at most ``queue_max``,
then dropped and counted ``held_overflow``, which shows as a further gap) and its view is stale
(credited nothing), and every other instance's events are applied as they come. Every socket
(SUB and replay) refuses a message over ``max_message_bytes`` (ZMQ ``MAXMSGSIZE``): ZMQ cuts the
connection before the bytes reach memory (and, for such a protocol error, would never reconnect);
the cut is counted (dropped, reason ``disconnected``) and the subscriber reconnects after
``RECONNECT_BASE_S``, doubled at each cut in a row without a message in between (at most
``RECONNECT_MAX_S``), so a publisher that keeps sending oversized messages is asked rarely. What
was lost meanwhile shows as a gap. The decoder keeps its own size check too.

Bounded: ZMQ keeps at most ``queue_max`` (``proxy.kv_aware.event_queue_max``) messages per
socket; a subscriber that falls behind loses the newest, which shows as a gap in the sequence. A
gap with a ``kv_events_replay_endpoint`` is asked for again (the replay socket answers the missed
messages, then ``END_SEQ``); without one, when the replay fails, or while the instance's last
replay failure is backing off, the instance's entries are forgotten and rebuilt from what it
stores next (a cache pdscope only partly knows would credit blocks vLLM has dropped). The first
message heard from an instance (a proxy that just started, or restarted) is preceded by a
catch-up replay of what the instance's buffer still holds before it, so a restarted proxy knows
the blocks vLLM stored before it subscribed, not only what it stores next. A publisher whose
sequence restarts lower has restarted with an empty cache: its entries are forgotten too. Every
drop, gap, replay and restart is counted per instance (:class:`Counts`), and so is a message for
an instance the subscriber was not configured with (dropped, reason ``unknown_instance``);
nothing here raises into the proxy, and a failure of the thread is logged and counted, and the
thread goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import zmq

from pdscope.kvevents import (
    MAX_PAYLOAD_BYTES,
    BadMessage,
    Batch,
    Message,
    SeqTracker,
    decode_batch,
    decode_message,
)
from proxy.kvindex import PrefixIndex
from proxy.kvreplay import Purpose, Replay, Replays

log = logging.getLogger(__name__)

RCV_HWM = 10_000
REPLAY_TIMEOUT_S = 2.0  # read when a subscriber is made
MAX_REPLAY = 10_000  # messages one replay may bring back
POLL_MS = 200
DRAIN_MAX = 1_000  # messages read from one socket per poll: a busy instance cannot starve the others
RECONNECT_BASE_S = 0.1
RECONNECT_MAX_S = 30.0


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
    # (instance, ok|catch_up|failed|backoff): backoff = a gap not replayed, the last replay having failed
    replays: Counter[tuple[str, str]] = field(default_factory=Counter)
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
        max_message_bytes: int = MAX_PAYLOAD_BYTES,
        replay_timeout_s: float | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sources = {s.instance: s for s in sources}
        self.queue_max = queue_max  # proxy.kv_aware.event_queue_max: messages ZMQ queues per socket
        self.max_message_bytes = max_message_bytes
        self.index = index
        self.lock = lock
        self.clock = clock
        self.counts = Counts()
        self.seq: dict[str, SeqTracker] = {s.instance: SeqTracker() for s in sources}
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.replays = Replays(
            self._ctx,
            max_message_bytes=max_message_bytes,
            timeout_s=REPLAY_TIMEOUT_S if replay_timeout_s is None else replay_timeout_s,
            max_messages=MAX_REPLAY,
            clock=monotonic,
        )
        self._subs: dict[zmq.Socket[bytes], str] = {}
        self._monitors: dict[zmq.Socket[bytes], str] = {}
        self._cuts: Counter[str] = Counter()  # cut connections in a row, per instance
        self._reconnect_at: dict[str, float] = {}
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
            # ZMQ refuses a larger frame before reading it: the peer is disconnected, nothing allocated
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            sock.setsockopt(zmq.SUBSCRIBE, s.topic.encode())
            out[sock] = s.instance
        return out

    def _open(self) -> None:
        self._subs = self._sockets()
        for sock, instance in self._subs.items():
            self._monitors[sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)] = instance
            sock.connect(self.sources[instance].endpoint)

    def _close(self) -> None:
        for sock in self._subs:
            sock.disable_monitor()
            sock.close(0)
        for mon in self._monitors:
            mon.close(0)
        self.replays.close()
        self._subs, self._monitors = {}, {}

    def _run(self) -> None:
        self._open()
        try:
            while not self._stop.is_set():
                try:
                    self.step(POLL_MS)
                except Exception:  # never dies silently: logged, counted, and on to the next poll
                    self.counts.loop_errors += 1
                    log.exception("kv events: the subscriber loop failed; going on")
                    self._stop.wait(0.5)
        finally:
            self._close()

    def step(self, timeout_ms: int) -> None:
        """One poll of every socket (live, monitors, replays), waiting at most ``timeout_ms`` and never
        past the nearest replay deadline; then everything ready is handled. The thread's loop, and
        the tests' way to drive replays without it."""
        poller = zmq.Poller()
        replays = self.replays.sockets()
        for sock in (*self._subs, *self._monitors, *replays):
            poller.register(sock, zmq.POLLIN)
        deadline = min(
            (t for t in (self.replays.next_deadline(), *self._reconnect_at.values()) if t is not None),
            default=None,
        )
        if deadline is not None:
            timeout_ms = max(0, min(timeout_ms, int((deadline - self.replays.clock()) * 1000) + 1))
        ready = dict(poller.poll(timeout_ms))
        for sock in replays:
            done = self.replays.read(sock) if sock in ready else None
            if done is not None:
                self._finish(done)
        for late in self.replays.expired():
            self._finish(late)
        for mon, instance in self._monitors.items():
            if mon in ready:
                self._disconnects(mon, instance)
        self._reconnect()
        for sock, instance in self._subs.items():
            for _ in range(DRAIN_MAX if sock in ready else 0):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.receive(instance, frames)

    def _disconnects(self, mon: zmq.Socket[bytes], instance: str) -> None:
        """A cut connection: a message over ``max_message_bytes`` (ZMQ refused it unread) or a publisher
        that went away. Counted; what was lost meanwhile shows as a gap."""
        while True:
            try:
                mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.counts.dropped[(instance, "disconnected")] += 1
            self._cuts[instance] += 1
            delay = min(RECONNECT_MAX_S, RECONNECT_BASE_S * 2 ** min(self._cuts[instance] - 1, 30))
            self._reconnect_at[instance] = self.replays.clock() + delay
            log.info(
                "kv events: the connection to %s was cut (a message over %d bytes, or it went away): "
                "reconnecting in %.1fs",
                instance,
                self.max_message_bytes,
                delay,
            )

    def _reconnect(self) -> None:
        """Connect again to the publishers whose reconnect time has come (ZMQ does not, after it cut
        a connection for an oversized message)."""
        now = self.replays.clock()
        due = [inst for inst, at in self._reconnect_at.items() if at <= now]
        for sock, instance in self._subs.items():
            if instance not in due:
                continue
            endpoint = self.sources[instance].endpoint
            try:
                sock.disconnect(endpoint)
            except zmq.ZMQError:  # already gone: connect again below
                pass
            sock.connect(endpoint)
        for instance in due:
            del self._reconnect_at[instance]

    # -- one message (also the tests' entry) --------------------------------------------

    def receive(self, instance: str, frames: list[bytes]) -> None:
        c = self.counts
        if instance not in self.seq:  # not an instance of the config: counted, never applied
            c.dropped[(instance, "unknown_instance")] += 1
            return
        try:
            msg = decode_message(frames, self.max_message_bytes)
        except BadMessage as exc:
            c.dropped[(instance, exc.reason)] += 1
            log.debug("kv events from %s dropped: %s", instance, exc)
            return
        c.messages[instance] += 1
        c.last_message[instance] = self.clock()
        self._cuts.pop(instance, None)
        self._accept(instance, msg)

    def _accept(self, instance: str, msg: Message) -> None:
        """``msg`` in sequence order: held while the instance's replay runs, else checked and applied."""
        c, pending = self.counts, self.replays.by_instance.get(instance)
        if pending is not None:
            if len(pending.held) < self.queue_max:
                pending.held.append(msg)
            else:  # counted; when the held messages are applied this shows as a gap
                c.dropped[(instance, "held_overflow")] += 1
            return
        tracker = self.seq[instance]
        first_heard = tracker.expected is None
        seen = tracker.see(msg.seq)
        if first_heard and msg.seq > 0:  # what its buffer holds before this message, if it can say
            if self._ask(instance, max(0, msg.seq - MAX_REPLAY), msg.seq - 1, "catch_up", msg):
                return
        elif seen == "duplicate":
            c.dropped[(instance, "duplicate")] += 1
            return
        elif seen == "restart":
            c.restarts[instance] += 1
            log.warning(
                "kv events: %s restarted its sequence (seq %d): forgetting its cache", instance, msg.seq
            )
            self._rebuild(instance)
        elif seen == "gap":
            first, last = tracker.gaps[-1]
            c.gaps[instance] += 1
            c.missed[instance] += last - first + 1
            if self._ask(instance, first, last, "gap", msg):
                return
            self._lost(instance, first, last)
        self._apply(instance, msg.batch)

    def _ask(self, instance: str, first: int, last: int, purpose: Purpose, trigger: Message) -> bool:
        """Start a replay of ``first``..``last`` (``trigger`` applied after it); False when there is no
        replay endpoint or the instance's replays are backing off."""
        endpoint = self.sources[instance].replay_endpoint
        if endpoint is None:
            return False
        if self.replays.backing_off(instance):
            self.counts.replays[(instance, "backoff")] += 1
            return False
        if purpose == "gap":  # its view has a hole until the replay fills it: no credit meanwhile
            with self.lock:
                self.index.mark_stale(instance)
        self.replays.ask(instance, endpoint, first, last, purpose).held.append(trigger)
        return True

    def _finish(self, replay: Replay) -> None:
        """A replay ended (or failed): apply what it brought, then the messages held meanwhile."""
        if replay.outcome == "failed":
            self.counts.replays[(replay.instance, "failed")] += 1
            log.info("kv events: replay from %s failed: %s", replay.endpoint, replay.why)
        if replay.purpose == "gap":
            self._finish_gap(replay)
        else:
            self._finish_catch_up(replay)
        trigger, *held = replay.held
        self._apply(replay.instance, trigger.batch)  # its sequence number is already counted
        for msg in held:
            self._accept(replay.instance, msg)

    def _finish_gap(self, replay: Replay) -> None:
        inst, first, last = replay.instance, replay.first, replay.last
        if replay.outcome == "ended":
            if {s for s, _ in replay.got} != set(range(first, last + 1)):
                self.counts.replays[(inst, "failed")] += 1
                self.replays.failed(inst)
            elif self._apply_replayed(inst, sorted(replay.got)):
                self.counts.replays[(inst, "ok")] += 1
                self.replays.succeeded(inst)
                with self.lock:
                    self.index.unmark_stale(inst)
                return
        self._lost(inst, first, last)

    def _finish_catch_up(self, replay: Replay) -> None:
        """Only a contiguous run ending just before the first message heard is applied: an older
        block whose storing is no longer buffered stays unknown (its children are orphans, never a
        false hit). When the replay fails, the index starts from the first message."""
        if replay.outcome != "ended":
            return
        run: list[tuple[int, bytes]] = []
        for s, payload in sorted(replay.got, reverse=True):
            if s != replay.last - len(run):
                break
            run.append((s, payload))
        if not run:
            self.counts.replays[(replay.instance, "failed")] += 1
            self.replays.failed(replay.instance)
        elif self._apply_replayed(replay.instance, sorted(run)):
            self.counts.replays[(replay.instance, "catch_up")] += 1
            self.replays.succeeded(replay.instance)

    def _lost(self, instance: str, first: int, last: int) -> None:
        log.warning(
            "kv events: %s skipped messages %d..%d and they could not be replayed: forgetting its cache, "
            "rebuilding from its next events",
            instance,
            first,
            last,
        )
        self._rebuild(instance)

    def _apply(self, instance: str, batch: Batch) -> None:
        self.counts.skipped_events[instance] += batch.skipped
        with self.lock:
            self.index.apply(instance, batch)

    def _rebuild(self, instance: str) -> None:
        self.counts.rebuilds[instance] += 1
        with self.lock:
            self.index.clear(instance)

    def _apply_replayed(self, instance: str, got: list[tuple[int, bytes]]) -> bool:
        """Decode every replayed message before applying any (a bad one fails the replay whole)."""
        batches = []
        for _seq, payload in got:
            try:
                batches.append(decode_batch(payload, self.max_message_bytes))
            except BadMessage as exc:
                self.counts.dropped[(instance, exc.reason)] += 1
                self.counts.replays[(instance, "failed")] += 1
                self.replays.failed(instance)
                return False
        with self.lock:
            for batch in batches:
                self.index.apply(instance, batch)
        return True


def sources_of(instances: Mapping[str, tuple[str | None, str | None, str]]) -> list[Source]:
    """Sources from ``{instance: (endpoint, replay_endpoint, topic)}``, skipping those without an endpoint."""
    return [Source(n, ep, rep, topic) for n, (ep, rep, topic) in instances.items() if ep]
