"""The tick record's encoding, made cheaper for a large fleet (issue 32), writes the same bytes: the codec's
walk of a dataclass by fields kept per class, and the pairs' p99 set to 0 (the instances' left out) in the
dumped document rather than on a copy of the observation, against the walk and the copy they replace, on a
run with every kind of decision."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any

from sqlalchemy.orm import Session

from controller.effects import Tick
from controller.policy.codec import DumpMemo, dump
from controller.policy.signals import PairSignals
from controller.tickchain import text
from controller.ticklog import document, policy_observation
from tests.controller.conftest import World
from tests.controller.test_replay import _run


def _walked(value: Any, compact: bool = False) -> Any:
    """:func:`dump` as it was: ``dataclasses.fields`` asked for every value."""
    if value is None or isinstance(value, bool | int | str | float):
        return value.value if isinstance(value, enum.Enum) else value
    if isinstance(value, enum.Enum):
        return value.value
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="python")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            if compact and f.default is not dataclasses.MISSING and _exactly(v, f.default):
                continue
            out[f.name] = _walked(v, compact)
        return out
    if isinstance(value, Mapping):
        return {str(k): _walked(v, compact) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_walked(v, compact) for v in value]
    return sorted(_walked(v, compact) for v in value)


def _exactly(v: Any, default: Any) -> bool:
    return (
        type(v) is type(default) and v == default and (not isinstance(v, float) or repr(v) == repr(default))
    )


class _Kind(enum.Enum):
    A = "a"


class _Level(enum.IntEnum):
    ONE = 1


@dataclasses.dataclass(frozen=True)
class _Odd:
    kind: _Kind = _Kind.A
    level: _Level = _Level.ONE
    zero: float = 0.0
    count: int = 1
    names: frozenset[str] = frozenset()
    pairs: tuple[PairSignals, ...] = ()


def test_the_codec_dumps_odd_values_as_the_walk_by_fields_did() -> None:
    pair = PairSignals("p", "d", 3, -0.0, math.nan, recent_p50_s=math.inf)
    for value in (
        _Odd(),
        _Odd(_Kind.A, _Level.ONE, -0.0, True, frozenset({"b", "a"}), (pair,)),
        _Odd(zero=0, count=1.0),  # type: ignore[arg-type]  # the wrong kinds: not their defaults
        {"x": [_Odd(), None, (1, 2.5)]},
        [_Level.ONE, _Kind.A, {"k": _Level.ONE, "f": -0.0, "b": True}, (False, "s")],  # not plain, in plain
    ):
        for compact in (False, True):
            assert repr(dump(value, compact=compact)) == repr(_walked(value, compact))


def test_a_dump_memo_takes_the_document_again_only_for_the_very_same_value() -> None:
    memo = DumpMemo((PairSignals,))
    pair, odd = PairSignals("p", "d", 3, 0.5, 0.0), _Odd(zero=1.0)
    first = dump({"pairs": [pair], "odd": odd}, compact=True, memo=memo)
    memo.turn()
    again = dump({"pairs": [pair], "odd": odd}, compact=True, memo=memo)
    assert again == first and again["pairs"][0] is first["pairs"][0] and memo.taken == 1
    assert again["odd"] is not first["odd"]  # not a type the memo keeps
    memo.turn()
    equal = dataclasses.replace(pair)  # equal, another object: dumped anew
    third = dump([equal], compact=True, memo=memo)
    assert third == [first["pairs"][0]] and third[0] is not first["pairs"][0] and memo.taken == 1
    memo.turn()
    memo.turn()  # a dump that did not have it: forgotten
    assert dump([equal], compact=True, memo=memo)[0] is not third[0] and memo.taken == 1


class _Documents:
    """Each tick's record document, beside the one the copied pairs gave; the document made with a memo of
    the document before, as the recorder makes it."""

    def __init__(self) -> None:
        self.pairs: list[tuple[bytes, bytes]] = []
        self.saw_pairs = False
        self.memo = DumpMemo((PairSignals,))

    def record(self, session: Session, tick: Tick) -> Mapping[str, int]:
        inp = tick.inp
        self.saw_pairs |= bool(inp.obs.pairs)
        copied = dataclasses.replace(inp, obs=policy_observation(inp.obs))
        before = {
            "input": _walked(copied, compact=True),
            "prev_served": _walked(tick.prev_served, compact=True),
            "alerts": _walked(tick.alert_config),
        }
        doc = document(inp, tick.prev_served, tick.alert_config, tick.out, tick.between, self.memo)
        after = {k: v for k, v in doc.items() if k in before}
        self.pairs.append((text(after), text(before)))
        return {}


def test_every_tick_record_is_the_document_the_walk_and_the_copied_pairs_gave(world: World) -> None:
    docs = _Documents()
    world.reconciler.effects = dataclasses.replace(
        world.reconciler.effects, recorders=(*world.reconciler.effects.recorders, docs)
    )
    _run(world)
    assert docs.saw_pairs and len(docs.pairs) > 20
    for now, before in docs.pairs:
        assert now == before
