"""Policy replay: re-run :func:`decide` over recorded ticks, under the stored or a candidate config.

Every tick the controller takes is recorded whole (``controller.ticklog``): the observation, the
state it carried in, the overrides, the fleet, the mode, what was served before it, and the state it
left. :func:`replay` feeds those inputs through the policy again, carrying its *own* state from tick
to tick (and, between two ticks, recomposing its table after each operator change as the controller
did: :mod:`controller.policy.refresh`), and compares what it decides with what the run decided:

* under the stored config (each tick's own) it must reproduce the run exactly: the same decisions
  (subject, field, old and new value, reason, routing version) and the same state after every tick.
  That is the test of the replay itself (:attr:`ReplayResult.reproduced`).
* under a candidate config it says where the candidate's decisions part from the run's: the first
  divergence, how many ticks differ, how long each instance would have been served at what weight,
  each pool's limits, and the alerts that would have fired. The run's side is the run re-derived
  under its stored configs (checked against what was stored, as above): a tick record keeps only a
  digest of the state a tick left, and the re-derived run is what that digest is checked against.

A replay is open-loop: the observations are the ones the run saw. It answers "what would this
policy have decided on the same evidence", not "what would the fleet have done" (that is the
what-if on the simulator). A controller restart inside the window (a new leader epoch, or the tick
counter starting again) is replayed as the restart did it: the carried weights, limits and alerts
are kept (an alert's last notification time is not stored, so it is forgotten), the tick counter and
the routing table are the restarted controller's.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from controller.policy.alerts import AlertConfig, default_rules
from controller.policy.changes import changes
from controller.policy.codec import digest
from controller.policy.config import PolicyConfig
from controller.policy.refresh import NOTHING_BETWEEN, Between, recompose
from controller.policy.routes import ServedInstance
from controller.policy.tick import PolicyState, TickInput, TickOutput, decide

MAX_LISTED = 50  # divergences and mismatches listed (all are counted)


@dataclass(frozen=True)
class StoredChange:
    """A decision the run stored (a ``decisions`` row), as replay compares it."""

    subject_kind: Literal["instance", "pool"]
    subject: str
    field: str
    old: float | None
    new: float | None
    reason: str
    routing_version: int | None = None


@dataclass(frozen=True)
class RecordedTick:
    ts: float
    tick: int
    epoch: int | None
    policy: str  # fingerprint of the config it was decided under
    inp: TickInput
    prev_served: Mapping[str, ServedInstance]
    alerts: AlertConfig
    after: str  # digest of the state the tick left (controller.policy.codec.digest)
    stored: tuple[StoredChange, ...] = ()
    between: Between = NOTHING_BETWEEN  # the tables recomposed since the tick before (operator changes)


@dataclass(frozen=True)
class Divergence:
    ts: float
    tick: int
    what: Literal["weight", "limit", "alert", "decision", "state"]
    subject: str
    field: str
    actual: str
    replayed: str


@dataclass(frozen=True)
class Levels:
    """Seconds spent at each value, the time-weighted mean and the minimum."""

    seconds: Mapping[float, float]
    mean: float | None
    low: float | None


@dataclass(frozen=True)
class Compared:
    actual: Levels
    replayed: Levels


@dataclass(frozen=True)
class AlertTally:
    actual_firing_s: float
    replayed_firing_s: float
    actual_fired: int  # times it started firing
    replayed_fired: int


@dataclass(frozen=True)
class ReplayResult:
    ticks: int
    since: float | None
    until: float | None
    policies: tuple[str, ...]  # the stored configs the window ran under, in order of first use
    candidate: str | None  # the candidate's fingerprint; None: the stored configs
    restarts: int  # controller restarts inside the window
    # the run re-derived under its stored configs: every decision and carried state exactly as stored
    # (a candidate is compared with this re-derived run, so its comparison holds only when this is true)
    reproduced: bool
    divergent_ticks: int  # ticks where what was served or firing differs from the run
    first_divergence: Divergence | None
    divergences: tuple[Divergence, ...]
    mismatches: tuple[Divergence, ...]  # decisions or state unlike what was stored
    mismatch_count: int
    weights: Mapping[str, Compared]  # served weight by instance
    limits: Mapping[str, Mapping[str, Compared]]  # pool -> limit field -> levels
    alerts: Mapping[str, AlertTally]  # "Rule{label=value,...}"
    decisions: Mapping[str, tuple[int, int]]  # reason -> (actual, replayed) decision counts
    timeline: Mapping[str, tuple[tuple[float, float, float], ...]] = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        return self.divergent_ticks == 0


def reloaded(carried: PolicyState, stored: PolicyState) -> PolicyState:
    """The state a restarted controller starts from, given what the replay carried to the restart."""
    alerts = {fp: dataclasses.replace(a, last_notified=None) for fp, a in carried.alerts.items()}
    return PolicyState(stored.tick, carried.weights, carried.limits, alerts, stored.table)


def served_weights(state: PolicyState) -> dict[str, float]:
    table = state.table
    return {} if table is None else {r.name: r.weight for r in table.instances}


def _limits(state: PolicyState) -> dict[tuple[str, str], float | None]:
    table = state.table
    out: dict[tuple[str, str], float | None] = {}
    for p in [] if table is None else table.pools:
        for f in ("max_inflight_requests", "max_inflight_kv_bytes", "max_queue_wait_s"):
            out[(p.name, f)] = getattr(p, f)
    return out


def _firing(state: PolicyState) -> dict[str, str]:
    return {_alert_key(a.rule, a.labels): a.state for a in state.alerts.values() if a.state == "firing"}


def _alert_key(rule: str, labels: Mapping[str, str]) -> str:
    inner = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k not in ("alertname", "severity"))
    return f"{rule}{{{inner}}}"


def _fmt(v: float | None) -> str:
    return "none" if v is None else f"{v:.4g}"


def differences(ts: float, tick: int, actual: PolicyState, other: PolicyState) -> list[Divergence]:
    """Where ``other`` serves or fires differently from ``actual``: served weights, pool limits, alerts."""
    out: list[Divergence] = []
    a, r = served_weights(actual), served_weights(other)
    for name in sorted(set(a) | set(r)):
        if a.get(name) != r.get(name):
            out.append(
                Divergence(ts, tick, "weight", name, "served_weight", _fmt(a.get(name)), _fmt(r.get(name)))
            )
    al, rl = _limits(actual), _limits(other)
    for key in sorted(set(al) | set(rl)):
        if al.get(key) != rl.get(key):
            out.append(Divergence(ts, tick, "limit", key[0], key[1], _fmt(al.get(key)), _fmt(rl.get(key))))
    af, rf = _firing(actual), _firing(other)
    for alert in sorted(set(af) ^ set(rf)):
        not_a, not_r = af.get(alert, "not firing"), rf.get(alert, "not firing")
        out.append(Divergence(ts, tick, "alert", alert, "state", not_a, not_r))
    return out


def _decision_diffs(
    t: RecordedTick, out: TickOutput, prev_served: Mapping[str, ServedInstance]
) -> list[Divergence]:
    mine = [
        StoredChange(c.subject_kind, c.subject, c.field, c.old, c.new, c.reason, out.table.version)
        for c in changes(out, prev_served)
    ]
    if mine == list(t.stored):
        return []
    theirs = {(s.subject_kind, s.subject, s.field): s for s in t.stored}
    ours = {(s.subject_kind, s.subject, s.field): s for s in mine}
    diffs = []
    for key in sorted(set(theirs) | set(ours)):
        s, m = theirs.get(key), ours.get(key)
        if s != m:
            diffs.append(Divergence(t.ts, t.tick, "decision", key[1], key[2], _change(s), _change(m)))
    if not diffs:  # the same set in another order
        diffs.append(Divergence(t.ts, t.tick, "decision", "*", "order", "stored order", "replayed order"))
    return diffs


def _change(c: StoredChange | None) -> str:
    if c is None:
        return "no decision"
    return f"{_fmt(c.old)} -> {_fmt(c.new)} ({c.reason}, routing v{c.routing_version})"


class _Levels:
    """Accumulates seconds at each value of one series."""

    def __init__(self) -> None:
        self.seconds: defaultdict[float, float] = defaultdict(float)

    def add(self, value: float | None, dt: float) -> None:
        if value is not None and dt > 0:
            self.seconds[round(float(value), 4)] += dt

    def done(self) -> Levels:
        total = sum(self.seconds.values())
        mean = sum(v * s for v, s in self.seconds.items()) / total if total > 0 else None
        low = min(self.seconds) if self.seconds else None
        return Levels(dict(sorted(self.seconds.items())), mean, low)


class _Tally:
    """What the replay accumulates across ticks."""

    def __init__(self) -> None:
        self.weights: defaultdict[str, tuple[_Levels, _Levels]] = defaultdict(lambda: (_Levels(), _Levels()))
        self.limits: defaultdict[tuple[str, str], tuple[_Levels, _Levels]] = defaultdict(
            lambda: (_Levels(), _Levels())
        )
        self.firing_s: defaultdict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        self.fired: defaultdict[str, list[int]] = defaultdict(lambda: [0, 0])
        self.was_firing: tuple[set[str], set[str]] = (set(), set())
        self.decisions: defaultdict[str, list[int]] = defaultdict(lambda: [0, 0])
        self.timeline: defaultdict[str, list[tuple[float, float, float]]] = defaultdict(list)

    def add(
        self,
        t: RecordedTick,
        actual: PolicyState,
        replayed: PolicyState,
        out: TickOutput,
        prev: Mapping[str, ServedInstance],
        dt: float,
    ) -> None:
        a, r = served_weights(actual), served_weights(replayed)
        for name in set(a) | set(r):
            self.weights[name][0].add(a.get(name), dt)
            self.weights[name][1].add(r.get(name), dt)
            point = (t.ts, a.get(name, float("nan")), r.get(name, float("nan")))
            series = self.timeline[name]
            if not series or series[-1][1:] != point[1:]:
                series.append(point)
        al, rl = _limits(actual), _limits(replayed)
        for key in set(al) | set(rl):
            self.limits[key][0].add(al.get(key), dt)
            self.limits[key][1].add(rl.get(key), dt)
        for side, firing in enumerate((_firing(actual), _firing(replayed))):
            for alert in firing:
                self.firing_s[alert][side] += dt
                if alert not in self.was_firing[side]:
                    self.fired[alert][side] += 1
            self.was_firing[side].clear()
            self.was_firing[side].update(firing)
        for c in t.stored:
            self.decisions[c.reason][0] += 1
        for ch in changes(out, prev):
            self.decisions[ch.reason][1] += 1


def replay(
    ticks: Sequence[RecordedTick],
    configs: Mapping[str, PolicyConfig],
    candidate: PolicyConfig | None = None,
    candidate_alerts: AlertConfig | None = None,
) -> ReplayResult:
    """Replay ``ticks`` (oldest first) under ``candidate`` (None: each tick's stored config, from
    ``configs`` by fingerprint) and compare with the run. ``candidate_alerts`` None: the stored ones."""
    tally = _Tally()
    divergences: list[Divergence] = []
    mismatches: list[Divergence] = []
    n_mismatch = divergent = 0
    run, cand = _Carried(adopts=True), _Carried(adopts=False)
    for i, t in enumerate(ticks):
        # the run, re-derived under its stored config and checked against what was stored
        cfg = configs[t.policy]
        out, prev_served = run.step(t, cfg, t.alerts)
        miss = _decision_diffs(t, out, prev_served)
        if run.state_in != t.inp.state:
            miss.append(Divergence(t.ts, t.tick, "state", "*", "state before", "stored", "replayed differs"))
        if digest(out.state) != t.after:
            miss.append(Divergence(t.ts, t.tick, "state", "*", "state after", "stored", "replayed differs"))
        n_mismatch += len(miss)
        mismatches.extend(miss[: max(0, MAX_LISTED - len(mismatches))])
        if candidate is None and candidate_alerts is None:
            c_out, c_prev = out, prev_served
        else:
            c_cfg = candidate if candidate is not None else cfg
            c_out, c_prev = cand.step(
                t, c_cfg, candidate_alerts if candidate_alerts is not None else t.alerts
            )
        diffs = differences(t.ts, t.tick, out.state, c_out.state)
        if diffs:
            divergent += 1
            divergences.extend(diffs[: max(0, MAX_LISTED - len(divergences))])
        nxt = ticks[i + 1].ts if i + 1 < len(ticks) else t.ts + cfg.interval_s
        tally.add(t, out.state, c_out.state, c_out, c_prev, max(0.0, min(nxt - t.ts, 10 * cfg.interval_s)))
    return _result(ticks, candidate, tally, divergences, mismatches, n_mismatch, divergent, run.restarts)


class _Carried:
    """One policy's state carried across the replayed ticks (the run's, or the candidate's)."""

    def __init__(self, *, adopts: bool) -> None:
        self.adopts = adopts  # the run's side: takes a table it cannot re-derive from the record
        self.state: PolicyState | None = None
        self.served: Mapping[str, ServedInstance] = {}
        self.prev: RecordedTick | None = None
        self.last: TickOutput | None = None
        self.state_in: PolicyState | None = None
        self.restarts = 0

    def step(
        self, t: RecordedTick, cfg: PolicyConfig, ac: AlertConfig
    ) -> tuple[TickOutput, Mapping[str, ServedInstance]]:
        """Decide ``t`` from the carried state; ``(output, what was served before it)``."""
        if self.prev is None or self.state is None:
            state, prev_served = t.inp.state, t.prev_served
        elif t.epoch != self.prev.epoch or t.tick != self.prev.tick + 1:
            self.restarts += 1
            state, prev_served = reloaded(self.state, t.inp.state), t.prev_served
        else:
            state, prev_served = self._between(t, self.state)
        out = decide(dataclasses.replace(t.inp, state=state), cfg, default_rules(ac), ac)
        self.state_in, self.state, self.served, self.prev, self.last = state, out.state, out.served, t, out
        return out, prev_served

    def _between(
        self, t: RecordedTick, state: PolicyState
    ) -> tuple[PolicyState, Mapping[str, ServedInstance]]:
        """The carried state and served weights after the operator changes served since the tick before,
        re-derived in order as the controller composed them. When the record kept only the newest of
        them (``dropped``), the run's table and served weights before the tick are the recorded ones."""
        served = self.served
        for r in t.between.refreshes:
            table, served = recompose(state, self.last, r, t.inp.instances, t.inp.pools, t.inp.mode)
            state = dataclasses.replace(state, table=table)
        if t.between.dropped and self.adopts:
            return dataclasses.replace(state, table=t.inp.state.table), t.prev_served
        return state, served


