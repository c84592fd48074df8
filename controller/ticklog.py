"""The tick log: each tick's whole input and the state it left, stored so the policy can be replayed.

:func:`record_tick` writes one ``tick_records`` row in the tick's own transaction (so a tick is
stored with its decisions or not at all); :func:`read_ticks` reads a window of them back as
:class:`controller.policy.replay.RecordedTick` values, refusing (:class:`TickLogError`) rows it
cannot replay faithfully: another policy version, another payload format, a payload that does not
decode into this pdscope's types.

The payload is JSON (:mod:`controller.policy.codec`, exact for floats; fields at their defaults left
out) compressed with zlib (``bench/controller_cost.py`` measures its size and cost by fleet size).
It keeps the tables the controller recomposed after operator changes since the tick before
(:class:`controller.policy.refresh.Between`; a record without them, as older ones, had none).
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controller.effects import Tick
from controller.policy import AlertConfig, PairSignals, PolicyConfig, ServedInstance, TickInput, TickOutput
from controller.policy.codec import CodecError, digest, dump, load
from controller.policy.config import POLICY_VERSION
from controller.policy.refresh import NOTHING_BETWEEN, Between
from controller.policy.replay import RecordedTick, StoredChange
from store.models import Decision, PolicyConfigRow, TickRecord

FORMAT = 1
CODEC = "json+zlib"


class TickLogError(ValueError):
    """The stored window cannot be replayed as asked; the message says why and what to do."""


def encode(
    inp: TickInput,
    prev_served: Mapping[str, ServedInstance],
    ac: AlertConfig,
    out: TickOutput,
    between: Between = NOTHING_BETWEEN,
) -> bytes:
    """The record's payload. The observation's P×D pairs are kept as far as the policy reads them (each
    pair's handoff median, count and failures, for the P×D matrix the weights are judged by; their p99,
    which it does not read, is left out: the pairs are most of an observation's size, growing with the
    pairs the window sampled). The state after the tick is kept as its
    digest: a replay re-derives it and compares. ``between``: the tables recomposed since the tick
    before (operator changes served at once), which the tick's state and served weights start from;
    left out when there were none (a record without it reads as none)."""
    obs = dataclasses.replace(inp.obs, pairs=policy_pairs(inp.obs.pairs))
    doc = {
        "input": dump(dataclasses.replace(inp, obs=obs), compact=True),
        "prev_served": dump(prev_served, compact=True),
        "alerts": dump(ac),
        "after": digest(out.state),
    }
    if between != NOTHING_BETWEEN:
        doc["between"] = dump(between, compact=True)
    return zlib.compress(json.dumps(doc, separators=(",", ":")).encode(), 6)


def policy_pairs(pairs: tuple[PairSignals, ...]) -> tuple[PairSignals, ...]:
    """The pairs as the policy reads them: their p99 (shown, never decided on) at 0."""
    return tuple(dataclasses.replace(x, handoff_p99_s=0.0) for x in pairs)


def _doc(payload: bytes) -> dict[str, object]:
    doc = json.loads(zlib.decompress(payload))
    if not isinstance(doc, dict):
        raise ValueError("not an object")
    return doc


def decode_between(payload: bytes) -> Between:
    """The refreshes :func:`encode` kept (none when it kept none); raises as :func:`decode_payload`."""
    return _between(_doc(payload))


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
) -> int:
    """Store one tick's record; the payload's size in bytes."""
    payload = encode(inp, prev_served, ac, out, between)
    session.add(
        TickRecord(
            ts=out.table.generated_at,
            tick=out.tick,
            leader_epoch=epoch,
            policy=policy,
            policy_version=POLICY_VERSION,
            format=FORMAT,
            codec=CODEC,
            payload=payload,
        )
    )
    return len(payload)


class TickLogRecorder:
    """:func:`record_tick` as a tick recorder (:class:`controller.effects.TickRecorder`): counts
    ``tick_record_bytes`` (the compressed payload's size)."""

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


def _tick(row: TickRecord, stored: Sequence[StoredChange]) -> RecordedTick:
    if row.policy_version != POLICY_VERSION:
        raise TickLogError(
            f"{_where(row)} was decided by policy version {row.policy_version}; this pdscope runs policy "
            f"version {POLICY_VERSION}, whose maths differ: replay refuses (use the pdscope release that "
            f"wrote it, or a window recorded by this one)"
        )
    if row.format != FORMAT or row.codec != CODEC:
        raise TickLogError(
            f"{_where(row)} is in format {row.format}/{row.codec}; this pdscope reads {FORMAT}/{CODEC}"
        )
    try:
        doc = _doc(row.payload)
        inp, prev_served, alerts, after = _fields(doc)
        between = _between(doc)
    except (zlib.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TickLogError(f"{_where(row)} is corrupt: {exc}") from None
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
    ticks = tuple(_tick(r, stored.get((r.leader_epoch, r.tick, r.ts), ())) for r in rows)
    configs = {fp: _config(session.get(PolicyConfigRow, fp), fp) for fp in {t.policy for t in ticks}}
    return StoredWindow(ticks, configs, first)
