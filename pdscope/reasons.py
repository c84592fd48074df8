"""Every reason a control decision can carry, in one enum.

A decision's reason is what an SRE reads first (the dashboard, ``GET /v1/decisions``, the
routing table's ``reason`` per instance and pool): one CamelCase word for why a weight or a
limit is what it is. The values are stored and served as plain strings, so a ``Reason`` compares
equal to its string. The docs table (docs/policy.md, between the ``reasons`` markers) is
generated from this module (:func:`reasons_markdown`; a unit test fails when the docs are stale).

Kernel vocabulary, beside :mod:`pdscope.semconv`: the policy gives these reasons, the store keeps
them, the API serves them and the analyses read them. Pure: no I/O.
"""

from __future__ import annotations

import enum


class Reason(enum.StrEnum):
    """A decision's reason; ``Reason.describe(r)`` says what it decides and when it is given."""

    # -- instance weights: holds
    STALE_DATA = "StaleData"
    NO_DATA = "NoData"
    SCRAPE_FAILING = "ScrapeFailing"
    ROLE_UNOBSERVABLE = "RoleUnobservable"
    # -- instance weights: up and down
    INSTANCE_DOWN = "InstanceDown"
    INSTANCE_UP = "InstanceUp"
    SLOW_PREFILL = "SlowPrefill"
    SLOW_HANDOFF = "SlowHandoff"
    SLOW_PREFILL_SIDE = "SlowPrefillSide"
    SLOW_KV_TRANSFER = "SlowKVTransfer"
    BACKLOG = "Backlog"
    TRANSFER_FAILURES = "TransferFailures"
    LEASE_EXPIRIES = "LeaseExpiries"
    REQUEST_FAILURES = "RequestFailures"
    KV_CACHE_PRESSURE = "KVCachePressure"
    DEGRADED = "Degraded"
    # -- instance weights: the way back
    PROBING = "Probing"
    PROBE_FAILED = "ProbeFailed"
    AWAITING_EVIDENCE = "AwaitingEvidence"
    HOLDING_FOR_HYSTERESIS = "HoldingForHysteresis"
    HOLDING_AFTER_RAISE = "HoldingAfterRaise"
    RECOVERING = "Recovering"
    STEADY = "Steady"
    # -- both weights and limits
    WARMING_UP = "WarmingUp"
    HEALTHY = "Healthy"
    UNATTRIBUTED_LEASE_EXPIRIES = "UnattributedLeaseExpiries"
    # -- pool admission limits
    KV_HEADROOM_LOW = "KVHeadroomLow"
    HANDOFF_BACKLOG = "HandoffBacklog"
    TTFT_OVER_BUDGET = "TTFTOverBudget"
    PREFILL_QUEUEING = "PrefillQueueing"
    HOLDING = "Holding"
    # -- P x D pairs
    STALE_PEER_AFTER_RESTART = "StalePeerAfterRestart"
    INCOMPATIBLE_PAIR = "IncompatiblePair"
    # -- the routing table and operators
    INITIAL = "Initial"
    NO_DECISION_YET = "NoDecisionYet"
    CONFIGURED = "Configured"
    MANUAL_OVERRIDE = "ManualOverride"
    DRAINED = "Drained"
    OVERRIDE_ENDED = "OverrideEnded"

    @classmethod
    def describe(cls, reason: Reason) -> tuple[str, str]:
        """``(what it decides, when it is given)``."""
        return _DESCRIPTIONS[reason]

    @classmethod
    def of(cls, value: str) -> Reason:
        """The reason a stored string names; one this version does not know (a newer writer's) reads as
        ``Initial``, which nothing acts on."""
        try:
            return cls(value)
        except ValueError:
            return cls.INITIAL


