"""A shadow policy: a candidate config deciding every tick beside the live one, never served.

``controller.shadow`` names policy settings to change (``{max_weight_step: 0.05}``); the
reconciler then runs :func:`controller.policy.decide` a second time each tick on the same
observation, overrides and fleet, carrying the shadow's own state, and compares what the shadow
would serve and fire with what the live policy does (:func:`controller.policy.replay.differences`).
Nothing of the shadow is served or stored as a decision: it is the live form of ``pdscope replay``
with a candidate, so a change can be watched on real traffic, in advisory or enforce mode, before
it is made. A restart starts the shadow again from the live state.

A shadow step that raises is caught, counted and logged; the live tick goes on.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from controller.effects import Tick
from controller.policy import AlertConfig, AlertRule, PolicyConfig, PolicyState, TickInput, TickOutput, decide
from controller.policy.config import decision_setting_value
from controller.policy.replay import Divergence, differences, served_weights
from pdscope.config import ConfigError

log = logging.getLogger(__name__)

MAX_KEPT = 20  # divergences kept: the first, and the newest ones


def shadow_config(
    live: PolicyConfig, changes: Mapping[str, float] | None
) -> tuple[PolicyConfig, dict[str, Any]] | None:
    """The shadow's config from ``controller.shadow``; None when unset. Raises :class:`ConfigError`
    naming ``controller.shadow.<name>`` for a setting that does not exist, a bad value, or one that acts
    only in the evidence step (the shadow decides on the live observation, which it does not re-derive)."""
    if not changes:
        return None
    problems: list[str] = []
    values: dict[str, Any] = {}
    for name, raw in changes.items():
        try:
            values[name] = decision_setting_value(name, raw)
        except ValueError as exc:
            problems.append(f"controller.shadow.{exc}")
    if problems:
        raise ConfigError(problems)
    return dataclasses.replace(live, **values), values


@dataclass
class ShadowStats:
    ticks: int = 0
    divergent_ticks: int = 0
    failures: int = 0
    last_error: str | None = None
    first: Divergence | None = None
    newest: list[Divergence] = field(default_factory=list)
    now: list[Divergence] = field(default_factory=list)  # this tick's differences
    weights: dict[str, tuple[float, float]] = field(default_factory=dict)  # instance -> (live, shadow)


class Shadow:
    def __init__(self, cfg: PolicyConfig, changes: Mapping[str, Any]) -> None:
        self.cfg = cfg
        self.changes = dict(changes)
        self.fingerprint = cfg.fingerprint()
        self.state: PolicyState | None = None
        self.stats = ShadowStats()

    def restart(self) -> None:
        """Start again from the live state at the next tick (the live state was reloaded)."""
        self.state = None

    def step(self, inp: TickInput, live: TickOutput, rules: tuple[AlertRule, ...], ac: AlertConfig) -> None:
        """Decide the tick ``inp`` under the shadow config and compare with ``live``; never raises."""
        st = self.stats
        try:
            state = inp.state if self.state is None else self.state
            out = decide(dataclasses.replace(inp, state=state), self.cfg, rules, ac)
        except Exception as exc:  # the live tick goes on; the failure is counted and shown
            st.failures += 1
            st.last_error = f"{type(exc).__name__}: {exc}"
            log.warning("shadow policy step failed (%s failures): %s", st.failures, st.last_error)
            self.state = None
            return
        self.state = out.state
        diffs = differences(live.table.generated_at, live.tick, live.state, out.state)
        st.ticks += 1
        st.now = diffs
        if diffs:
            st.divergent_ticks += 1
            st.first = st.first or diffs[0]
            st.newest = (st.newest + diffs)[-MAX_KEPT:]
        a, s = served_weights(live.state), served_weights(out.state)
        st.weights = {n: (a[n], s.get(n, a[n])) for n in a}

    def observe(self, tick: Tick) -> None:
        """The tick observer (:class:`controller.effects.TickObserver`): :meth:`step` on the live tick."""
        self.step(tick.inp, tick.out, tick.rules, tick.alert_config)

    def as_dict(self) -> dict[str, Any]:
        st = self.stats
        return {
            "enabled": True,
            "candidate": self.fingerprint,
            "changes": self.changes,
            "ticks": st.ticks,
            "divergent_ticks": st.divergent_ticks,
            "first_divergence": None if st.first is None else dataclasses.asdict(st.first),
            "divergent_now": [dataclasses.asdict(d) for d in st.now],
            "recent_divergences": [dataclasses.asdict(d) for d in st.newest],
            "weights": {n: {"live": a, "shadow": s} for n, (a, s) in st.weights.items()},
            "failures": st.failures,
            "last_error": st.last_error,
        }
