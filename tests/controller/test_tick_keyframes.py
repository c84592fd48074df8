"""Tick records as keyframes and deltas (format 2): a run recorded so reads back and replays exactly as
its whole records do, from any start; a record missing from a chain, or a keyframe gone, is refused
naming it; retention keeps the keyframe a kept delta needs."""

from __future__ import annotations

import dataclasses
import io
import pickle
from collections.abc import Mapping
from typing import Any

import pytest
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from collector.retention import Retention
from controller.effects import Tick
from controller.loop import Reconciler
from controller.policy import AlertConfig
from controller.policy.replay import replay
from controller.replay import ReplayError, as_dict, replay_window
from controller.tickchain import (
    JSON_ZLIB,
    MSGPACK_ZLIB,
    ChainError,
    ChainWriter,
    Link,
    Rebuilder,
    Written,
    text,
)
from controller.ticklog import (
    TickLogError,
    TickLogRecorder,
    decode_between,
    decode_payload,
    encode,
    read_ticks,
)
from controller.wiring import default_effects
from store.db import transaction
from store.models import Decision, TickRecord
from tests.controller.conftest import World
from tests.controller.test_replay import _run, _window


class WholeRecords:
    """A tick recorder that keeps each tick's whole record (a format 1 payload) beside the store's."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []

    def record(self, session: Session, tick: Tick) -> Mapping[str, int]:
        self.payloads.append(encode(tick.inp, tick.prev_served, tick.alert_config, tick.out, tick.between))
        return {}


class FailsOnce:
    """A tick recorder after the tick log that fails one tick's transaction (its record encoded)."""

    def __init__(self, tick: int) -> None:
        self.tick = tick

    def record(self, session: Session, tick: Tick) -> Mapping[str, int]:
        if tick.out.tick == self.tick:
            self.tick = -1
            raise RuntimeError("the store refused the tick")
        return {}


def _recording(world: World, every: int, whole: WholeRecords | None = None, *extra: Any) -> WholeRecords:
    """A (new) controller on the world's store recording a keyframe every ``every`` ticks, and whole."""
    controller = world.settings.controller.model_copy(update={"tick_keyframe_every": every})
    world.settings = world.settings.model_copy(update={"controller": controller})
    whole = whole or WholeRecords()
    effects = default_effects(world.settings, world.factory, clock=world.clock, notifier=world.notifier)
    world.reconciler = Reconciler(
        world.settings,
        world.factory,
        effects=dataclasses.replace(effects, recorders=(*effects.recorders, whole, *extra)),
        clock=world.clock,
        alert_config=AlertConfig(for_s={"KVLeaseExpired": 0.0, "InstanceDown": 4.0}),
    )
    return whole


def _rows(world: World) -> list[TickRecord]:
    with transaction(world.factory) as s:
        rows = list(s.scalars(select(TickRecord).order_by(TickRecord.ts, TickRecord.id)))
        s.expunge_all()
    return rows


def _inputs(payload: bytes) -> tuple[Any, ...]:
    return (*decode_payload(payload), decode_between(payload))


def test_a_run_recorded_with_deltas_reads_and_replays_as_its_whole_records(world: World) -> None:
    whole = _recording(world, every=4)
    _run(world)
    _recording(world, every=4, whole=whole)  # a restart: a new epoch starts with a keyframe
    for _ in range(5):
        world.step(handoff_s={"decode-2": 0.5}, scrape={"decode_2": {"xfer_s": 0.1}})
    rows = _rows(world)
    assert len(rows) == len(whole.payloads) == 30
    assert [r.format for r in rows] == [2] * 30
    keys = [r.tick for r in rows if r.keyframe]
    assert keys == [1, 5, 9, 13, 17, 21, 25, 1, 5], "every 4th tick, and the restart's first"
    assert sum(len(r.payload) for r in rows) < 0.7 * sum(len(p) for p in whole.payloads)
    lo, hi = _window(world)
    with transaction(world.factory) as s:
        for k, row in enumerate(rows):  # a window from each record: a keyframe, or a delta mid-chain
            window = read_ticks(s, row.ts, hi, limit=100)
            got = [(t.inp, t.prev_served, t.alerts, t.after, t.between) for t in window.ticks]
            assert got == [_inputs(p) for p in whole.payloads[k:]], f"from tick {row.tick}"
        result = replay_window(s, rows[6].ts, hi)  # a delta: rebuilt from the keyframe before it
        window = read_ticks(s, lo, hi, limit=100)
    assert result.reproduced is True and result.restarts == 1 and result.ticks == 24
    as_whole = [
        dataclasses.replace(t, inp=i, prev_served=p, alerts=a, after=d, between=b)
        for t, (i, p, a, d, b) in zip(window.ticks, map(_inputs, whole.payloads), strict=True)
    ]
    assert as_dict(replay(window.ticks, window.configs), timeline=True) == as_dict(
        replay(as_whole, window.configs), timeline=True
    )


