"""Request and response bodies of the control API (published in its OpenAPI document).

Request bodies forbid unknown fields and non-finite numbers, so a typo is a 422 that
names the field instead of a silently ignored setting. Types are strict: a number must be a
JSON number (not ``"0.5"``, not ``true``), and a reason (NFC-normalised, surrounding whitespace
dropped, at most 500 characters) must have visible text, without control or bidi override
characters (:func:`pdscope.text.check_reason`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from controller.policy import Override
from pdscope.routing import Role
from pdscope.text import check_reason

MAX_TTL_S = 7 * 86400.0
MAX_REASON_CHARS = 500


Reason = Annotated[
    str,
    StringConstraints(strict=True, strip_whitespace=True, min_length=1, max_length=MAX_REASON_CHARS),
    AfterValidator(check_reason),
    Field(description="why; stored in the audit trail"),
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WeightIn(_Body):
    weight: float = Field(
        ge=0.0,
        le=100.0,
        allow_inf_nan=False,
        strict=True,
        description="relative share within the role (pool) or of the pool; 0 = no new work",
    )
    ttl_s: float = Field(
        gt=0.0, le=MAX_TTL_S, allow_inf_nan=False, strict=True, description="the override ends after this"
    )
    reason: Reason


class DrainIn(_Body):
    reason: Reason
    ttl_s: float | None = Field(
        default=None,
        gt=0.0,
        le=MAX_TTL_S,
        allow_inf_nan=False,
        strict=True,
        description="end the drain automatically after this; default: until undrain",
    )


class UndrainIn(_Body):
    reason: Reason


class ClearIn(_Body):
    reason: Reason


class WhoAmIOut(BaseModel):
    identity: str = Field(description='the name of the bearer token\'s identity ("api" for the single token)')


class InstanceWeightOut(BaseModel):
    name: str
    pool: str
    role: Role
    weight: float = Field(description="served weight")
    policy_weight: float = Field(description="what the policy computed (overrides win over it)")
    drained: bool
    source: Literal["policy", "override", "drain"]
    reason: str
    # the controller's own override, served field for field (its one shape, controller.policy.Override)
    override: Override | None = None
    drain: Override | None = None
    decision: dict[str, Any] | None = Field(
        default=None, description="the policy's latest step: scores, arithmetic, reason, message, inputs"
    )
    audit_id: int | None = Field(default=None, description="the audit event a mutation wrote")


class PoolOut(BaseModel):
    name: str
    role: Role
    configured_weight: float
    weight: float
    reason: str
    max_inflight_requests: int | None
    max_inflight_kv_bytes: int | None
    max_queue_wait_s: float | None = None
    override: Override | None = None
    decision: dict[str, Any] | None = None
    instances: list[InstanceWeightOut]
    audit_id: int | None = None


class DecisionOut(BaseModel):
    id: int
    ts: float
    tick: int
    mode: str
    subject_kind: str
    subject: str
    field: str
    old_value: float | None
    new_value: float | None
    reason: str
    message: str
    arithmetic: str | None
    inputs: dict[str, Any]
    scores: dict[str, Any]
    routing_version: int | None
    policy: str | None = Field(
        default=None,
        description="the policy config it was taken under "
        "(v<policy version>:<hash>; GET /v1/policy/{fingerprint})",
    )
    leader_epoch: int | None = Field(
        default=None, description="the epoch of the controller leader that took it (null: stored before)"
    )


class PolicyOut(BaseModel):
    fingerprint: str = Field(description="v<policy version>:<hash of every value>")
    version: int = Field(description="the policy's version: bumped when its maths change")
    config: dict[str, Any] = Field(description="every threshold of the policy, by name")
    first_seen: float | None = Field(default=None, description="when a controller first ran under it")


class AlertOut(BaseModel):
    id: int
    rule: str
    state: str
    severity: str
    labels: dict[str, Any]
    annotations: dict[str, Any]
    value: float | None
    active_since: float
    fired_at: float | None
    resolved_at: float | None
    last_eval: float


class AlertRuleOut(BaseModel):
    """One built-in rule as configured: defaults with the ``alerts.rules`` overrides applied."""

    name: str
    severity: Literal["info", "warning", "critical"]
    for_s: float
    enabled: bool
    summary: str


class SLOOut(BaseModel):
    window_s: float
    ttft_target_ms: float
    ttft_percentile: float
    ttft_observed_ms: float | None
    tpot_target_ms: float
    tpot_percentile: float
    tpot_observed_ms: float | None
    goodput_attainment_target: float
    attainment: float | None
    goodput_rps: float
    completed: int
    met: int
    rejected: int
    handoff_p99_ms: float | None
    handoff_budget_ms: float
    ok: bool | None = Field(description="every SLO met over the window; null when there is too little data")
    evaluated_at: float | None


class LeaderOut(BaseModel):
    holder: str = Field(description='who leads: "host:port (pid N) at <its API address>"')
    epoch: int = Field(description="bumped on each takeover")
    since: float = Field(description="when it took over (Unix seconds)")
    url: str | None = Field(default=None, description="its API address (controller.advertise_url)")
    mode: Literal["advisory", "enforce"] | None = Field(
        default=None, description="the mode it leads in, which standbys serve (null: not stored)"
    )


class NotLeaderOut(BaseModel):
    """The 409 a standby answers to a mutation."""

    detail: str
    leader: LeaderOut | None = Field(description="the leader to send it to (null: none has taken over yet)")


class BundlesHealthOut(BaseModel):
    """The incident-bundle writer (``controller.bundles``): a failure here does not degrade the health."""

    enabled: bool
    written: int = Field(description="bundles written since this controller started")
    failed: int = Field(description="bundles that failed (folder full or read-only, store error)")
    dropped: int = Field(description="bundles dropped unwritten: the queue was full")
    pending: int = Field(description="bundles queued or being written now")
    last_error: str | None = Field(description="why the last bundle failed; null once one is written")


class BundleOut(BaseModel):
    name: str
    bytes: int
    mtime: float = Field(description="Unix seconds the bundle was written")
    url: str = Field(description="where to download it (GET /v1/bundles/<name>)")


class BundlesOut(BaseModel):
    enabled: bool = Field(description="controller.bundles.enabled: alerts write bundles")
    dir: str = Field(description="the folder the bundles are in, on the controller's host")
    bundles: list[BundleOut] = Field(description="newest first")


class HealthOut(BaseModel):
    status: Literal["ok", "starting", "degraded"]
    mode: Literal["advisory", "enforce"]
    ticks: int
    failed_ticks: int
    last_success: float | None
    last_success_age_s: float | None
    last_error: str | None
    routing_version: int
    routing_epoch: str = Field(description="this controller process's epoch (part of the routing ETag)")
    role: Literal["leader", "standby"] = Field(
        description="leader: runs the policy and writes; standby: serves what the leader stores"
    )
    leader_epoch: int | None = Field(
        description="the leader epoch: this controller's when it leads, the store's leader's when it stands "
        "by (null: none yet)"
    )
    leader: LeaderOut | None = Field(description="the store's leader as this controller last read it")
    mode_warning: str | None = Field(
        default=None,
        description="a standby whose configured mode differs from the leader's says so here (it serves "
        "the leader's); null otherwise",
    )
    bundles: BundlesHealthOut | None = Field(
        default=None, description="the incident-bundle writer's counters"
    )


class ProxyPoolOut(BaseModel):
    share: float = Field(description="the proxy's fraction of the pool's limits")
    max_inflight_requests: int
    max_inflight_kv_bytes: int


class ProxyOut(BaseModel):
    """One proxy as its routing polls report it (``GET /v1/proxies``)."""

    id: str
    live: bool = Field(description="polled within controller.proxy_ttl_s; only live proxies get a part")
    last_poll: float = Field(description="Unix seconds of its last routing poll")
    age_s: float
    started: float = Field(description="Unix seconds its process started (as it reports)")
    first_seen: float
    served_by: str | None = Field(description="the controller replica that answered its last poll")
    applied_version: int | None = Field(description="the routing table version it applies")
    inflight: dict[str, int] = Field(description="requests it holds per pool")
    demand_per_s: dict[str, float] = Field(description="its smoothed demand per pool (requests/s)")
    tenant_demand_per_s: dict[str, float] = Field(
        default_factory=dict,
        description="tenants on: its smoothed demand per declared tenant (requests/s), what each tenant's "
        "weight there is scaled by (docs/tenants.md)",
    )
    pools: dict[str, ProxyPoolOut] = Field(description="the part of each pool's limits it was last given")
    duplicates: int = Field(description="polls refused because another process holds this id")


class TenantOut(BaseModel):
    """One declared tenant over the range (``analysis.tenants``)."""

    tenant: str
    weight: float
    priority: str
    ttft_target_ms: float = Field(description="its own TTFT target, else the fleet's (slo.ttft.target_ms)")
    tpot_target_ms: float = Field(description="its own TPOT target, else the fleet's")
    requests: int
    demand: int = Field(description="requests not refused as the client's mistake")
    served: int = Field(description="requests with status ok")
    met: int = Field(description="served within both of its targets")
    failed: int = Field(description="error or timeout")
    rejected: dict[str, int] = Field(description="rejected requests by the proxy's reason")
    waited: int = Field(description="requests that waited for admission")
    attainment: float | None = Field(description="met / served; null with none served")
    ttft_observed_ms: float | None = Field(description="TTFT of its served requests at slo.ttft.percentile")
    tpot_observed_ms: float | None = Field(description="TPOT of its served requests at slo.tpot.percentile")
    queued_p50_ms: float | None = Field(description="admission wait (proxy_in to the first leg sent), median")
    queued_p99_ms: float | None
    service: float = Field(
        description=(
            "the served requests' cost: prompt tokens, and D's decode steps and KV held (pdscope.tenantcost)"
        )
    )
    goodput_tokens: int = Field(description="prompt + completion tokens of its requests meeting its targets")
    goodput_tokens_per_s: float
    fair_share: float | None = Field(description="its weight over the weights of the tenants with demand")
    service_share: float | None = Field(description="its service over every tenant's")
    starved: bool = Field(description="it asked (rejected or kept waiting) and was served nothing")


class TenantsOut(BaseModel):
    since: float
    until: float
    enabled: bool = Field(description="tenants.enabled: off, every request is default's")
    goodput_attainment_target: float
    jain: float | None = Field(description="Jain's index over service / weight of the tenants with demand")
    undeclared: int = Field(description="records whose tenant the config no longer declares (as default's)")
    truncated: bool = Field(description="the oldest records of the range were left out (record_limit)")
    record_limit: int
    tenants: list[TenantOut]
