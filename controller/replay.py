"""Replay a stored window of ticks (``controller.ticklog``) under the stored or a candidate config.

:func:`replay_window` reads the window and runs :func:`controller.policy.replay.replay`; it raises
:class:`ReplayError` with a message that says what to do for a window it cannot replay faithfully:
no recorded ticks, ticks of another policy version or format, decisions taken by ticks that left no
record (before migration 0010), or, for a candidate, a window that straddles a config change (which
config would the candidate be compared against?).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from controller.policy import AlertConfig, PolicyConfig
from controller.policy.config import decision_setting_value
from controller.policy.replay import Compared, Levels, ReplayResult, config_changes, replay
from controller.ticklog import TickLogError, read_ticks

MAX_TICKS = 20_000  # a day at the default 2 s interval is 43,200: replay a part of it


class ReplayError(ValueError):
    """The window cannot be replayed as asked."""


class NoTicks(ReplayError):
    """No tick was recorded in the window."""


@dataclass(frozen=True)
class Candidate:
    """A policy to replay: ``cfg`` (None: the window's stored config) with ``changes`` applied."""

    cfg: PolicyConfig | None = None
    alerts: AlertConfig | None = None  # None: each tick's stored alert config
    changes: Mapping[str, float | int] = field(default_factory=dict)


def parse_change(text: str) -> tuple[str, float | int]:
    """``name=value`` for a policy setting (``min_weight=0.05``); raises :class:`ReplayError`, also
    for a setting that acts only in the evidence step (the replay decides on the recorded observation)."""
    name, sep, raw = text.partition("=")
    name = name.strip()
    if not sep:
        raise ReplayError(f"--set {text[:60]!r}: expected name=value, e.g. min_weight=0.05")
    try:
        return name, decision_setting_value(name, raw.strip())
    except ValueError as exc:
        raise ReplayError(f"--set {exc}") from None


def parse_changes(texts: Sequence[str]) -> dict[str, float | int]:
    return dict(parse_change(t) for t in texts)


def replay_window(
    session: Session,
    since: float,
    until: float,
    candidate: Candidate | None = None,
    *,
    max_ticks: int = MAX_TICKS,
) -> ReplayResult:
    try:
        window = read_ticks(session, since, until, limit=max_ticks)
    except TickLogError as exc:
        raise ReplayError(str(exc)) from None
    if not window.ticks:
        first = window.first_recorded
        raise NoTicks(
            "no controller tick was recorded in the window"
            + ("" if first is None else f" (the oldest tick record is at {first:.3f})")
        )
    if candidate is None:
        return replay(window.ticks, window.configs)
    moved = config_changes(window.ticks)
    if moved:
        ts, a, b = moved[0]
        raise ReplayError(
            f"the window straddles a config change at {ts:.3f} ({a} -> {b}): a candidate is compared "
            f"with one config's run; replay up to it (--until) or from it (--from)"
        )
    base = candidate.cfg if candidate.cfg is not None else window.configs[window.ticks[0].policy]
    cfg = dataclasses.replace(base, **dict[str, Any](candidate.changes))
    return replay(window.ticks, window.configs, cfg, candidate.alerts)


def _num(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _levels(lv: Levels) -> dict[str, Any]:
    return {
        "seconds": [[v, round(s, 3)] for v, s in lv.seconds.items()],
        "mean": _num(lv.mean),
        "min": _num(lv.low),
    }


def _compared(c: Compared) -> dict[str, Any]:
    return {"actual": _levels(c.actual), "replayed": _levels(c.replayed)}


def as_dict(r: ReplayResult, *, timeline: bool = False) -> dict[str, Any]:
    """``r`` as strict JSON (what ``pdscope replay --json`` and ``GET /v1/replay`` give)."""
    out: dict[str, Any] = {
        "ticks": r.ticks,
        "since": r.since,
        "until": r.until,
        "policies": list(r.policies),
        "candidate": r.candidate,
        "restarts": r.restarts,
        "reproduced": r.reproduced,
        "identical": r.identical,
        "divergent_ticks": r.divergent_ticks,
        "first_divergence": None if r.first_divergence is None else dataclasses.asdict(r.first_divergence),
        "divergences": [dataclasses.asdict(d) for d in r.divergences],
        "mismatch_count": r.mismatch_count,
        "mismatches": [dataclasses.asdict(d) for d in r.mismatches],
        "weights": {n: _compared(c) for n, c in r.weights.items()},
        "limits": {p: {f: _compared(c) for f, c in fs.items()} for p, fs in r.limits.items()},
        "alerts": {k: dataclasses.asdict(a) for k, a in r.alerts.items()},
        "decisions": {k: {"actual": a, "replayed": b} for k, (a, b) in r.decisions.items()},
    }
    if timeline:
        out["timeline"] = {n: [[ts, _num(a), _num(b)] for ts, a, b in pts] for n, pts in r.timeline.items()}
    return out