def test_records_an_older_pdscope_wrote_in_json_read_and_replay_beside_msgpack_ones(world: World) -> None:
    """An upgrade mid-window: the older pdscope's records (compact JSON) and this one's (MessagePack, from
    the restart's keyframe on) read back as their whole records and replay as one run; a codec this
    pdscope does not know is refused naming it."""
    whole = _recording(world, every=4)
    (log,) = [r for r in world.reconciler.effects.recorders if isinstance(r, TickLogRecorder)]
    log.writer = ChainWriter(4, JSON_ZLIB)
    _run(world)
    _recording(world, every=4, whole=whole)
    for _ in range(5):
        world.step(handoff_s={"decode-2": 0.5}, scrape={"decode_2": {"xfer_s": 0.1}})
    rows = _rows(world)
    assert [r.codec for r in rows] == ["json+zlib"] * 25 + ["msgpack+zlib"] * 5
    assert [r.keyframe for r in rows].count(False) == 21, "deltas in both codecs"
    lo, hi = _window(world)
    with transaction(world.factory) as s:
        window = read_ticks(s, lo, hi, limit=100)
        result = replay_window(s, rows[6].ts, hi)
    got = [(t.inp, t.prev_served, t.alerts, t.after, t.between) for t in window.ticks]
    assert got == [_inputs(p) for p in whole.payloads]
    assert result.reproduced is True and result.restarts == 1
    with transaction(world.factory) as s:
        row = s.scalars(select(TickRecord).order_by(TickRecord.id)).first()
        assert row is not None
        row.codec = "zstd"
    with transaction(world.factory) as s, pytest.raises(TickLogError, match="2/zstd; this pdscope reads"):
        read_ticks(s, lo, hi, limit=100)


def test_a_float_an_int_and_a_dict_s_order_round_trip_exactly_in_either_codec() -> None:
    doc = {"b": [0.1 + 0.2, -0.0, 1e-310, 2**62, True, None, "\u00e9"], "a": {"z": 1, "y": [1.5, 1]}}
    for codec in (JSON_ZLIB, MSGPACK_ZLIB):
        back = codec.decode(codec.encode(doc))
        assert exact(back) == exact(doc), codec.name
    with pytest.raises(ValueError, match=r"MessagePack|incomplete|Unpack"):
        MSGPACK_ZLIB.decode(MSGPACK_ZLIB.encode(doc)[:-3])


def _drop(world: World, tick: int, epoch: int | None = None) -> TickRecord:
    """Delete one tick's record and the decisions it took (so only the record is missing)."""
    with transaction(world.factory) as s:
        row = s.scalars(select(TickRecord).where(TickRecord.tick == tick)).one()
        s.execute(delete(Decision).where(Decision.tick == tick))
        s.delete(row)
        s.flush()
        s.expunge(row)
    return row


def test_a_record_missing_from_a_chain_is_refused_naming_it(world: World) -> None:
    _recording(world, every=5)
    for _ in range(12):
        world.step()
    lo, hi = _window(world)
    gone = _drop(world, 3)
    assert not gone.keyframe
    with transaction(world.factory) as s, pytest.raises(ReplayError, match="tick 3 of epoch 1 is missing"):
        replay_window(s, lo, hi)
    rows = _rows(world)
    with transaction(world.factory) as s:
        assert replay_window(s, rows[1].ts, rows[1].ts).ticks == 1, "tick 2: the chain up to the gap"
        after = next(r for r in rows if r.tick == 6)
        assert after.keyframe and replay_window(s, after.ts, hi).reproduced is True


def test_a_window_whose_keyframe_is_gone_is_refused_naming_the_next(world: World) -> None:
    _recording(world, every=5)
    for _ in range(12):
        world.step()
    _, hi = _window(world)
    assert _drop(world, 1).keyframe
    rows = _rows(world)
    nxt = next(r for r in rows if r.keyframe)
    assert nxt.tick == 6
    with (
        transaction(world.factory) as s,
        pytest.raises(
            ReplayError,
            match=rf"keyframe it is rebuilt from .* at or before tick 2\) is not in the "
            rf"store: deleted by retention .* start the window at the next keyframe, at {nxt.ts:.3f}",
        ),
    ):
        replay_window(s, rows[0].ts, hi)
    with transaction(world.factory) as s:
        assert replay_window(s, nxt.ts, hi).reproduced is True


def test_a_delta_on_another_record_than_its_own_is_refused(world: World) -> None:
    _recording(world, every=5)
    for _ in range(4):
        world.step()
    world.step(handoff_s={"decode-2": 0.5}, scrape={"decode_2": {"xfer_s": 0.1}})
    lo, hi = _window(world)
    with transaction(world.factory) as s:  # tick 4's record holds another (whole) document
        one, four = (s.scalars(select(TickRecord).where(TickRecord.tick == t)).one() for t in (1, 4))
        four.payload, four.keyframe = one.payload, True
    with (
        transaction(world.factory) as s,
        pytest.raises(
            ReplayError, match=r"\(tick 5 at .* taken against another record than the stored tick 4"
        ),
    ):
        replay_window(s, lo, hi)


