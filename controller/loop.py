"""The level-triggered reconcile loop: observe -> policy -> persist -> serve.

:meth:`Reconciler.tick` re-reads everything it needs from the store each time (the
window of snapshots and records, the active overrides), runs the pure policy, stores
the result in one transaction, and only then swaps the served routing table. A tick
that fails (the store is down, a bug) is counted and logged; the served table and the
carried state stay as they were, and the next tick starts fresh from the store.

:meth:`Reconciler.refresh` recomposes the table from the current policy output and the
overrides now in the store, without advancing the policy: the API calls it after a
mutation so an override is served at once. Both hold one lock; reads of the served
values take a consistent snapshot (:meth:`Reconciler.view`).

``run_forever`` is the asyncio driver (ticks run in a worker thread); tests call
``tick`` directly with a virtual clock.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from sqlalchemy.orm import Session, sessionmaker

from controller import observe as observe_mod
from controller.notify import Notifier, NullNotifier
from controller.persist import load_overrides, load_state, persist_tick, record_policy
from controller.policy import (
    AlertConfig,
    InstanceSpec,
    Observation,
    PolicyConfig,
    PolicyState,
    PoolSpec,
    ServedInstance,
    TickInput,
    TickOutput,
    compose,
    decide,
    default_rules,
)
from controller.policy.reasons import Reason
from pdscope.config import Settings
from pdscope.routing import RoutingTable
from store.db import transaction

log = logging.getLogger(__name__)

Clock = Callable[[], float]


@dataclass(frozen=True)
class View:
    """A consistent snapshot of what the controller serves now."""

    table: RoutingTable
    served: dict[str, ServedInstance]
    last: TickOutput | None
    obs: Observation | None
    ticks: int
    failed_ticks: int
    last_ok: float | None
    last_error: str | None
    tick_seconds: float | None


@dataclass
class _Stats:
    ticks: int = 0
    failed: int = 0
    last_ok: float | None = None
    last_error: str | None = None
    tick_seconds: float | None = None


class Reconciler:
    def __init__(
        self,
        settings: Settings,
        factory: sessionmaker[Session],
        *,
        clock: Clock = time.time,
        notifier: Notifier | None = None,
        alert_config: AlertConfig | None = None,
        mode: Literal["advisory", "enforce"] | None = None,
    ) -> None:
        self.settings = settings
        self.factory = factory
        self.clock = clock
        self.notifier: Notifier = notifier or NullNotifier()
        self.cfg = PolicyConfig.from_settings(settings)
        self.alert_config = alert_config or AlertConfig.from_settings(settings)
        self.rules = default_rules(self.alert_config)
        self.mode: Literal["advisory", "enforce"] = mode or settings.controller.mode
        self.instances = tuple(
            InstanceSpec(i.name, p, settings.pools[p].role, i.url) for p, i in settings.instances()
        )
        self.pools = tuple(PoolSpec(n, p.role, p.weight) for n, p in settings.pools.items())
        # Names this process in the routing ETag: a restarted controller may reach a version number
        # an earlier process already served with other content, and the ETag must still differ.
        self.epoch = secrets.token_hex(8)
        self._lock = threading.Lock()
        self._stats = _Stats()
        self._state = PolicyState()
        self._alert_ids: dict[str, int] = {}
        self._last: TickOutput | None = None
        self._obs: Observation | None = None
        self._served: dict[str, ServedInstance] = {}
        self._loaded = False
        self.policy = self.cfg.fingerprint()  # recorded in the store when it is first read
        self._table = self._initial_table(0)

    def _initial_table(self, version: int) -> RoutingTable:
        table, served, _ = compose(
            self._state, (), self.instances, self.pools, self.mode, self.clock(), {}, {}
        )
        self._served = served
        return table.model_copy(update={"version": version})

    def _load(self, session: Session) -> None:
        self.policy = record_policy(session, self.cfg, self.clock())
        state, ids, version = load_state(session)
        self._state = state
        self._alert_ids = ids
        self._table = self._initial_table(version)
        self._state = replace(state, table=self._table)
        self._loaded = True
        log.info(
            "controller state loaded: %s weights, %s active alerts, routing version %s",
            len(state.weights),
            len(state.alerts),
            version,
        )

    # -- the tick ---------------------------------------------------------------------

    def tick(self) -> TickOutput:
        """One reconcile. Raises what failed (after counting it); the served table is unchanged."""
        with self._lock:
            started = time.perf_counter()
            self._stats.ticks += 1
            try:
                out = self._tick_locked()
            except Exception as exc:
                self._stats.failed += 1
                self._stats.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("reconcile tick %s failed: %s", self._stats.ticks, self._stats.last_error)
                raise
            self._stats.tick_seconds = time.perf_counter() - started
            self._stats.last_ok = out.table.generated_at
            self._stats.last_error = None
            return out

    def _tick_locked(self) -> TickOutput:
        now = self.clock()
        with transaction(self.factory) as session:
            if not self._loaded:
                self._load(session)
            obs = observe_mod.observe(session, self.settings, now, cfg=self.cfg)
            overrides = load_overrides(session, now)
            inp = TickInput(obs, self._state, overrides, self.instances, self.pools, self.mode)
            out = decide(inp, self.cfg, self.rules, self.alert_config)
            ids = dict(self._alert_ids)
            rows = persist_tick(session, out, self._served, ids, self._state, self.policy)
        # committed: now serve it
        self._alert_ids = ids
        self._state = out.state
        self._last = out
        self._obs = obs
        self._served = dict(out.served)
        self._table = out.table
        self.notifier.send(out.alerts.notify)
        changed = [d for d in out.weights if d.changed]
        log.info(
            "tick %s: %s weight changes, %s decisions stored, %s alerts active, routing v%s%s",
            out.tick,
            len(changed),
            len(rows),
            len(out.alerts.active),
            out.table.version,
            " (new)" if out.table_changed else "",
        )
        for d in changed:
            log.info("decision %s %s: %s", d.instance, d.reason, d.message)
        return out

    def tick_safe(self) -> TickOutput | None:
        try:
            return self.tick()
        except Exception:
            return None

    def refresh(self) -> RoutingTable:
        """Recompose the served table from the overrides in the store now (no policy step)."""
        with self._lock:
            now = self.clock()
            with transaction(self.factory) as session:
                if not self._loaded:
                    self._load(session)
                overrides = load_overrides(session, now)
            reasons = {d.instance: d.reason for d in self._last.weights} if self._last else {}
            limit_reasons = {d.pool: d.reason for d in self._last.pools} if self._last else {}
            table, served, _ = compose(
                self._state, overrides, self.instances, self.pools, self.mode, now, reasons, limit_reasons
            )
            self._table = table
            self._served = served
            self._state = replace(self._state, table=table)
            return table

    # -- reads ------------------------------------------------------------------------

    def view(self) -> View:
        with self._lock:
            s = self._stats
            return View(
                self._table,
                dict(self._served),
                self._last,
                self._obs,
                s.ticks,
                s.failed,
                s.last_ok,
                s.last_error,
                s.tick_seconds,
            )

    @property
    def table(self) -> RoutingTable:
        with self._lock:
            return self._table

    def policy_of(self, name: str) -> tuple[float, str]:
        """The policy's own weight and reason for an instance now (what applies without overrides)."""
        with self._lock:
            if self._last is not None:
                for d in self._last.weights:
                    if d.instance == name:
                        return d.weight, d.reason
            ws = self._state.weights.get(name)
            return (ws.weight, ws.reason) if ws is not None else (1.0, Reason.NO_DECISION_YET)

    # -- the driver -------------------------------------------------------------------

    async def run_forever(self, stop: asyncio.Event) -> None:
        """Tick every ``controller.interval_s`` until ``stop`` is set; never raises."""
        interval = self.settings.controller.interval_s
        while not stop.is_set():
            started = time.monotonic()
            await asyncio.to_thread(self.tick_safe)
            delay = max(0.0, interval - (time.monotonic() - started))
            try:
                await asyncio.wait_for(stop.wait(), timeout=delay)
            except TimeoutError:
                pass