def _result(
    ticks: Sequence[RecordedTick],
    candidate: PolicyConfig | None,
    tally: _Tally,
    divergences: list[Divergence],
    mismatches: list[Divergence],
    n_mismatch: int,
    divergent: int,
    restarts: int,
) -> ReplayResult:
    policies = tuple(dict.fromkeys(t.policy for t in ticks))
    limits: dict[str, dict[str, Compared]] = defaultdict(dict)
    for (pool, fld), (a, r) in sorted(tally.limits.items()):
        limits[pool][fld] = Compared(a.done(), r.done())
    alerts = {
        k: AlertTally(s[0], s[1], tally.fired[k][0], tally.fired[k][1])
        for k, s in sorted(tally.firing_s.items())
    }
    return ReplayResult(
        ticks=len(ticks),
        since=ticks[0].ts if ticks else None,
        until=ticks[-1].ts if ticks else None,
        policies=policies,
        candidate=None if candidate is None else candidate.fingerprint(),
        restarts=restarts,
        reproduced=n_mismatch == 0,
        divergent_ticks=divergent,
        first_divergence=divergences[0] if divergences else None,
        divergences=tuple(divergences),
        mismatches=tuple(mismatches),
        mismatch_count=n_mismatch,
        weights={n: Compared(a.done(), r.done()) for n, (a, r) in sorted(tally.weights.items())},
        limits=dict(limits),
        alerts=alerts,
        decisions={k: (v[0], v[1]) for k, v in sorted(tally.decisions.items())},
        timeline={n: tuple(s) for n, s in sorted(tally.timeline.items())},
    )


def config_changes(ticks: Sequence[RecordedTick]) -> list[tuple[float, str, str]]:
    """``(ts, from, to)`` for each tick whose stored config differs from the tick before's."""
    out = []
    for a, b in itertools.pairwise(ticks):
        if a.policy != b.policy:
            out.append((b.ts, a.policy, b.policy))
    return out
