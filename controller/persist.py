"""The controller's writes and the state it reloads: decisions, alerts, overrides.

* :func:`load_overrides` reads the active manual overrides (the API writes them).
* :func:`lock_subject` takes the store's lock for one subject's overrides until the
  transaction ends, so two mutations of it never interleave, on SQLite or PostgreSQL.
* :func:`load_state` rebuilds the policy's carried state after a restart: each subject's
  stored ``policy_state`` (a store from before it existed: the newest decisions) and the
  alerts still pending or firing.
* :func:`record_policy` stores the policy config this process runs under, once.
* :func:`persist_tick` stores one tick: a ``Decision`` row for every value that changed
  (policy weight, served weight when an override starts or ends, pool limits), each with
  its inputs, scores, arithmetic, reason, message, the policy config it was taken under and
  the leader epoch; the carried state of every subject whose state changed; and every alert
  state change.
* :func:`latest_limit_reasons` is the reason of each pool's newest limit decision (a standby
  serves it beside the reloaded limits).

Functions take an open ``Session``; the caller owns the transaction (``store.transaction``),
so one tick is stored whole or not at all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

from sqlalchemy import bindparam, func, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from controller.effects import Tick
from controller.policy import (
    AlertState,
    LimitState,
    Override,
    PolicyConfig,
    PolicyState,
    ServedInstance,
    TickOutput,
    WeightState,
)
from controller.policy.alerts import AlertStep
from controller.policy.changes import Change, changes
from pdscope.reasons import Reason
from store.models import Alert, Decision, PolicyConfigRow, PolicyStateRow, WeightOverride


def to_override(row: WeightOverride) -> Override:
    kind: Literal["instance", "pool"] = "pool" if row.subject_kind == "pool" else "instance"
    return Override(
        row.id, kind, row.subject, row.weight, row.drained, row.reason, row.actor, row.created, row.expires
    )


def to_row(o: Override) -> WeightOverride:
    """The store's row for a new override (its id is the store's)."""
    return WeightOverride(
        subject_kind=o.subject_kind,
        subject=o.subject,
        weight=o.weight,
        drained=o.drained,
        reason=o.reason,
        actor=o.actor,
        created=o.created,
        expires=o.expires,
    )


def lock_subject(session: Session, kind: str, subject: str) -> None:
    """Hold the store's write lock for ``kind``/``subject`` until ``session``'s transaction ends.

    Call it first in the transaction, before reading. PostgreSQL: a transaction-scoped advisory
    lock keyed by the subject (other subjects go on). SQLite: ``BEGIN IMMEDIATE``, the
    database's one write lock, taken before the reads, so what is read is what is replaced.
    """
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        digest = hashlib.blake2b(f"pdscope.override:{kind}:{subject}".encode(), digest_size=8).digest()
        session.execute(
            text("SELECT pg_advisory_xact_lock(:key)"), {"key": int.from_bytes(digest, "big", signed=True)}
        )
    elif dialect == "sqlite":
        session.execute(text("BEGIN IMMEDIATE"))


def load_overrides(session: Session, now: float) -> tuple[Override, ...]:
    """Overrides not cleared and not expired at ``now``."""
    stmt = select(WeightOverride).where(
        WeightOverride.cleared.is_(None),
        (WeightOverride.expires.is_(None)) | (WeightOverride.expires > now),
    )
    return tuple(to_override(r) for r in session.scalars(stmt))


def _latest_decisions(session: Session, field: str) -> dict[str, Decision]:
    newest = (
        select(Decision.subject, func.max(Decision.id).label("id"))
        .where(Decision.field == field)
        .group_by(Decision.subject)
        .subquery()
    )
    rows = session.scalars(select(Decision).join(newest, Decision.id == newest.c.id))
    return {d.subject: d for d in rows}


def _never(_v: object) -> bool:
    return False


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


# What each carried field may hold, by its annotation: a stored state that does not fit is not loaded
_FITS: dict[str, Callable[[object], bool]] = {
    "float": _number,
    "float | None": lambda v: v is None or _number(v),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "Reason": lambda v: isinstance(v, str),
    "Reason | None": lambda v: v is None or isinstance(v, str),
}


# Fields added to a carried state after states were first stored: a row written before may lack them
# (they take their defaults); any other missing field means the row is of another shape.
ADDED_LATER: dict[type[Any], frozenset[str]] = {WeightState: frozenset({"cut_for"})}


def _carried(cls: type[Any], d: object) -> dict[str, Any] | None:
    """``d`` as keyword arguments of ``cls`` when it has exactly its fields (less those
    :data:`ADDED_LATER`), each of its type; else None."""
    if not isinstance(d, dict):
        return None
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if not set(fields) - ADDED_LATER.get(cls, frozenset()) <= set(d) <= set(fields):
        return None
    fits = all(_FITS.get(str(fields[name].type), _never)(v) for name, v in d.items())
    return dict(d) if fits else None


def _weight_state(d: object) -> WeightState | None:
    """A stored instance state; None (rebuilt from the decisions instead) when it does not fit, e.g.
    written by a version with other fields."""
    kw = _carried(WeightState, d)
    if kw is None:
        return None
    cut_for = kw.get("cut_for")
    return WeightState(
        **{
            **kw,
            "reason": Reason.of(kw["reason"]),
            "cut_for": None if cut_for is None else Reason.of(cut_for),
        }
    )


def _limit_state(d: object) -> LimitState | None:
    kw = _carried(LimitState, d)
    return None if kw is None else LimitState(**kw)


def load_state(session: Session) -> tuple[PolicyState, dict[str, int], int]:
    """``(state, alert row ids by fingerprint, last routing version)`` from what is stored."""
    weights: dict[str, WeightState] = {}
    limits: dict[str, LimitState] = {}
    for row in session.scalars(select(PolicyStateRow)):
        if row.subject_kind == "instance" and (ws := _weight_state(row.state)) is not None:
            weights[row.subject] = ws
        elif row.subject_kind == "pool" and (ls := _limit_state(row.state)) is not None:
            limits[row.subject] = ls
    # Subjects without a stored state (a store from before policy_state): from their newest decisions.
    for name, d in _latest_decisions(session, "weight").items():
        if name not in weights and d.new_value is not None:
            # A weight last lowered keeps when: recovery from it is probed and judged by evidence.
            lowered = d.ts if d.old_value is not None and d.new_value < d.old_value else None
            weights[name] = WeightState(d.new_value, d.new_value, 0, Reason.of(d.reason), 0, lowered)
    reqs = _latest_decisions(session, "max_inflight_requests")
    kvs = _latest_decisions(session, "max_inflight_kv_bytes")
    waits = _latest_decisions(session, "max_queue_wait_s")
    for pool, d in reqs.items():
        kv = kvs.get(pool)
        if pool not in limits and d.new_value is not None and kv is not None and kv.new_value is not None:
            w = waits.get(pool)
            limits[pool] = LimitState(
                int(d.new_value), int(kv.new_value), 0, None if w is None else w.new_value
            )
    alerts: dict[str, AlertState] = {}
    ids: dict[str, int] = {}
    for a in session.scalars(select(Alert).where(Alert.state.in_(("pending", "firing")))):
        ann = a.annotations or {}
        alerts[a.fingerprint] = AlertState(
            rule=a.rule,
            fingerprint=a.fingerprint,
            labels=dict(a.labels or {}),
            severity=a.severity,
            state="firing" if a.state == "firing" else "pending",
            value=a.value or 0.0,
            description=str(ann.get("description", "")),
            summary=str(ann.get("summary", "")),
            active_since=a.active_since,
            last_eval=a.last_eval,
            fired_at=a.fired_at,
        )
        ids[a.fingerprint] = a.id
    version = session.scalar(select(func.max(Decision.routing_version))) or 0
    return PolicyState(0, weights, limits, alerts, None), ids, int(version)


def latest_limit_reasons(session: Session) -> dict[str, str]:
    """Each pool's reason for its limits now: that of its newest in-flight requests limit decision."""
    return {pool: d.reason for pool, d in _latest_decisions(session, "max_inflight_requests").items()}


