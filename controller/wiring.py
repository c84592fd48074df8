"""The controller's usual side effects, built from its settings (:func:`default_effects`).

The loop (:mod:`controller.loop`) takes its effects through :mod:`controller.effects`; this module
builds the set ``pdscope control`` runs and the tests use: the decisions and carried state stored
every tick, the tick log when ``controller.record_ticks``, the bundle writer and the alert
webhook told of alert changes after the commit, and the shadow policy when ``controller.shadow``
names settings. Building it raises :class:`pdscope.config.ConfigError` naming a bad
``controller.shadow`` setting.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sqlalchemy.orm import Session, sessionmaker

from controller.bundle import make_bundler
from controller.effects import Bundler, Effects, Tick, TickObserver, TickRecorder
from controller.notify import Notifier, NullNotifier
from controller.persist import DecisionRecorder
from controller.policy import PolicyConfig
from controller.shadow import Shadow, shadow_config
from controller.ticklog import TickLogRecorder
from pdscope.config import Settings


class _Forwarder:
    """An observer that only hands each tick's alerts on: it carries nothing from tick to tick, so a
    restart (a start, a takeover) has nothing to drop."""

    def restart(self) -> None:
        return None


class BundleObserver(_Forwarder):
    """Queues a bundle for each alert that changed (:meth:`controller.bundle.BundleWriter.alerts_changed`
    only queues: the bundle is written on the writer's thread)."""

    def __init__(self, bundler: Bundler) -> None:
        self.bundler = bundler

    def observe(self, tick: Tick) -> None:
        self.bundler.alerts_changed(tick.out.alerts.changed)


class NotifyObserver(_Forwarder):
    """Sends the alerts the policy says to notify (:meth:`controller.notify.Notifier.send` queues only)."""

    def __init__(self, notifier: Notifier) -> None:
        self.notifier = notifier

    def observe(self, tick: Tick) -> None:
        self.notifier.send(tick.out.alerts.notify)


def default_effects(
    settings: Settings,
    factory: sessionmaker[Session],
    *,
    clock: Callable[[], float] = time.time,
    notifier: Notifier | None = None,
    bundler: Bundler | None = None,
) -> Effects:
    """The usual effects. ``notifier`` None: none sent; ``bundler`` None:
    :func:`controller.bundle.make_bundler` (a writer when ``controller.bundles.enabled``)."""
    # first: a bad controller.shadow raises before a bundle writer's thread starts
    shadow = shadow_config(PolicyConfig.from_settings(settings), settings.controller.shadow)
    bundles = bundler or make_bundler(settings, factory, clock=clock)
    recorders: list[TickRecorder] = [DecisionRecorder()]
    if settings.controller.record_ticks:
        recorders.append(TickLogRecorder(settings.controller.tick_keyframe_every))
    observers: list[TickObserver] = [BundleObserver(bundles), NotifyObserver(notifier or NullNotifier())]
    if shadow is None:
        return Effects(bundles, tuple(recorders), tuple(observers))
    candidate = Shadow(*shadow)
    return Effects(bundles, tuple(recorders), (*observers, candidate), candidate.as_dict)
