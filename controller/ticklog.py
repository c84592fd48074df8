"""The tick log: each tick's whole input and the state it left, stored so the policy can be replayed.

:func:`record_tick` writes one ``tick_records`` row in the tick's own transaction (so a tick is
stored with its decisions or not at all); :func:`read_ticks` reads a window of them back as
:class:`controller.policy.replay.RecordedTick` values, refusing (:class:`TickLogError`) rows it
cannot replay faithfully: another policy version, another payload format, a payload that does not
decode into this pdscope's types.

The record is a JSON-shaped document (:mod:`controller.policy.codec`, exact for floats; fields at
their defaults left out), encoded in MessagePack (records of an older pdscope: JSON) and compressed
with zlib (``bench/controller_cost.py`` measures its size and cost by fleet size). It keeps the
tables the controller recomposed after operator changes since the tick before
(:class:`controller.policy.refresh.Between`; a record without them, as older ones, had none).

Format 2 stores most records as a delta on the record before (:mod:`controller.tickchain`): a
keyframe, the whole document, every ``controller.tick_keyframe_every`` ticks and after any restart,
takeover, config change or gap. A window is read from the keyframe at or before its start; a delta
whose keyframe or predecessor is not in the store is refused naming it. Format 1 records (every
record whole) still read.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controller.effects import Tick
from controller.policy import (
    AlertConfig,
    Observation,
    PairSignals,
    PolicyConfig,
    ServedInstance,
    TickInput,
    TickOutput,
)
from controller.policy.codec import CodecError, DumpMemo, digest, dump, load
from controller.policy.config import POLICY_VERSION
from controller.policy.refresh import NOTHING_BETWEEN, Between
from controller.policy.replay import RecordedTick, StoredChange
from controller.tickchain import (
    CODECS,
    LEVEL,
    WRITTEN,
    ChainError,
    ChainWriter,
    Link,
    Rebuilder,
    keyframe_doc,
)
from store.models import Decision, PolicyConfigRow, TickRecord

FORMAT = 2  # 1: every record whole; 2: keyframes (whole) and deltas (TickRecord.keyframe)
FORMATS = (1, 2)  # the formats this pdscope reads


class TickLogError(ValueError):
    """The stored window cannot be replayed as asked; the message says why and what to do."""


def encode(
    inp: TickInput,
    prev_served: Mapping[str, ServedInstance],
    ac: AlertConfig,
    out: TickOutput,
    between: Between = NOTHING_BETWEEN,
) -> bytes:
    """The whole record's payload (a keyframe's, and every format 1 record's): :func:`document`
    compressed."""
    return zlib.compress(WRITTEN.encode(document(inp, prev_served, ac, out, between)), LEVEL)


def document(
    inp: TickInput,
    prev_served: Mapping[str, ServedInstance],
    ac: AlertConfig,
    out: TickOutput,
    between: Between = NOTHING_BETWEEN,
    memo: DumpMemo | None = None,
) -> dict[str, object]:
    """The record as a JSON document (``memo``: the values the document before it dumped, by identity,
    :class:`controller.policy.codec.DumpMemo`; the same document either way). The observation is kept as far
    as the policy reads it (:func:`policy_observation`: the handoff p99 of each pair and each instance, shown
    and never decided on, are left out; the pairs are most of an observation's size, growing with the pairs
    the window sampled, and an instance's p99 changes most ticks). The state after the tick is kept as its
    digest: a replay re-derives it and compares. ``between``: the tables recomposed since the tick before
    (operator changes served at once), which the tick's state and served weights start from; left out when
    there were none (a record without it reads as none)."""
    doc = {
        "input": _as_read_doc(dump(inp, compact=True, memo=memo)),
        "prev_served": dump(prev_served, compact=True),
        "alerts": dump(ac),
        "after": digest(out.state),
    }
    if between != NOTHING_BETWEEN:
        doc["between"] = dump(between, compact=True)
    if memo is not None:
        memo.turn()
    return doc


def policy_pairs(pairs: tuple[PairSignals, ...]) -> tuple[PairSignals, ...]:
    """The pairs as the policy reads them: their p99 (shown, never decided on) at 0."""
    return tuple(dataclasses.replace(x, handoff_p99_s=0.0) for x in pairs)


def policy_observation(obs: Observation) -> Observation:
    """The observation as the policy reads it, what a tick record keeps: the pairs' p99 at 0
    (:func:`policy_pairs`) and each instance's at None (its default)."""
    instances = tuple(dataclasses.replace(x, handoff_p99_s=None) for x in obs.instances)
    return dataclasses.replace(obs, instances=instances, pairs=policy_pairs(obs.pairs))


def _as_read_doc(inp: Any) -> Any:
    """A dumped input with its observation as :func:`policy_observation` has it, set in place (each pair's
    p99 at 0.0, a field without a default: always there; each instance's left out, as a field at its
    default is): the same document as dumping the input with :func:`policy_observation`, without copying
    the observation first."""
    obs = inp.get("obs", {})
    for pair in obs.get("pairs", ()):
        pair["handoff_p99_s"] = 0.0
    for inst in obs.get("instances", ()):
        inst.pop("handoff_p99_s", None)
    return inp


def _doc(payload: bytes) -> dict[str, object]:
    return keyframe_doc(payload)[0]


def decode_between(payload: bytes) -> Between:
    """The refreshes :func:`encode` kept (none when it kept none); raises as :func:`decode_payload`."""
    return _between(_doc(payload))


def between_of(doc: Mapping[str, object]) -> Between:
    """The refreshes a rebuilt document (:func:`rebuild`) kept."""
    return _between(doc)


def fields_of(doc: Mapping[str, object]) -> tuple[TickInput, dict[str, ServedInstance], AlertConfig, str]:
    """What :func:`decode_payload` reads, from a rebuilt document (:func:`rebuild`)."""
    return _fields(doc)


def _between(doc: Mapping[str, object]) -> Between:
    return load(Between, doc["between"]) if "between" in doc else NOTHING_BETWEEN


def decode_payload(payload: bytes) -> tuple[TickInput, dict[str, ServedInstance], AlertConfig, str]:
    """What :func:`encode` wrote, typed; raises ``zlib.error``, ``ValueError`` or ``CodecError``."""
    return _fields(_doc(payload))


def _fields(doc: Mapping[str, object]) -> tuple[TickInput, dict[str, ServedInstance], AlertConfig, str]:
    after = doc.get("after")
    if not isinstance(after, str):
        raise CodecError("after", "expected the digest of the state after the tick")
    return (
        load(TickInput, doc.get("input")),
        load(dict[str, ServedInstance], doc.get("prev_served")),
        load(AlertConfig, doc.get("alerts")),
        after,
    )


def record_tick(
    session: Session,
    inp: TickInput,
    prev_served: Mapping[str, ServedInstance],
    ac: AlertConfig,
    out: TickOutput,
    policy: str,
    epoch: int | None,
    between: Between = NOTHING_BETWEEN,
    writer: ChainWriter | None = None,
    memo: DumpMemo | None = None,
) -> int:
    """Store one tick's record, a keyframe or a delta as ``writer`` chooses (None: a keyframe); the
    payload's size in bytes. ``memo``: as :func:`document` has it."""
    link = Link(epoch, out.tick, policy, POLICY_VERSION)
    writer = writer or ChainWriter(1)
    written = writer.write(link, document(inp, prev_served, ac, out, between, memo))
    session.add(
        TickRecord(
            ts=out.table.generated_at,
            tick=out.tick,
            leader_epoch=epoch,
            policy=policy,
            policy_version=POLICY_VERSION,
            format=FORMAT,
            codec=writer.codec.name,
            keyframe=written.keyframe,
            payload=written.payload,
        )
    )
    return len(written.payload)


class TickLogRecorder:
    """:func:`record_tick` as a tick recorder (:class:`controller.effects.TickRecorder`), a keyframe
    every ``keyframe_every`` ticks (``controller.tick_keyframe_every``): counts ``tick_record_bytes``
    (the compressed payload's size)."""

    def __init__(self, keyframe_every: int = 1) -> None:
        self.writer = ChainWriter(keyframe_every)
        # the pairs' signals a tick kept from the tick before (controller.observe) are dumped once
        self.memo = DumpMemo((PairSignals,))

    def record(self, session: Session, tick: Tick) -> Mapping[str, int]:
        size = record_tick(
            session,
            tick.inp,
            tick.prev_served,
            tick.alert_config,
            tick.out,
            tick.policy,
            tick.epoch,
            tick.between,
            self.writer,
            self.memo,
        )
        return {"tick_record_bytes": size}


@dataclass(frozen=True)
class StoredWindow:
    """A window of recorded ticks with the decisions the run stored for them and its configs."""

    ticks: tuple[RecordedTick, ...]
    configs: Mapping[str, PolicyConfig]  # by fingerprint
    first_recorded: float | None  # the oldest tick record in the store (None: none at all)


def _where(row: TickRecord) -> str:
    return f"tick record {row.id} (tick {row.tick} at {row.ts:.3f})"


def _check(row: TickRecord) -> None:
    if row.policy_version != POLICY_VERSION:
        raise TickLogError(
            f"{_where(row)} was decided by policy version {row.policy_version}; this pdscope runs policy "
            f"version {POLICY_VERSION}, whose maths differ: replay refuses (use the pdscope release that "
            f"wrote it, or a window recorded by this one)"
        )
    if row.format not in FORMATS or row.codec not in CODECS:
        raise TickLogError(
            f"{_where(row)} is in format {row.format}/{row.codec}; this pdscope reads formats "
            f"{' and '.join(str(f) for f in FORMATS)} in {' or '.join(CODECS)}"
        )


def _whole(row: TickRecord) -> bool:
    return row.format == 1 or row.keyframe


def rebuild(rows: Iterable[TickRecord]) -> Iterator[dict[str, object]]:
    """The documents of consecutive records, oldest first, each delta applied to the record before it
    (the first must be whole); raises :class:`TickLogError` for one it cannot rebuild or read."""
    chain = Rebuilder()
    for row in rows:
        _check(row)
        link = Link(row.leader_epoch, row.tick, row.policy, row.policy_version)
        try:
            codec = CODECS[row.codec]
            yield (
                chain.keyframe(link, row.payload, codec)
                if _whole(row)
                else chain.delta(link, row.payload, codec)
            )
        except ChainError as exc:
            raise TickLogError(
                f"{_where(row)} is a delta that cannot be rebuilt: {exc}. Records deleted or never "
                f"committed break their chain up to the next keyframe: replay a window after it"
            ) from None
        except (zlib.error, json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
            raise TickLogError(f"{_where(row)} is corrupt: {exc}") from None


def _tick(row: TickRecord, doc: Mapping[str, object], stored: Sequence[StoredChange]) -> RecordedTick:
    try:
        inp, prev_served, alerts, after = _fields(doc)
        between = _between(doc)
    except ValueError as exc:  # CodecError included, and AlertConfig's unknown rule names
        raise TickLogError(f"{_where(row)} does not fit this pdscope's types: {exc}") from None
    return RecordedTick(
        row.ts,
        row.tick,
        row.leader_epoch,
        row.policy,
        inp,
        prev_served,
        alerts,
        after,
        tuple(stored),
        between,
    )


def _lead_in(session: Session, first: TickRecord, since: float) -> list[TickRecord]:
    """The records before ``since`` that a window starting with the delta ``first`` is rebuilt from:
    from the newest keyframe at or before it in its leader epoch. Raises :class:`TickLogError` when
    there is none (deleted by retention, or never written)."""
    if _whole(first):
        return []
    key_ts = session.scalar(
        select(func.max(TickRecord.ts)).where(
            TickRecord.keyframe.is_(True),
            TickRecord.leader_epoch.is_(None)
            if first.leader_epoch is None
            else TickRecord.leader_epoch == first.leader_epoch,  # (epoch, tick): the index's order
            TickRecord.tick <= first.tick,
            TickRecord.ts <= first.ts,
        )
    )
    if key_ts is None:
        nxt = session.scalar(
            select(func.min(TickRecord.ts)).where(TickRecord.keyframe.is_(True), TickRecord.ts > first.ts)
        )
        raise TickLogError(
            f"{_where(first)} is a delta, and the keyframe it is rebuilt from (leader epoch "
            f"{first.leader_epoch}, at or before tick {first.tick}) is not in the store: deleted by "
            f"retention (store.retention_raw_s) or never written; "
            + (
                "no later keyframe is stored"
                if nxt is None
                else f"start the window at the next keyframe, at {nxt:.3f}"
            )
        )
    return list(
        session.scalars(
            select(TickRecord)
            .where(TickRecord.ts >= key_ts, TickRecord.ts < since)
            .order_by(TickRecord.ts, TickRecord.id)
        )
    )


def _config(row: PolicyConfigRow | None, fp: str) -> PolicyConfig:
    if row is None:
        raise TickLogError(f"the policy config {fp} the window ran under is not in the store")
    try:
        cfg = PolicyConfig(**row.config)
    except TypeError as exc:
        raise TickLogError(f"the stored policy config {fp} does not fit this pdscope's: {exc}") from None
    if cfg.fingerprint() != fp:
        raise TickLogError(f"the stored policy config {fp} reads back as {cfg.fingerprint()}: refusing")
    return cfg


def _stored_changes(
    session: Session, since: float, until: float
) -> dict[tuple[int | None, int, float], list[StoredChange]]:
    out: dict[tuple[int | None, int, float], list[StoredChange]] = {}
    rows = session.scalars(
        select(Decision).where(Decision.ts >= since, Decision.ts <= until).order_by(Decision.id)
    )
    for d in rows:
        kind: Literal["instance", "pool"] = "pool" if d.subject_kind == "pool" else "instance"
        out.setdefault((d.leader_epoch, d.tick, d.ts), []).append(
            StoredChange(kind, d.subject, d.field, d.old_value, d.new_value, d.reason, d.routing_version)
        )
    return out


def read_ticks(session: Session, since: float, until: float, *, limit: int) -> StoredWindow:
    """The tick records with ``since <= ts <= until``, oldest first, at most ``limit`` of them.

    Raises :class:`TickLogError` when a row cannot be replayed, when there are more than ``limit``,
    or when decisions in the window were stored by ticks that left no record (taken before tick
    records existed, migration 0010, or with ``controller.record_ticks`` off)."""
    first = session.scalar(select(func.min(TickRecord.ts)))
    n = session.scalar(select(func.count()).where(TickRecord.ts >= since, TickRecord.ts <= until)) or 0
    if n > limit:
        raise TickLogError(
            f"the window holds {n} ticks, more than the {limit} a replay reads: narrow it (--since/--until)"
        )
    rows = list(
        session.scalars(
            select(TickRecord)
            .where(TickRecord.ts >= since, TickRecord.ts <= until)
            .order_by(TickRecord.ts, TickRecord.id)
        )
    )
    stored = _stored_changes(session, since, until)
    seen = {(r.leader_epoch, r.tick, r.ts) for r in rows}
    unrecorded = sorted(k[2] for k in stored if k not in seen)
    if unrecorded:
        raise TickLogError(
            f"{len(unrecorded)} decision(s) in the window, the first at {unrecorded[0]:.3f}, were taken by "
            f"ticks that left no record (before tick records existed: migration 0010, or with "
            f"controller.record_ticks off); the oldest tick record is "
            f"{'none' if first is None else f'at {first:.3f}'}: start the window after them"
        )
    lead = _lead_in(session, rows[0], since) if rows else []
    docs = itertools.islice(rebuild([*lead, *rows]), len(lead), None)
    ticks = tuple(
        _tick(r, doc, stored.get((r.leader_epoch, r.tick, r.ts), ()))
        for r, doc in zip(rows, docs, strict=True)
    )
    configs = {fp: _config(session.get(PolicyConfigRow, fp), fp) for fp in {t.policy for t in ticks}}
    return StoredWindow(ticks, configs, first)