def record_policy(session: Session, cfg: PolicyConfig, now: float) -> str:
    """Store ``cfg`` under its fingerprint unless it is stored already; the fingerprint."""
    fp = cfg.fingerprint()
    if session.get(PolicyConfigRow, fp) is None:
        session.add(
            PolicyConfigRow(
                fingerprint=fp, version=int(fp[1:].split(":")[0]), config=cfg.as_dict(), first_seen=now
            )
        )
    return fp


def _upsert_states(session: Session, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        ins: Any = postgresql.insert(PolicyStateRow)
    elif dialect == "sqlite":
        ins = sqlite.insert(PolicyStateRow)
    else:  # pragma: no cover - the store supports these two
        raise RuntimeError(f"no upsert for the {dialect} dialect")
    stmt = ins.on_conflict_do_update(
        index_elements=["subject_kind", "subject"],
        set_={"state": ins.excluded.state, "tick": ins.excluded.tick, "ts": ins.excluded.ts},
    )
    session.execute(stmt, rows)


def _changed_states(out: TickOutput, prev: PolicyState | None) -> list[dict[str, Any]]:
    """The ``policy_state`` rows of the subjects whose carried state this tick changed."""
    ts, tick = out.table.generated_at, out.tick
    rows: list[dict[str, Any]] = []
    before_w = {} if prev is None else prev.weights
    before_l = {} if prev is None else prev.limits
    for name, ws in out.state.weights.items():
        if before_w.get(name) != ws:
            state = dataclasses.asdict(ws) | {"reason": str(ws.reason)}
            rows.append({"subject_kind": "instance", "subject": name, "state": state, "tick": tick, "ts": ts})
    for name, ls in out.state.limits.items():
        if before_l.get(name) != ls:
            rows.append(
                {
                    "subject_kind": "pool",
                    "subject": name,
                    "state": dataclasses.asdict(ls),
                    "tick": tick,
                    "ts": ts,
                }
            )
    return rows


def _decision(out: TickOutput, c: Change, policy: str | None, epoch: int | None) -> Decision:
    return Decision(
        ts=out.table.generated_at,
        tick=out.tick,
        mode=out.table.mode,
        subject_kind=c.subject_kind,
        subject=c.subject,
        field=c.field,
        old_value=c.old,
        new_value=c.new,
        reason=c.reason,
        message=c.message,
        arithmetic=c.arithmetic,
        inputs=dict(c.inputs),
        scores=dict(c.scores),
        routing_version=out.table.version,
        policy=policy,
        leader_epoch=epoch,
    )


def persist_tick(
    session: Session,
    out: TickOutput,
    prev_served: Mapping[str, ServedInstance],
    alert_ids: dict[str, int],
    prev_state: PolicyState | None = None,
    policy: str | None = None,
    *,
    epoch: int | None = None,
) -> list[Decision]:
    """Store one tick's changes; ``alert_ids`` (fingerprint -> row id) is updated in place.

    ``prev_state`` is the state the tick started from (a subject's state is stored when it differs;
    None: every subject's), ``policy`` the fingerprint of the config it ran under (:func:`record_policy`),
    ``epoch`` the leader epoch it was taken under (the caller has fenced the transaction with it).
    One ``Decision`` row per :func:`controller.policy.changes.changes`."""
    rows = [_decision(out, c, policy, epoch) for c in changes(out, prev_served)]
    session.add_all(rows)
    _upsert_states(session, _changed_states(out, prev_state))
    for st in out.alerts.changed:
        _store_alert(session, st, alert_ids)
    touch_unchanged(session, out.alerts, alert_ids)
    return rows


def touch_unchanged(session: Session, alerts: AlertStep, alert_ids: Mapping[str, int]) -> None:
    """The stored rows of the active alerts whose state did not change: their last evaluation and value,
    in one statement (an UPDATE by id for each, sent at once; an id whose row is gone updates nothing).
    Each was read and written back one by one before: a round trip an alert, 30 ms a tick with 60
    of them active."""
    changed = {a.fingerprint for a in alerts.changed}
    params = [
        {"alert_id": alert_ids[st.fingerprint], "eval_ts": st.last_eval, "eval_value": st.value}
        for st in alerts.active
        if st.fingerprint not in changed and st.fingerprint in alert_ids
    ]
    if params:
        stmt = (
            update(Alert)
            .where(Alert.id == bindparam("alert_id"))
            .values(last_eval=bindparam("eval_ts"), value=bindparam("eval_value"))
        )
        session.connection().execute(stmt, params)


def _store_alert(session: Session, st: AlertState, ids: dict[str, int]) -> None:
    row = session.get(Alert, ids[st.fingerprint]) if st.fingerprint in ids else None
    ann = {"summary": st.summary, "description": st.description}
    if row is None:
        row = Alert(
            rule=st.rule,
            fingerprint=st.fingerprint,
            labels=dict(st.labels),
            annotations=ann,
            severity=st.severity,
            state=st.state,
            value=st.value,
            active_since=st.active_since,
            fired_at=st.fired_at,
            resolved_at=st.resolved_at,
            last_eval=st.last_eval,
        )
        session.add(row)
        session.flush()
    else:
        row.state, row.value, row.annotations = st.state, st.value, ann
        row.fired_at, row.resolved_at, row.last_eval = st.fired_at, st.resolved_at, st.last_eval
    if st.state in ("pending", "firing"):
        ids[st.fingerprint] = row.id
    else:
        ids.pop(st.fingerprint, None)


class DecisionRecorder:
    """:func:`persist_tick` as a tick recorder (:class:`controller.effects.TickRecorder`): counts
    ``decisions`` (the rows stored) and updates the tick's ``alert_ids`` in place."""

    def record(self, session: Session, tick: Tick) -> Mapping[str, int]:
        rows = persist_tick(
            session,
            tick.out,
            tick.prev_served,
            tick.alert_ids,
            tick.prev_state,
            tick.policy,
            epoch=tick.epoch,
        )
        return {"decisions": len(rows)}
