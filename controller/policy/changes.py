"""What of a tick's output is a decision: the values that changed, each with its reasons.

One home for the rule both the store and the replay follow: ``controller.persist`` writes one
``Decision`` row per :class:`Change`, and ``controller.policy.replay`` compares a replayed tick's
changes with the rows the run stored. A change is

* an instance's policy weight that moved;
* an instance's served weight that moved, or changed source, because an override started or
  ended (the policy's own moves are the first kind);
* a pool limit (in-flight requests, in-flight KV bytes, queue-wait budget) that moved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from controller.policy.routes import ServedInstance
from controller.policy.tick import TickOutput
from pdscope.reasons import Reason

LIMIT_FIELDS = ("max_inflight_requests", "max_inflight_kv_bytes", "max_queue_wait_s")


@dataclass(frozen=True)
class Change:
    subject_kind: Literal["instance", "pool"]
    subject: str
    field: str  # weight | served_weight | one of LIMIT_FIELDS
    old: float | None
    new: float | None
    reason: str
    message: str
    arithmetic: str
    inputs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    scores: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.subject_kind, self.subject, self.field)


def changes(out: TickOutput, prev_served: Mapping[str, ServedInstance]) -> Iterator[Change]:
    """The decisions of ``out``, given what was served before it; in a stable order."""
    for d in out.weights:
        if d.changed:
            yield Change(
                "instance",
                d.instance,
                "weight",
                d.old_weight,
                d.weight,
                str(d.reason),
                d.message,
                d.arithmetic,
                d.inputs,
                d.scores,
            )
    for name, s in out.served.items():
        change = _served_change(name, prev_served.get(name), s)
        if change is not None:
            yield change
    for p in out.pools:
        for fld in LIMIT_FIELDS:
            if p.changed(fld):
                old = None if p.old is None else getattr(p.old, fld)
                yield Change(
                    "pool",
                    p.pool,
                    fld,
                    old,
                    getattr(p.new, fld),
                    str(p.reason),
                    p.message,
                    p.arithmetic,
                    p.inputs,
                    p.scores,
                )


def _served_change(name: str, before: ServedInstance | None, s: ServedInstance) -> Change | None:
    if before is None or (abs(before.weight - s.weight) < 1e-9 and before.source == s.source):
        return None
    if s.source == "policy" and before.source == "policy":
        return None  # the policy's own change is its weight change
    if s.source == "policy":
        reason = str(Reason.OVERRIDE_ENDED)
        msg = f"{name}: {before.source} override ended; policy weight {s.weight:.2f} applies"
    else:
        ov = s.override
        who = f" by {ov.actor}: {ov.reason}" if ov is not None else ""
        reason = s.reason
        msg = f"{name}: {s.source}{who}; served weight {before.weight:.2f} -> {s.weight:.2f}"
    return Change(
        "instance",
        name,
        "served_weight",
        before.weight,
        s.weight,
        reason,
        msg,
        f"served = {s.source} {s.weight:.2f} (policy {s.policy_weight:.2f})",
        {"override_id": None if s.override is None else s.override.id, "policy_weight": s.policy_weight},
        {},
    )
