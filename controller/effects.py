"""What the reconcile loop does besides deciding and serving: its side effects, behind two small protocols.

A :class:`TickRecorder` writes inside the tick's transaction (the decisions and carried state,
:class:`controller.persist.DecisionRecorder`; the tick log, :class:`controller.ticklog.TickLogRecorder`),
so a tick is stored whole or not at all. A :class:`TickObserver` hears of the tick after the commit
(the bundle writer and the alert webhook, :mod:`controller.wiring`; the shadow policy,
:class:`controller.shadow.Shadow`) and of a restart from the store. Which
ones run is wired outside the loop (:func:`controller.wiring.default_effects`, used by
``pdscope control``), so :mod:`controller.loop` imports none of them.

This module names the seams only: no I/O, no concrete effect.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy.orm import Session

from controller.policy import (
    AlertConfig,
    AlertRule,
    AlertState,
    PolicyState,
    ServedInstance,
    TickInput,
    TickOutput,
)
from controller.policy.refresh import Between


@dataclass(frozen=True)
class Tick:
    """One tick as its effects see it: what went in, what came out, and what it started from."""

    inp: TickInput
    out: TickOutput
    prev_served: Mapping[str, ServedInstance]  # served before the tick
    prev_state: PolicyState  # the carried state the tick started from
    rules: tuple[AlertRule, ...]
    alert_config: AlertConfig
    policy: str  # the fingerprint of the config it ran under
    epoch: int  # the leader epoch it was taken under (the transaction is fenced with it)
    between: Between  # the refreshes since the tick before
    alert_ids: dict[str, int]  # active alert fingerprint -> row id: a working copy recorders update


class TickRecorder(Protocol):
    """Writes part of a tick inside its transaction."""

    def record(self, session: Session, tick: Tick) -> Mapping[str, int]:
        """Add the rows to ``session`` (the caller commits); what was written, counted by name. May
        raise: the tick fails and nothing of it is stored."""
        ...


class TickObserver(Protocol):
    """Hears of each committed tick; never holds the loop (queue the slow work), never raises."""

    def observe(self, tick: Tick) -> None: ...

    def restart(self) -> None:
        """The carried state was reloaded from the store (a start, a takeover)."""
        ...


class Bundler(Protocol):
    """What the API, the metrics and the webhook see of the bundle writer (:mod:`controller.bundle`)."""

    written: int
    failed: int
    dropped: int
    last_error: str | None
    folder: Path | None

    def alerts_changed(self, alerts: Sequence[AlertState]) -> None: ...

    def annotations(self, alert: AlertState) -> dict[str, str]: ...

    @property
    def pending(self) -> int: ...

    def close(self, timeout: float = 5.0) -> None: ...


def _no_status() -> dict[str, Any] | None:
    return None


@dataclass(frozen=True)
class Effects:
    """The loop's side effects, run in order: recorders in the transaction, observers after it.

    ``bundler`` is kept for the API's reads (``/v1/bundles``, ``/metrics``); ``shadow_status`` is the
    shadow policy's comparison (``GET /v1/shadow``; None: no shadow), called under the loop's lock."""

    bundler: Bundler
    recorders: tuple[TickRecorder, ...] = ()
    observers: tuple[TickObserver, ...] = ()
    shadow_status: Callable[[], dict[str, Any] | None] = _no_status