_DESCRIPTIONS: dict[Reason, tuple[str, str]] = {  # (what it decides, when)
    Reason.STALE_DATA: ("weight, pool", "the newest snapshot is too old (collector behind): held"),
    Reason.NO_DATA: ("weight", "not scraped in the window: held"),
    Reason.SCRAPE_FAILING: ("weight", "scrapes failing, not yet long enough to count as down: held"),
    Reason.ROLE_UNOBSERVABLE: ("weight", "every instance of its role fails its scrapes at once: held"),
    Reason.INSTANCE_DOWN: (
        "weight",
        "its scrapes failed for max(10 s, 3 scrape intervals), or two in a row could not connect: weight 0",
    ),
    Reason.INSTANCE_UP: ("weight", "up again after an outage: starts at the floor"),
    Reason.SLOW_PREFILL: (
        "weight (P)",
        "its TTFT contribution, vLLM's TTFT now or its speed is past the tolerance of its peers' median",
    ),
    Reason.SLOW_HANDOFF: (
        "weight",
        (
            "its handoff time (P done → D first token) is past the tolerance of its peers' median, "
            "or hopeless against the TTFT target"
        ),
    ),
    Reason.SLOW_PREFILL_SIDE: (
        "weight (P)",
        (
            "its handoffs are slow toward every D: its row of the P×D handoff matrix is past the blame "
            "threshold over the typical pair (its NIC, its KV reads), not any D's"
        ),
    ),
    Reason.SLOW_KV_TRANSFER: (
        "weight (D)",
        "its NIXL transfer time (over the window, or now) is past the tolerance of its peers' median",
    ),
    Reason.BACKLOG: (
        "weight",
        "load: the time a request spends there now (Little's law on the gauges) is over 2× its peers'",
    ),
    Reason.TRANSFER_FAILURES: (
        "weight",
        "failed NIXL transfers (plus attributed lease expiries) past its peers' median, from "
        "`noise.min_error_events` in the window",
    ),
    Reason.LEASE_EXPIRIES: (
        "weight (D)",
        "lease expiries attributed to handoffs sent to this D, with no failed transfers",
    ),
    Reason.REQUEST_FAILURES: (
        "weight",
        "the instance's own failed requests (lower confidence bound of their share)",
    ),
    Reason.KV_CACHE_PRESSURE: ("weight", "KV usage above 85 %"),
    Reason.STALE_PEER_AFTER_RESTART: (
        "pair",
        (
            "a D failed `noise.min_error_events` handoffs from a P since the P's confirmed restart and "
            "was served none: its agent for the P is stale. The pair is left out of routing (a probe "
            "at most every `proxy.pair_probe_s`) until one is served; the failures are not the D's"
        ),
    ),
    Reason.INCOMPATIBLE_PAIR: (
        "pair",
        (
            "P and D differ in model, KV block size, KV cache dtype or revision; or a field is reported "
            "by one side only, or malformed, while either has a compatible partner: left out of routing, "
            "never probed (see Compatible pairs only)"
        ),
    ),
    Reason.DEGRADED: ("weight", "the smoothed target is under the weight with no single signal to name"),
    Reason.PROBING: ("weight", "raised to at most `probe.weight` to gather evidence"),
    Reason.PROBE_FAILED: ("weight", "failed within `probe.hold_s` of a probe: back to the floor"),
    Reason.AWAITING_EVIDENCE: (
        "weight",
        "too few requests at its low weight to judge: held until the probe is due",
    ),
    Reason.HOLDING_FOR_HYSTERESIS: ("weight, pool", "healthy, but not yet for enough ticks in a row"),
    Reason.HOLDING_AFTER_RAISE: ("weight", "healthy, at or above its ceiling: one step per window"),
    Reason.RECOVERING: ("weight, pool", "healthy long enough: the weight (or the limit) grows back"),
    Reason.STEADY: ("weight", "inside the hysteresis bands: nothing moves"),
    Reason.WARMING_UP: ("weight, pool", "start-up window: only failures, down and KV may cut"),
    Reason.HEALTHY: ("weight, pool", "every signal healthy (no pressure)"),
    Reason.UNATTRIBUTED_LEASE_EXPIRIES: (
        "weight (P)",
        (
            "otherwise healthy, but leases expired on this P that no waiting handoff explains: "
            "shown, charged to no one"
        ),
    ),
    Reason.KV_HEADROOM_LOW: ("pool", "worst pressure: the pool's KV headroom (usage past 80 %)"),
    Reason.HANDOFF_BACKLOG: (
        "pool (D)",
        "worst pressure: the handoff backlog against `slo.handoff_budget_ms`",
    ),
    Reason.TTFT_OVER_BUDGET: (
        "pool (P)",
        "worst pressure: the TTFT percentile through the pool against its target",
    ),
    Reason.PREFILL_QUEUEING: (
        "pool (P)",
        "worst pressure: the wait in P's queues against the TTFT budget left for it",
    ),
    Reason.HOLDING: ("pool", "mild pressure (between 0.8 and 0.95): the limit is held"),
    Reason.INITIAL: ("weight", "the carried state before the policy's first decision on the instance"),
    Reason.NO_DECISION_YET: ("served weight", "the controller has made no decision for the instance yet"),
    Reason.CONFIGURED: (
        "pool (routing table)",
        "the configured pool weight applies and no limit has been decided yet",
    ),
    Reason.MANUAL_OVERRIDE: (
        "served weight",
        "a manual override or drain is in force (served, not stored as a policy decision)",
    ),
    Reason.DRAINED: (
        "instance (routing table)",
        "an operator drained the instance: weight 0 until undrained",
    ),
    Reason.OVERRIDE_ENDED: ("weight", "a manual override ended; the policy's weight applies again"),
}


def reasons_markdown() -> str:
    """The docs table of every reason (what docs/policy.md holds between its ``reasons`` markers)."""
    lines = ["| reason | decides | when |", "|---|---|---|"]
    lines += [f"| `{r.value}` | {' | '.join(Reason.describe(r))} |" for r in Reason]
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- reasons:begin -->", "<!-- reasons:end -->"


def splice(doc: str, table: str) -> str:
    """``doc`` with the text between the reasons markers replaced by ``table``."""
    head, sep, rest = doc.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"the document has no {BEGIN} ... {END} markers")
    return f"{head}{BEGIN}\n{table}{END}{tail}"
