"""Every reason a control decision can carry, in one enum.

A decision's reason is what an SRE reads first (the dashboard, ``GET /v1/decisions``, the
routing table's ``reason`` per instance and pool): one CamelCase word for why a weight or a
limit is what it is. The values are stored and served as plain strings, so a ``Reason`` compares
equal to its string. The docs table (docs/policy.md, between the ``reasons`` markers) is
generated from this module (:func:`reasons_markdown`; a unit test fails when the docs are stale).

Pure: no I/O.
"""

from __future__ import annotations

import enum


class Reason(enum.StrEnum):
    """A decision's reason; ``Reason.describe(r)`` says when it is given."""

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
    # -- the routing table and operators
    INITIAL = "Initial"
    NO_DECISION_YET = "NoDecisionYet"
    CONFIGURED = "Configured"
    MANUAL_OVERRIDE = "ManualOverride"
    DRAINED = "Drained"
    OVERRIDE_ENDED = "OverrideEnded"

    @classmethod
    def describe(cls, reason: Reason) -> str:
        return _DESCRIPTIONS[reason]

    @classmethod
    def of(cls, value: str) -> Reason:
        """The reason a stored string names; one this version does not know (a newer writer's) reads as
        ``Initial``, which nothing acts on."""
        try:
            return cls(value)
        except ValueError:
            return cls.INITIAL


_DESCRIPTIONS: dict[Reason, str] = {
    Reason.STALE_DATA: "weights and limits: the newest snapshot is older than the staleness bound "
                       "(the collector is behind); everything is held",
    Reason.NO_DATA: "weight: the instance was not scraped in the window; held",
    Reason.SCRAPE_FAILING: "weight: scrapes fail, for less than `down_after_s` so far; held",
    Reason.ROLE_UNOBSERVABLE: "weight: every instance of the role fails its scrapes at once (more likely the "
                              "collector or its network); held",
    Reason.INSTANCE_DOWN: "weight: scrapes have failed for `down_after_s`; 0, no new work",
    Reason.INSTANCE_UP: "weight: back from down or a drain; starts at the floor, a probe raises it",
    Reason.SLOW_PREFILL: "weight: P's queue+prefill time, its TTFT now or its speed per request is past the "
                         "tolerance of its peers' median",
    Reason.SLOW_HANDOFF: "weight: P done → D first token through it is past the tolerance of its peers' median "
                         "(0 when it alone is over the TTFT target)",
    Reason.SLOW_KV_TRANSFER: "weight: D's NIXL transfer time is past the tolerance of its peers' median",
    Reason.BACKLOG: "weight: Little's law on its gauges: a request spends more time there now than at its peers",
    Reason.TRANSFER_FAILURES: "weight: failed NIXL transfers (and attributed lease expiries) per minute",
    Reason.LEASE_EXPIRIES: "weight (D): leases expired while handoffs sent to it waited, with no failed transfers",
    Reason.REQUEST_FAILURES: "weight: its own failed requests (the lower bound of their share)",
    Reason.KV_CACHE_PRESSURE: "weight: KV cache usage over `kv_soft`",
    Reason.DEGRADED: "weight: the smoothed target is under the weight, no single signal to name",
    Reason.PROBING: "weight: too few requests to judge, or healthy from under the probe weight; a small, "
                    "bounded share",
    Reason.PROBE_FAILED: "weight: failures while probed; back to the floor at once",
    Reason.AWAITING_EVIDENCE: "weight: looks healthy on too few requests; a raise needs evidence",
    Reason.HOLDING_FOR_HYSTERESIS: "weight or limit: healthy, for fewer than `recover_ticks` ticks in a row",
    Reason.HOLDING_AFTER_RAISE: "weight: at or above the weight a signal last cut it from; one step per window",
    Reason.RECOVERING: "weight or limit: healthy long enough; raised by one step",
    Reason.STEADY: "weight: under 1, inside the hysteresis bands",
    Reason.WARMING_UP: "weight or limit: a start-up window (less history than `startup_s`); only facts "
                       "(failures, KV) may cut",
    Reason.HEALTHY: "weight or limit: every signal healthy, at its default",
    Reason.UNATTRIBUTED_LEASE_EXPIRIES: "weight (P): its leases expired with no waiting handoff to explain "
                                        "them; nobody is charged",
    Reason.KV_HEADROOM_LOW: "limit: the pool's mean KV usage is past `kv_admit_full`",
    Reason.HANDOFF_BACKLOG: "limit (D pool): the KV-fetch backlog, in seconds of work, is past the handoff budget",
    Reason.TTFT_OVER_BUDGET: "limit (P pool): the SLO percentile of TTFT through the pool is over the target",
    Reason.PREFILL_QUEUEING: "limit (P pool): P's queues now wait longer than the TTFT budget left for them",
    Reason.HOLDING: "limit: mild pressure, between `cut_below` and `grow_above`; held",
    Reason.INITIAL: "weight: carried state before the first decision",
    Reason.NO_DECISION_YET: "routing table: the policy has not decided on this instance yet (weight 1)",
    Reason.CONFIGURED: "routing table (pool): the configured pool weight, no limit decided yet",
    Reason.MANUAL_OVERRIDE: "routing table: an operator's weight override applies",
    Reason.DRAINED: "routing table: an operator drained the instance (weight 0)",
    Reason.OVERRIDE_ENDED: "served weight: an override ended or was cleared; the policy's weight applies",
}


def reasons_markdown() -> str:
    """The docs table of every reason (what docs/policy.md holds between its ``reasons`` markers)."""
    lines = ["| Reason | When |", "|---|---|"]
    lines += [f"| `{r.value}` | {Reason.describe(r)} |" for r in Reason]
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- reasons:begin -->", "<!-- reasons:end -->"


def splice(doc: str, table: str) -> str:
    """``doc`` with the text between the reasons markers replaced by ``table``."""
    head, sep, rest = doc.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"the document has no {BEGIN} ... {END} markers")
    return f"{head}{BEGIN}\n{table}{END}{tail}"
