"""Operator overrides: who may change what, and how a change is stored and audited.

The one shape of an override is :class:`controller.policy.Override`: the store's
``WeightOverride`` row converts to and from it (:func:`controller.persist.to_override`,
:func:`controller.persist.to_row`), and the API serves it as it is (``controller.schemas``). A
request to set one is a :class:`Change` (what the operator asked for, ``created``/``expires`` not
known until ``now`` is read inside the transaction).

A change to one subject (an instance or a pool) is serialised: an in-process lock per
subject and, in the same transaction, the store's lock for it
(:func:`controller.persist.lock_subject`). The new override, the replaced one's
``cleared`` and the ``AuditEvent`` (who, before, after, reason) are written in that one
transaction, the audit log line only after it commits, and then the served table is
recomposed at once. Errors are the service's own (:class:`UnknownSubject`,
:class:`NothingToClear`); the API turns them into 404 and 409.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from controller.loop import Reconciler
from controller.persist import load_overrides, lock_subject, to_override, to_row
from controller.policy import Override, ServedInstance
from controller.policy.routes import OverrideKey, active_overrides, serve_instance
from store.db import StoreError, transaction
from store.models import AuditEvent, WeightOverride

log = logging.getLogger(__name__)
audit_log = logging.getLogger("controller.audit")

Kind = Literal["instance", "pool"]
Slot = Literal["drain", "weight"]


class OverrideError(Exception):
    """A change that cannot be made; ``detail`` says why (nothing was written)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class UnknownSubject(OverrideError):
    """The instance or pool is not in the config."""


class NothingToClear(OverrideError):
    """A clear (or undrain) of a slot that holds no active override."""


@dataclass(frozen=True, slots=True)
class Change:
    """What an operator asks for: a new override in ``slot`` (``sets``; ``ttl_s`` None: until
    cleared), or the end of the slot's active one (:meth:`clear`). ``action`` is the audit action."""

    kind: Kind
    subject: str
    slot: Slot
    action: str
    reason: str
    actor: str
    sets: bool
    weight: float | None = None
    ttl_s: float | None = None

    @classmethod
    def clear(cls, kind: Kind, subject: str, slot: Slot, action: str, reason: str, actor: str) -> Change:
        return cls(kind, subject, slot, action, reason, actor, sets=False)

    def override(self, now: float) -> Override:
        """The override this change starts at ``now`` (id 0 until stored)."""
        drained = self.slot == "drain"
        return Override(
            0,
            self.kind,
            self.subject,
            0.0 if drained else self.weight,
            drained,
            self.reason,
            self.actor,
            now,
            None if self.ttl_s is None else now + self.ttl_s,
        )


@dataclass(frozen=True, slots=True)
class InstanceResult:
    """An instance change as committed: the active overrides and what the instance is served after it."""

    active: dict[OverrideKey, Override]
    served: ServedInstance
    audit_id: int


@dataclass(frozen=True, slots=True)
class PoolResult:
    override: Override | None  # the one this change started (None for a clear)
    audit_id: int