def test_a_tick_that_failed_after_its_record_was_encoded_leaves_no_delta_on_it(world: World) -> None:
    """The failed tick's record was encoded (the writer's last document) but not stored: the tick taken
    again next is a keyframe, and the chain reads on."""
    _recording(world, 30, None, FailsOnce(3))
    world.step()
    world.step()
    with pytest.raises(RuntimeError, match="refused"):
        world.step()
    for _ in range(4):
        world.step()
    rows = _rows(world)
    assert [(r.tick, r.keyframe) for r in rows] == [(1, True), (2, False), (3, True)] + [
        (t, False) for t in (4, 5, 6)
    ]
    lo, hi = _window(world)
    with transaction(world.factory) as s:
        assert replay_window(s, lo, hi).reproduced is True


def _link(tick: int, epoch: int = 1, policy: str = "p") -> Link:
    return Link(epoch, tick, policy, 1)


def test_the_writer_keyframes_every_nth_and_at_any_break() -> None:
    w = ChainWriter(3)
    links = [_link(1), _link(2), _link(3), _link(4), _link(6), _link(7), _link(1, epoch=2), _link(2, epoch=2)]
    links += [_link(3, epoch=2, policy="q"), _link(4, epoch=2, policy="q")]
    keys = [w.write(link, {"t": link.tick, "rows": list(range(50))}).keyframe for link in links]
    assert keys == [True, False, False, True, True, False, True, False, True, False]


def test_the_writer_stores_whole_what_a_delta_would_not_rebuild() -> None:
    """``==`` does not see a reordered dict or a zero's sign: the record is then a keyframe."""
    docs = [
        {"a": {"x": 1, "y": 2}, "z": 0.0},
        {"a": {"y": 2, "x": 1}, "z": 0.0},
        {"a": {"y": 2, "x": 1}, "z": -0.0},
    ]
    docs.append({"a": {"y": 3, "x": 1}, "z": -0.0})
    written, rebuilt = _chain(docs)
    assert [x.keyframe for x in written] == [True, True, True, False]
    assert [repr(d) for d in rebuilt] == [repr(d) for d in docs]
    skipping = Rebuilder()
    skipping.keyframe(_link(3), written[2].payload)
    with pytest.raises(ChainError, match="tick 4 of epoch 1 is missing"):
        skipping.delta(_link(5), written[3].payload)


def test_retention_keeps_the_keyframe_a_kept_delta_needs(world: World) -> None:
    """Records older than the raw retention go up to the newest keyframe at or before the cut: a
    window from the cut still replays (its first record a delta, rebuilt from the keyframe kept)."""
    _recording(world, every=5)
    for _ in range(14):
        world.step()
    _, hi = _window(world)
    cut = next(r for r in _rows(world) if r.tick == 8)
    Retention(world.factory, raw_s=3600.0, rollup_s=86400.0, lag_s=60.0).run(cut.ts + 3600.0)
    kept = _rows(world)
    assert [r.tick for r in kept] == list(range(6, 15)), "from tick 6, the keyframe of tick 8"
    with transaction(world.factory) as s:
        assert replay_window(s, cut.ts, hi).reproduced is True


def test_the_writer_checks_a_delta_exactly_without_its_json() -> None:
    """The writer's check (the rebuilt document's encoding against the document's) sees what ``==`` does
    not (an int for a float, a bool for an int, inside a list), and not which values are one object: a
    delta where the encoding is the same."""
    name = "decode-" + str(7)  # one object, in two places of the second document
    docs = [
        {"v": [1.0, 1], "n": ["decode-7", "decode-7"], "t": 0},
        {"v": [1, 1], "n": [name, name], "t": 1},
        {"v": [1, True], "n": [name, name], "t": 2},
        {"v": [1, True], "n": ["decode-7", name], "t": 3},
    ]
    written, rebuilt = _chain(docs)
    assert [x.keyframe for x in written] == [True, True, True, False]
    assert [text(d) for d in rebuilt] == [text(d) for d in docs]
    docs += [  # a zero's sign, an inner dict's order: equal by ``==``, so written whole
        {"v": [0.0], "t": 5},
        {"v": [-0.0], "t": 6},
        {"d": {"a": 1, "b": 2}, "t": 7},
        {"d": {"b": 2, "a": 1}, "t": 8},
    ]
    written, rebuilt = _chain(docs)
    assert [x.keyframe for x in written][4:] == [False, True, False, True]
    assert [text(d) for d in rebuilt] == [text(d) for d in docs]


def exact(doc: Any) -> bytes:
    """``doc`` as bytes that say every value exactly (a float's bits, each value's kind, each dict's key
    order) whichever of its values are one object (pickled without its memo): the tests' own measure of
    an exact round trip, independent of either codec."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=5)
    pickler.fast = True
    pickler.dump(doc)
    return buf.getvalue()


def _chain(docs: list[Any]) -> tuple[list[Written], list[Any]]:
    """``docs`` written as ticks 1, 2, ... of one epoch (keyframes every 10), and each read back in turn."""
    w, r = ChainWriter(10), Rebuilder()
    written = [w.write(_link(i + 1), d) for i, d in enumerate(docs)]
    rebuilt = [
        (r.keyframe if x.keyframe else r.delta)(_link(i + 1), x.payload) for i, x in enumerate(written)
    ]
    return written, rebuilt
