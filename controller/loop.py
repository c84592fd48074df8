"""The level-triggered reconcile loop: observe -> policy -> persist -> serve.

:meth:`Reconciler.tick` re-reads everything it needs from the store each time (the
window of snapshots and records, the active overrides), runs the pure policy, stores
the result in one transaction, and only then swaps the served routing table. A tick
that fails (the store is down, a bug) is counted and logged; the served table and the
carried state stay as they were, and the next tick starts fresh from the store.

:meth:`Reconciler.refresh` recomposes the table from the current policy output and the
overrides now in the store, without advancing the policy: the API calls it after a
mutation so an override is served at once. The next tick starts from that table, so its
record keeps the refreshes since the tick before (:mod:`controller.policy.refresh`) for a
replay to re-derive. Both hold one lock; reads of the served values take a consistent
snapshot (:meth:`Reconciler.view`).

Leadership (:mod:`controller.leader`): only the leader ticks. Every interval :meth:`Reconciler.step`
keeps or seeks the lock; the first tick after taking it claims the next leader epoch in the store
and reloads the carried state (what the previous leader committed last). A tick reads its inputs
in one transaction and writes in another that starts with the fence, so a deposed leader (its lock
lost, the epoch bumped by another) writes nothing and becomes a standby. A standby runs no policy:
every interval it reloads the carried state and the overrides from the store and serves the table they compose
(:meth:`Reconciler.reload`), and it retries the lock. Every decision and the served table carry
the epoch.

Side effects go through :mod:`controller.effects`, wired by the caller: the recorders write inside the
tick's fenced transaction (the decisions, the tick log), the observers hear of it after the commit (the
webhook, the bundle writer, the shadow policy) and of each reload of the carried state. The loop imports
none of them.

``run_forever`` is the asyncio driver (steps run in a worker thread); tests call ``tick``,
``step`` and ``reload`` directly with a virtual clock.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from sqlalchemy.orm import Session, sessionmaker

from analysis.rates import RateFacts, fit_rates
from controller import observe as observe_mod
from controller.effects import Bundler, Effects, Tick
from controller.gcpace import FullCollections, young_threshold
from controller.kept import KeptReads
from controller.leader import (
    Deposed,
    LeaderInfo,
    Leadership,
    NotLeader,
    SoleLeader,
    claim,
    fence,
    lease_for,
    read_leader,
)
from controller.persist import latest_limit_reasons, load_overrides, load_state, record_policy
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
from controller.policy.refresh import Between, Refresh, recompose
from controller.rates import RatesGate
from pdscope.config import Settings
from pdscope.reasons import Reason
from pdscope.routing import RoutingTable
from store.db import StoreError, transaction

log = logging.getLogger(__name__)

Clock = Callable[[], float]
Role = Literal["leader", "standby"]


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
    role: Role = "leader"
    epoch: int | None = None  # the leader epoch: this controller's as leader, the store's as standby
    leader: LeaderInfo | None = None  # the store's leader as last read (None: not read yet)
    takeovers: int = 0
    deposed: int = 0
    tick_record_bytes: int | None = None  # the newest tick record's compressed size (None: none written)
    # each kept window's reads since start: (window, whole, changes only)
    window_reads: tuple[tuple[str, int, int], ...] = ()
    # the serving loop's full garbage collections (controller.gcpace): how many, their CPU seconds
    full_collections: tuple[int, float] = (0, 0.0)


@dataclass
class _Stats:
    ticks: int = 0  # on a standby, a reload from the store counts as its tick
    failed: int = 0
    last_ok: float | None = None
    last_error: str | None = None
    tick_seconds: float | None = None
    tick_record_bytes: int | None = None  # the newest tick record's compressed size
    takeovers: int = 0
    deposed: int = 0


class Reconciler:
    def __init__(
        self,
        settings: Settings,
        factory: sessionmaker[Session],
        *,
        effects: Effects,
        clock: Clock = time.time,
        alert_config: AlertConfig | None = None,
        mode: Literal["advisory", "enforce"] | None = None,
        leadership: Leadership | None = None,
    ) -> None:
        """``effects``: what a tick stores and who hears of it (:mod:`controller.effects`; the usual set:
        :func:`controller.wiring.default_effects`). ``leadership`` None: :class:`controller.leader.SoleLeader`
        (always leads, still claims an epoch and fences every tick)."""
        self.settings = settings
        self.factory = factory
        self.clock = clock
        self.effects = effects
        self.bundler: Bundler = effects.bundler  # read by the API (bundles, /metrics)
        self.cfg = PolicyConfig.from_settings(settings)
        self.alert_config = alert_config or AlertConfig.from_settings(settings)
        self.rules = default_rules(self.alert_config)
        self.mode: Literal["advisory", "enforce"] = mode or settings.controller.mode
        self.instances = tuple(
            InstanceSpec(i.name, p, settings.pools[p].role, i.url) for p, i in settings.instances()
        )
        self.pools = tuple(PoolSpec(n, p.role, p.weight) for n, p in settings.pools.items())
        # in the routing ETag: a restarted process may reach a version an earlier one served otherwise
        self.epoch = secrets.token_hex(8)
        self._lock = threading.Lock()
        self._stats = _Stats()
        self._state = PolicyState()
        self._alert_ids: dict[str, int] = {}
        self._last: TickOutput | None = None
        self._obs: Observation | None = None
        self._served: dict[str, ServedInstance] = {}
        self._between = Between()  # the refreshes since the last committed tick, for its record
        self._loaded = False
        self.policy = self.cfg.fingerprint()  # recorded in the store when it is first read
        self.leadership: Leadership = leadership or SoleLeader()
        self.lease_s = lease_for(settings.controller.interval_s)
        self._leading = self.leadership.held()  # no I/O: a PostgreSQL lock is only tried by step()
        self._epoch: int | None = None  # claimed by the first tick after taking the lock
        self._leader: LeaderInfo | None = None
        self._mode_warned: int | None = None  # the leader epoch whose other mode was last warned about
        self._table = self._initial_table(0)
        # the leader's fitted rates (controller.rates); the reads kept between its ticks (controller.kept)
        self._rates = RatesGate(every_s=settings.controller.rates_every_s)
        self._kept = KeptReads(self.settings.controller.whole_read_every_s)
        self.collections = _collections(settings)

    def _new_kept(self) -> KeptReads:
        """Reads kept from now on (the next tick reads its windows whole), each window's counts of the
        kept reads before them carried over the process's life."""
        return self._kept.restarted(self.settings.controller.whole_read_every_s)

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
        # past what this process served already (as a standby, say): its ETag must not name other content
        floor = self._table.version + 1 if self._table.version > 0 else 0
        self._table = self._initial_table(max(version, floor))
        self._state = replace(state, table=self._table)
        self._between = Between()  # a replay takes a restart's first tick as recorded
        self._kept = self._new_kept()
        self._loaded = True
        for observer in self.effects.observers:
            observer.restart()
        log.info(
            "controller state loaded: %s weights, %s active alerts, routing version %s",
            len(state.weights),
            len(state.alerts),
            version,
        )

    # -- the tick ---------------------------------------------------------------------

    def tick(self) -> TickOutput:
        """One reconcile as the leader. Raises what failed (after counting it); the served table is unchanged.

        Raises :class:`controller.leader.NotLeader` on a standby (nothing is read or written), and
        :class:`controller.leader.Deposed` when the store's epoch is not this controller's: nothing is
        written and the controller is a standby from then on."""
        with self._lock:
            if not self._leading:
                raise NotLeader(self._leader)
            started = time.perf_counter()
            self._stats.ticks += 1
            try:
                if self._epoch is None:
                    self._take_over_locked()
                out = self._tick_locked()
            except Deposed as exc:
                self._stats.deposed += 1
                self._stats.last_error = f"Deposed: {exc.detail}"
                self._stand_down_locked(exc.detail, exc.leader)
                raise
            except Exception as exc:
                self._stats.failed += 1
                self._stats.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("reconcile tick %s failed: %s", self._stats.ticks, self._stats.last_error)
                raise
            self._stats.tick_seconds = time.perf_counter() - started
            self._stats.last_ok = out.table.generated_at
            self._stats.last_error = None
            return out

    def _take_over_locked(self) -> None:
        """Claim the next epoch (waiting for the previous leader's tick in flight to commit) and reload
        the carried state as it stands after that commit."""
        with transaction(self.factory) as session:
            before, mine = claim(session, self.leadership.holder, self.clock(), self.lease_s, self.mode)
            self._load(session)
        self._epoch, self._leader = mine.epoch, mine
        self._stats.takeovers += 1
        log.warning(
            "leader: %s took over at epoch %s (previous: %s)",
            mine.holder,
            mine.epoch,
            "none" if before is None or not before.holder else f"{before.holder}, epoch {before.epoch}",
        )

    def _tick_locked(self) -> TickOutput:
        now = self.clock()
        epoch = self._epoch
        assert epoch is not None  # claimed by the caller
        try:
            return self._decide_and_serve(now, epoch)
        except BaseException:
            # what was read into the kept window may be half of a read: read it whole next tick
            self._kept = self._new_kept()
            raise

    def _decide_and_serve(self, now: float, epoch: int) -> TickOutput:
        """Read the window, decide, then write in a fenced transaction of its own. The reads hold no lock
        and no lease: a large fleet's observation can take longer than the lease, past which the server
        ends a fenced transaction left idle (``controller.leader.fence``), as it must for a paused leader;
        what the tick writes is fenced, so a leader deposed meanwhile writes nothing."""
        if not self._loaded:
            with transaction(self.factory) as session:
                fence(session, epoch, self.lease_s)
                self._load(session)
        with transaction(self.factory) as session:
            facts: list[RateFacts] | None = [] if self._rates.due(now) else None  # a fit on its cadence
            obs = observe_mod.observe(
                session, self.settings, now, cfg=self.cfg, rate_facts=facts, kept=self._kept
            )
            overrides = load_overrides(session, now)
        inp = TickInput(obs, self._state, overrides, self.instances, self.pools, self.mode)
        out = decide(inp, self.cfg, self.rules, self.alert_config)
        tick = self._tick_of(inp, out, epoch)
        with transaction(self.factory) as session:
            fence(session, epoch, self.lease_s)  # first: a deposed leader writes nothing more
            written = self._record(session, tick)
        # committed: now serve it
        self._between = Between()
        self._alert_ids = tick.alert_ids
        self._state = out.state
        self._last = out
        self._obs = obs
        self._served = dict(out.served)
        self._table = _stamped(out.table, epoch)
        if facts is not None:
            self._fit_rates(facts, now)
        for observer in self.effects.observers:
            observer.observe(tick)
        changed = [d for d in out.weights if d.changed]
        log.info(
            "tick %s: %s weight changes, %s decisions stored, %s alerts active, routing v%s%s, %s",
            out.tick,
            len(changed),
            written.get("decisions", 0),
            len(out.alerts.active),
            out.table.version,
            " (new)" if out.table_changed else "",
            self._rates_note(now),
        )
        for d in changed:
            log.info("decision %s %s: %s", d.instance, d.reason, d.message)
        return out

    def _fit_rates(self, facts: list[RateFacts], now: float) -> None:
        """Fit the rates of the window just read and offer them to the gate. They are no decision: a fit
        that fails is logged and the served rates stay; the tick stands, and the next fit waits its
        cadence (a fit that fails on this window would fail on the next tick's too)."""
        try:
            self._rates.offer(fit_rates(facts, now, self.settings.controller.window_s), now)
        except ValueError as exc:  # a figure out of the wire's bounds (pydantic's error is one)
            self._rates.last_fit = now
            log.warning("rates not fitted at %.3f: %s", now, exc)

    def _rates_note(self, now: float) -> str:
        """What the tick's log line says of the rates: fitted by this tick, or the last fit's age."""
        last, served = self._rates.last_fit, self._rates.served
        if last is None:
            return "rates not fitted"
        fit = "rates fitted" if last == now else f"rates fitted {now - last:.1f} s ago"
        return fit + ("" if served is None else f", served from {now - served.at:.1f} s ago")

    def _tick_of(self, inp: TickInput, out: TickOutput, epoch: int) -> Tick:
        return Tick(
            inp,
            out,
            self._served,
            self._state,
            self.rules,
            self.alert_config,
            self.policy,
            epoch,
            self._between,
            dict(self._alert_ids),
        )

    def _record(self, session: Session, tick: Tick) -> dict[str, int]:
        """Run the recorders in the tick's transaction; what they wrote, counted by name."""
        written: dict[str, int] = {}
        for recorder in self.effects.recorders:
            written.update(recorder.record(session, tick))
        if "tick_record_bytes" in written:
            self._stats.tick_record_bytes = written["tick_record_bytes"]
        return written

    def tick_safe(self) -> TickOutput | None:
        try:
            return self.tick()
        except Exception:
            return None

    def refresh(self) -> RoutingTable:
        """Recompose the served table from the overrides in the store now (no policy step); a standby
        reloads instead (:meth:`reload`)."""
        with self._lock:
            if not self._leading:
                return self._reload_locked()
            now = self.clock()
            with transaction(self.factory) as session:
                if not self._loaded:
                    self._load(session)
                overrides = load_overrides(session, now)
            refresh = Refresh(now, overrides)
            table, served = recompose(self._state, self._last, refresh, self.instances, self.pools, self.mode)
            self._between = self._between.add(refresh)  # the next tick's record: a replay re-derives it
            self._table = _stamped(table, self._epoch)
            self._served = served
            self._state = replace(self._state, table=table)
            return self._table

    # -- leadership -------------------------------------------------------------------

    @property
    def role(self) -> Role:
        with self._lock:
            return "leader" if self._leading else "standby"

    def step(self) -> TickOutput | None:
        """One interval of the driver; never raises. Keep or seek the lock, then tick as the leader
        (its output; None when it failed) or reload as a standby (None)."""
        if self._leading and not self.leadership.held():
            with self._lock:
                self._stand_down_locked("the leadership lock was lost", self._leader)
        if not self._leading and self.leadership.acquire():
            with self._lock:
                self._leading, self._epoch = True, None  # the tick claims the next epoch
        if self._leading:
            return self.tick_safe()
        try:
            self.reload()
        except Exception:  # counted and logged by reload
            pass
        return None

    def fence_mutation(self, session: Session) -> None:
        """First in an operator change's transaction: the same fence as a tick's, so a leader that was
        deposed without noticing yet (paused past its lock) writes no override. Raises
        :class:`controller.leader.Deposed` (a 409 naming the new leader). Before this leader's first
        tick has claimed its epoch there is nothing to fence with: the lock alone holds."""
        with self._lock:
            epoch = self._epoch if self._leading else None
        if epoch is not None:
            fence(session, epoch, self.lease_s)

    def require_leader(self) -> None:
        """Raises :class:`controller.leader.NotLeader` naming the store's leader (read now) on a standby."""
        with self._lock:
            if self._leading:
                return
            known = self._leader
        try:
            with transaction(self.factory) as session:
                known = read_leader(session) or known
        except StoreError as exc:
            log.warning("standby: cannot read the leader from the store: %s", exc)
        raise NotLeader(known)

    def _stand_down_locked(self, why: str, leader: LeaderInfo | None) -> None:
        was = self._epoch
        self._leading, self._epoch, self._loaded = False, None, False
        self._leader = leader
        self._last = self._obs = None  # a standby serves what is stored, not its last tick
        self._rates.clear()  # and no rates: only the leader reads the window and fits them
        self.leadership.release()
        log.warning(
            "standby: %s; this controller (epoch %s) writes nothing from now on and serves what the "
            "leader stores",
            why,
            was,
        )

    def reload(self) -> RoutingTable:
        """A standby's tick: the carried state and overrides from the store, and the table they compose.
        Raises what failed (after counting it); the served table is unchanged."""
        with self._lock:
            return self._reload_locked()

    def _reload_locked(self) -> RoutingTable:
        started = time.perf_counter()
        self._stats.ticks += 1
        now = self.clock()
        try:
            with transaction(self.factory) as session:
                leader = read_leader(session)
                state, ids, version = load_state(session)
                overrides = load_overrides(session, now)
                limit_reasons = latest_limit_reasons(session)
        except Exception as exc:
            self._stats.failed += 1
            self._stats.last_error = f"{type(exc).__name__}: {exc}"
            log.warning("standby reload %s failed: %s", self._stats.ticks, self._stats.last_error)
            raise
        # compose against what this process served last, so a version is new only when its content is
        prev = _stamped(self._table, None)
        if prev.version < version:
            prev = prev.model_copy(update={"version": version})
        table, served, _ = compose(
            replace(state, table=prev),
            overrides,
            self.instances,
            self.pools,
            self._leaders_mode(leader),
            now,
            {},
            limit_reasons,
        )
        self._state = replace(state, table=table)
        self._alert_ids = ids
        self._served = served
        self._leader = leader
        self._table = _stamped(table, None if leader is None or not leader.holder else leader.epoch)
        self._stats.tick_seconds = time.perf_counter() - started
        self._stats.last_ok = now
        self._stats.last_error = None
        return self._table

    def _leaders_mode(self, leader: LeaderInfo | None) -> Literal["advisory", "enforce"]:
        """The mode a standby serves: the leader's as stored (its own when the store names none), with
        one WARNING per leader epoch whose mode differs from this controller's configured one."""
        mode = leader.mode if leader is not None else None
        if mode not in ("advisory", "enforce"):
            return self.mode
        if mode != self.mode and leader is not None and self._mode_warned != leader.epoch:
            self._mode_warned = leader.epoch
            log.warning(
                "standby: configured mode %s differs from the leader's (%s, epoch %s, %s): serving the "
                "leader's mode; make controller.mode the same on every replica",
                self.mode,
                mode,
                leader.epoch,
                leader.holder,
            )
        return "enforce" if mode == "enforce" else "advisory"

    # -- reads ------------------------------------------------------------------------

    def shadow_status(self) -> dict[str, Any] | None:
        """The shadow policy's comparison with the live one (``GET /v1/shadow``); None: no shadow."""
        with self._lock:
            return self.effects.shadow_status()

    def view(self) -> View:
        with self._lock:
            s = self._stats
            leading = self._leading
            seen = self._leader if self._leader is not None and self._leader.holder else None
            epoch = self._epoch if leading else (None if seen is None else seen.epoch)
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
                "leader" if leading else "standby",
                epoch,
                seen,
                s.takeovers,
                s.deposed,
                s.tick_record_bytes,
                self._kept.read_counts(),
                (self.collections.runs, self.collections.seconds),
            )

    @property
    def table(self) -> RoutingTable:
        """The served table without the rates (what the policy composed)."""
        with self._lock:
            return self._table

    def routing(self) -> tuple[RoutingTable, str]:
        """The table as ``GET /v1/routing`` serves it, with the rates, and the rates' digest for its ETag
        (``""``: no rates served)."""
        with self._lock:
            served = self._rates.served
            if served is None:
                return self._table, ""
            return self._table.model_copy(update={"rates": served.rates}), served.tag

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
        """:meth:`step` every ``controller.interval_s`` until ``stop`` is set, CPython's full garbage
        collections paced by the steps while ``self.collections`` is entered (:mod:`controller.gcpace`:
        ``pdscope control`` enters it); never raises."""
        interval = self.settings.controller.interval_s
        while not stop.is_set():
            started = time.monotonic()
            await asyncio.to_thread(self._paced_step)
            delay = max(0.0, interval - (time.monotonic() - started))
            try:
                await asyncio.wait_for(stop.wait(), timeout=delay)
            except TimeoutError:
                pass

    def _paced_step(self) -> None:
        self.step()
        self.collections.after_step()


def _collections(settings: Settings) -> FullCollections:
    """The serving loop's garbage collections: the full ones at ``controller.full_collection_every``, and
    the young ones' threshold above the working set of a tick over this fleet (:mod:`controller.gcpace`)."""
    instances = sum(1 for _ in settings.instances())
    return FullCollections(settings.controller.full_collection_every, young=young_threshold(instances))


def _stamped(table: RoutingTable, epoch: int | None) -> RoutingTable:
    """``table`` as served, with the leader epoch. The policy composes tables without it (its
    ``same_content`` would see a new epoch as new content)."""
    return table if table.leader_epoch == epoch else table.model_copy(update={"leader_epoch": epoch})
