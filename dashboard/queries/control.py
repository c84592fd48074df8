"""Reads about what the controller did: decisions, weights over time, alerts, the audit
trail and the mode it last ran in. Each list is bounded by the window and a LIMIT.
"""

from __future__ import annotations

import pandas as pd
from sqlalchemy import Engine, func, or_, select

from dashboard.queries.common import Window, connect, frame
from store.models import Alert, AuditEvent, Decision

# The columns each list shows, in its order.
_DECISION_COLUMNS = (
    Decision.id,
    Decision.ts,
    Decision.tick,
    Decision.mode,
    Decision.subject_kind,
    Decision.subject,
    Decision.field,
    Decision.old_value,
    Decision.new_value,
    Decision.reason,
    Decision.message,
    Decision.arithmetic,
)
_FIRING_COLUMNS = (
    Alert.rule,
    Alert.state,
    Alert.severity,
    Alert.labels,
    Alert.annotations,
    Alert.value,
    Alert.active_since,
    Alert.fired_at,
    Alert.last_eval,
)
_RECENT_ALERT_COLUMNS = (
    Alert.rule,
    Alert.state,
    Alert.severity,
    Alert.labels,
    Alert.value,
    Alert.active_since,
    Alert.fired_at,
    Alert.resolved_at,
)
_AUDIT_COLUMNS = (
    AuditEvent.ts,
    AuditEvent.actor,
    AuditEvent.action,
    AuditEvent.subject,
    AuditEvent.before,
    AuditEvent.after,
    AuditEvent.reason,
    AuditEvent.override_id,
)


def decisions(engine: Engine, window: Window, limit: int = 500) -> pd.DataFrame:
    """Decisions in the window, newest first."""
    stmt = select(*_DECISION_COLUMNS).where(Decision.ts >= window.start, Decision.ts < window.end)
    return frame(engine, stmt.order_by(Decision.ts.desc(), Decision.id.desc()).limit(limit))


def weight_history(
    engine: Engine, window: Window, field: str = "weight", limit: int = 20_000
) -> pd.DataFrame:
    """Instance weights as steps: the value each subject had at the window start, then
    every change in the window. Columns: ts, subject, weight, reason.
    """
    in_window = (
        select(Decision.ts, Decision.subject, Decision.new_value.label("weight"), Decision.reason)
        .where(
            Decision.subject_kind == "instance",
            Decision.field == field,
            Decision.ts >= window.start,
            Decision.ts < window.end,
        )
        .order_by(Decision.ts)
        .limit(limit)
    )
    before_ids = (
        select(func.max(Decision.id))
        .where(Decision.subject_kind == "instance", Decision.field == field, Decision.ts < window.start)
        .group_by(Decision.subject)
    )
    before = select(Decision.subject, Decision.new_value.label("weight"), Decision.reason).where(
        Decision.id.in_(before_ids)
    )
    df = frame(engine, in_window)
    start = frame(engine, before)
    if not start.empty:
        start.insert(0, "ts", window.start)
        df = pd.concat([start, df], ignore_index=True) if not df.empty else start
    if not df.empty:
        # Carry each subject's last value to the window end so the steps reach "now".
        last = df.sort_values("ts").groupby("subject", as_index=False).last()
        last["ts"] = window.end
        df = pd.concat([df, last], ignore_index=True).sort_values(["subject", "ts"], kind="stable")
    return df


def latest_mode(engine: Engine) -> str | None:
    """The mode ("advisory" or "enforce") of the newest decision, or None."""
    with connect(engine) as conn:
        return conn.execute(
            select(Decision.mode).order_by(Decision.ts.desc(), Decision.id.desc()).limit(1)
        ).scalar()


def firing_alerts(engine: Engine) -> pd.DataFrame:
    """Alerts firing or pending now, firing first."""
    stmt = select(*_FIRING_COLUMNS).where(Alert.state.in_(("firing", "pending")))
    return frame(engine, stmt.order_by(Alert.state, Alert.active_since.desc()))


def recent_alerts(engine: Engine, window: Window, limit: int = 200) -> pd.DataFrame:
    """Alerts active at any point in the window (including those resolved), newest first."""
    stmt = select(*_RECENT_ALERT_COLUMNS).where(
        Alert.active_since < window.end,
        or_(Alert.resolved_at.is_(None), Alert.resolved_at >= window.start),
    )
    return frame(engine, stmt.order_by(Alert.active_since.desc()).limit(limit))


def audit_trail(engine: Engine, window: Window, limit: int = 200) -> pd.DataFrame:
    """Who changed what through the API, newest first."""
    stmt = select(*_AUDIT_COLUMNS).where(AuditEvent.ts >= window.start, AuditEvent.ts < window.end)
    return frame(engine, stmt.order_by(AuditEvent.ts.desc()).limit(limit))
