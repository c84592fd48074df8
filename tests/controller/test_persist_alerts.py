"""A tick's active alerts whose state did not change are kept current in the store (their last evaluation
and value) by one statement: each row by its id, the changed ones left to their own writes, an id whose
row is gone passed over. On SQLite and on PostgreSQL (the ``pg`` tier)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from controller.persist import touch_unchanged
from controller.policy.alerts import AlertState, AlertStep
from store.models import Alert


def _state(fingerprint: str, last_eval: float, value: float) -> AlertState:
    return AlertState(
        "KVTransferSlow",
        fingerprint,
        {"instance": fingerprint},
        "warning",
        "firing",
        value,
        "",
        "",
        100.0,
        last_eval,
    )


def _row(fingerprint: str) -> Alert:
    return Alert(
        rule="KVTransferSlow",
        fingerprint=fingerprint,
        state="firing",
        severity="warning",
        value=1.0,
        active_since=100.0,
        last_eval=100.0,
    )


def test_the_unchanged_active_alerts_are_kept_current(store_factory: Any) -> None:
    with store_factory.begin() as session:
        session.add_all([_row(f"a{k}") for k in range(4)])
    with store_factory() as session:
        ids = {r.fingerprint: r.id for r in session.scalars(select(Alert))}
    ids["gone"] = max(ids.values()) + 100  # a row deleted behind the controller's back
    step = AlertStep(
        active=(
            _state("a0", 130.0, 2.5),
            _state("a1", 130.0, 3.5),
            _state("a2", 130.0, 9.0),
            _state("gone", 130.0, 1.0),
        ),
        changed=(_state("a2", 130.0, 9.0),),  # written by its own path, not here
        notify=(),
    )
    with store_factory.begin() as session:
        touch_unchanged(session, step, ids)
    with store_factory() as session:
        rows = {r.fingerprint: (r.last_eval, r.value) for r in session.scalars(select(Alert))}
    assert rows == {"a0": (130.0, 2.5), "a1": (130.0, 3.5), "a2": (100.0, 1.0), "a3": (100.0, 1.0)}