class OverridesService:
    """Validation and persistence of operator overrides, over the reconciler's store and view."""

    def __init__(self, reconciler: Reconciler) -> None:
        self.reconciler = reconciler
        self.instances = {s.name: s for s in reconciler.instances}
        self.pools = {p.name: p for p in reconciler.pools}
        self._locks = {("instance", n): threading.Lock() for n in self.instances} | {
            ("pool", n): threading.Lock() for n in self.pools
        }

    # -- reads ----------------------------------------------------------------------------

    def check_instance(self, name: str) -> None:
        if name not in self.instances:
            raise UnknownSubject(f"instance {name!r} is not in the config")

    def check_pool(self, name: str) -> None:
        if name not in self.pools:
            raise UnknownSubject(f"pool {name!r} is not in the config")

    def active(self) -> dict[OverrideKey, Override]:
        """The active overrides now, one per slot."""
        now = self.reconciler.clock()
        with transaction(self.reconciler.factory) as session:
            return active_overrides(load_overrides(session, now), now)

    # -- changes --------------------------------------------------------------------------

    def change_instance(self, change: Change) -> InstanceResult:
        """Clear the matching slot (drain or weight), add the new override, audit, commit, log, then serve."""
        name = change.subject
        self.check_instance(name)
        policy_weight, policy_reason = self.reconciler.policy_of(name)
        with self._serialised("instance", name) as (session, now):
            before = _served(
                name, policy_weight, policy_reason, active_overrides(load_overrides(session, now), now)
            )
            row = self._replace(session, change, now)
            acts = active_overrides(load_overrides(session, now), now)
            after = _served(name, policy_weight, policy_reason, acts)
            audit_id, line = _audit(session, now, change, _state(before), _state(after), row)
        audit_log.info(line)  # committed
        self._refresh()
        return InstanceResult(acts, after, audit_id)

    def change_pool(self, change: Change) -> PoolResult:
        pool = change.subject
        self.check_pool(pool)
        configured = self.pools[pool].weight
        with self._serialised("pool", pool) as (session, now):
            old = active_overrides(load_overrides(session, now), now).get(("pool", pool, "weight"))
            before = {
                "weight": configured if old is None else old.weight,
                "override_id": None if old is None else old.id,
            }
            row = self._replace(session, change, now)
            after = {
                "weight": configured if row is None else row.weight,
                "override_id": None if row is None else row.id,
            }
            audit_id, line = _audit(session, now, change, before, after, row)
        audit_log.info(line)  # committed
        self._refresh()
        return PoolResult(row, audit_id)

    # -- helpers --------------------------------------------------------------------------

    @contextmanager
    def _serialised(self, kind: Kind, subject: str) -> Iterator[tuple[Session, float]]:
        """One change of one subject at a time, in one transaction, with ``now`` read inside it."""
        with self._locks[(kind, subject)], transaction(self.reconciler.factory) as session:
            self.reconciler.fence_mutation(session)  # Deposed: a paused old leader writes nothing
            lock_subject(session, kind, subject)
            yield session, self.reconciler.clock()

    def _replace(self, session: Session, change: Change, now: float) -> Override | None:
        """End the slot's active override(s); store the new one (returned, with its id) when the change
        sets one."""
        cleared = _clear(session, change.kind, change.subject, change.slot == "drain", now)
        if not change.sets and cleared == 0:
            what = "drain" if change.slot == "drain" else "weight override"
            raise NothingToClear(f"{change.kind} {change.subject!r} has no active {what}")
        if not change.sets:
            session.flush()
            return None
        row = to_row(change.override(now))
        session.add(row)
        session.flush()
        return to_override(row)

    def _refresh(self) -> None:
        try:
            self.reconciler.refresh()
        except StoreError as exc:  # committed; the next tick serves it
            log.warning("refresh after a mutation failed: %s", exc)


def _served(
    name: str, policy_weight: float, policy_reason: str, acts: dict[OverrideKey, Override]
) -> ServedInstance:
    return serve_instance(
        name,
        policy_weight,
        policy_reason,
        acts.get(("instance", name, "drain")),
        acts.get(("instance", name, "weight")),
    )


def _state(s: ServedInstance) -> dict[str, Any]:
    return {
        "weight": s.weight,
        "drained": s.drained,
        "source": s.source,
        "policy_weight": s.policy_weight,
        "override_id": None if s.override is None else s.override.id,
    }


def _clear(session: Session, kind: str, subject: str, drained: bool, now: float) -> int:
    rows = session.scalars(
        select(WeightOverride).where(
            WeightOverride.subject_kind == kind,
            WeightOverride.subject == subject,
            WeightOverride.drained.is_(drained),
            WeightOverride.cleared.is_(None),
            WeightOverride.expires.is_(None) | (WeightOverride.expires > now),
        )
    )
    n = 0
    for r in rows:
        r.cleared = now
        n += 1
    return n


def _audit(
    session: Session,
    now: float,
    change: Change,
    before: dict[str, Any],
    after: dict[str, Any],
    new: Override | None,
) -> tuple[int, str]:
    """Add the audit row; returns its id and the log line to write once the transaction commits."""
    override_id = None if new is None else new.id
    ev = AuditEvent(
        ts=now,
        actor=change.actor,
        action=change.action,
        subject=change.subject,
        before=before,
        after=after,
        reason=change.reason,
        override_id=override_id,
    )
    session.add(ev)
    session.flush()
    return ev.id, json.dumps(
        {
            "event": change.action,
            "audit_id": ev.id,
            "override_id": override_id,
            "subject": change.subject,
            "actor": change.actor,
            "reason": change.reason,
            "before": before,
            "after": after,
        },
        sort_keys=True,
    )
