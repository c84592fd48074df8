"""The tables pdscope keeps: typed SQLAlchemy 2.0 models.

Every time is a float of Unix seconds (UTC); it compares and indexes the same way on
SQLite and PostgreSQL. Instances are referred to by name (names are unique in the
config), so rows stay readable and survive an instance being re-added.

This module holds no queries and no engine; see ``store.db`` and ``store.queries``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

Json = dict[str, Any]


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {Json: JSON, list[Any]: JSON}


class InstanceRow(Base):
    """A known P or D instance, as configured (upserted by the collector)."""

    __tablename__ = "instances"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    pool: Mapped[str] = mapped_column(String(128), index=True)
    role: Mapped[str] = mapped_column(String(16))
    url: Mapped[str] = mapped_column(String(512))
    metrics_url: Mapped[str | None] = mapped_column(String(512))
    labels: Mapped[Json] = mapped_column(default=dict)
    # P's kv_transfer_config.engine_id, learnt from kv_transfer_params (remote_engine_id).
    engine_id: Mapped[str | None] = mapped_column(String(128))
    # when the collector confirmed its latest restart (the scrape that found its process start time moved
    # and its counters reset: the new process's first up scrape); None: none seen
    restarted_at: Mapped[float | None] = mapped_column(Float)
    # what its latest up scrape reported of the fields a P x D pair must agree on (pdscope.kvcompat: model,
    # block_size, cache_dtype; values cut to their bound), as {field: value}; None: not scraped up yet
    kv_identity: Mapped[Json | None] = mapped_column(JSON)
    first_seen: Mapped[float] = mapped_column(Float)
    last_seen: Mapped[float] = mapped_column(Float)


# How a failed scrape's ``error`` starts when no connection could be made (refused, no route, no such
# host): nothing listens there, where a timeout may be a busy instance (the controller's down rule).
UNREACHABLE = "unreachable: "


class Snapshot(Base):
    """One scrape of one instance's /metrics: typed columns for the signals pdscope uses.

    Counters are stored as scraped (cumulative, summed over ``engine`` labels); rates
    come from differences between snapshots, with resets detected there. Gauges are
    summed over engines except ``kv_cache_usage`` (the mean). ``histograms`` keeps each
    histogram family's cumulative buckets: ``{family: {"le": [finite bounds], "counts":
    [one per bound, then the +Inf bucket], "sum": s, "count": n}}`` (JSON has no
    Infinity, so +Inf is implied by the extra count).
    """

    __tablename__ = "snapshots"
    __table_args__ = (
        Index("ix_snapshots_instance_ts", "instance", "ts"),
        # the dashboard's every-k-th-scrape pick over a long range reads this index alone
        Index("ix_snapshots_instance_ts_id", "instance", "ts", "id"),
        Index("ix_snapshots_pool_ts", "pool", "ts"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    instance: Mapped[str] = mapped_column(String(128))
    pool: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))
    ts: Mapped[float] = mapped_column(Float, index=True)
    # written by the database on every insert (migration 0017): what store.changes reads after a mark
    stamp: Mapped[int | None] = mapped_column(BigInteger, index=True)
    up: Mapped[bool] = mapped_column(Boolean)
    scrape_duration_s: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)  # a failed scrape's; UNREACHABLE starts a refused one
    engines: Mapped[int | None] = mapped_column(Integer)
    process_start_ts: Mapped[float | None] = mapped_column(Float)

    # gauges
    kv_cache_usage: Mapped[float | None] = mapped_column(Float)
    num_running: Mapped[float | None] = mapped_column(Float)
    num_waiting: Mapped[float | None] = mapped_column(Float)
    waiting_capacity: Mapped[float | None] = mapped_column(Float)
    waiting_deferred: Mapped[float | None] = mapped_column(Float)
    kv_fetch_waiting_to_start: Mapped[float | None] = mapped_column(Float)
    kv_fetch_in_progress: Mapped[float | None] = mapped_column(Float)
    kv_fetch_completed_waiting: Mapped[float | None] = mapped_column(Float)

    # token and cache counters
    prompt_tokens: Mapped[float | None] = mapped_column(Float)
    generation_tokens: Mapped[float | None] = mapped_column(Float)
    prompt_tokens_local_compute: Mapped[float | None] = mapped_column(Float)
    prompt_tokens_local_cache_hit: Mapped[float | None] = mapped_column(Float)
    prompt_tokens_external_kv_transfer: Mapped[float | None] = mapped_column(Float)
    prompt_tokens_cached: Mapped[float | None] = mapped_column(Float)
    prefix_cache_queries: Mapped[float | None] = mapped_column(Float)
    prefix_cache_hits: Mapped[float | None] = mapped_column(Float)
    external_prefix_cache_queries: Mapped[float | None] = mapped_column(Float)
    external_prefix_cache_hits: Mapped[float | None] = mapped_column(Float)
    preemptions: Mapped[float | None] = mapped_column(Float)

    # request outcomes (vllm:request_success_total by finished_reason)
    requests_stop: Mapped[float | None] = mapped_column(Float)
    requests_length: Mapped[float | None] = mapped_column(Float)
    requests_abort: Mapped[float | None] = mapped_column(Float)
    requests_error: Mapped[float | None] = mapped_column(Float)
    requests_repetition: Mapped[float | None] = mapped_column(Float)
    admission_rejections_reqs: Mapped[float | None] = mapped_column(Float)
    admission_rejections_tokens: Mapped[float | None] = mapped_column(Float)

    # latency histogram sums and counts (buckets are in ``histograms``)
    ttft_sum: Mapped[float | None] = mapped_column(Float)
    ttft_count: Mapped[float | None] = mapped_column(Float)
    itl_sum: Mapped[float | None] = mapped_column(Float)
    itl_count: Mapped[float | None] = mapped_column(Float)
    e2e_sum: Mapped[float | None] = mapped_column(Float)
    e2e_count: Mapped[float | None] = mapped_column(Float)
    queue_sum: Mapped[float | None] = mapped_column(Float)
    queue_count: Mapped[float | None] = mapped_column(Float)

    # NIXL (vllm:nixl_*), histograms as sum/count, counters as scraped
    nixl_xfer_time_sum: Mapped[float | None] = mapped_column(Float)
    nixl_xfer_time_count: Mapped[float | None] = mapped_column(Float)
    nixl_post_time_sum: Mapped[float | None] = mapped_column(Float)
    nixl_post_time_count: Mapped[float | None] = mapped_column(Float)
    nixl_bytes_sum: Mapped[float | None] = mapped_column(Float)
    nixl_bytes_count: Mapped[float | None] = mapped_column(Float)
    nixl_descriptors_sum: Mapped[float | None] = mapped_column(Float)
    nixl_descriptors_count: Mapped[float | None] = mapped_column(Float)
    nixl_failed_transfers: Mapped[float | None] = mapped_column(Float)
    nixl_failed_notifications: Mapped[float | None] = mapped_column(Float)
    nixl_kv_expired_reqs: Mapped[float | None] = mapped_column(Float)
    nixl_notifications_after_expiry: Mapped[float | None] = mapped_column(Float)

    histograms: Mapped[Json] = mapped_column(default=dict)
    # other vllm:nixl_* series a newer vLLM adds: {series: value summed over engines}
    extra: Mapped[Json] = mapped_column(default=dict)


class SnapshotRollup(Base):
    """One instance's scrapes over one minute, kept after the raw snapshots are deleted.

    ``increases`` holds each counter column's increase over the minute (resets handled),
    ``gauges`` each gauge column's ``{"avg", "max"}``, ``histograms`` each stored
    histogram's bucket increases in the ``Snapshot.histograms`` shape.
    """

    __tablename__ = "snapshot_rollups"
    __table_args__ = (
        UniqueConstraint("instance", "minute"),
        Index("ix_snapshot_rollups_pool_minute", "pool", "minute"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    instance: Mapped[str] = mapped_column(String(128))
    pool: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))
    minute: Mapped[float] = mapped_column(Float, index=True)
    scrapes: Mapped[int] = mapped_column(Integer)
    up_scrapes: Mapped[int] = mapped_column(Integer)
    gauges: Mapped[Json] = mapped_column(default=dict)
    increases: Mapped[Json] = mapped_column(default=dict)
    histograms: Mapped[Json] = mapped_column(default=dict)


class RequestRollup(Base):
    """Request records of one minute and one (P, D) pair, kept after the raw records go."""

    __tablename__ = "request_rollups"
    __table_args__ = (UniqueConstraint("minute", "p_instance", "d_instance"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    minute: Mapped[float] = mapped_column(Float, index=True)
    p_instance: Mapped[str] = mapped_column(String(128))  # "" when none was chosen
    d_instance: Mapped[str] = mapped_column(String(128))
    requests: Mapped[int] = mapped_column(Integer)
    ok: Mapped[int] = mapped_column(Integer)
    slo_met: Mapped[int] = mapped_column(Integer)
    lease_suspects: Mapped[int] = mapped_column(Integer)
    ttft_sum_s: Mapped[float] = mapped_column(Float)
    ttft_max_s: Mapped[float | None] = mapped_column(Float)
    handoff_sum_s: Mapped[float] = mapped_column(Float)
    handoff_count: Mapped[int] = mapped_column(Integer)
    handoff_max_s: Mapped[float | None] = mapped_column(Float)
    e2e_sum_s: Mapped[float] = mapped_column(Float)


class SpanRow(Base):
    """One OpenTelemetry span, from the proxy, from vLLM or from any OTLP sender."""

    __tablename__ = "spans"
    __table_args__ = (Index("ix_spans_trace_span", "trace_id", "span_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    trace_id: Mapped[str] = mapped_column(String(32))
    span_id: Mapped[str] = mapped_column(String(16))
    parent_span_id: Mapped[str | None] = mapped_column(String(16))
    name: Mapped[str] = mapped_column(String(256))
    service: Mapped[str | None] = mapped_column(String(256))
    kind: Mapped[int | None] = mapped_column(Integer)
    start_ts: Mapped[float] = mapped_column(Float, index=True)
    end_ts: Mapped[float] = mapped_column(Float)
    status_code: Mapped[int | None] = mapped_column(Integer)
    attributes: Mapped[Json] = mapped_column(default=dict)
    received_ts: Mapped[float] = mapped_column(Float, index=True)
    # who sent it: the sender name of its OTLP bearer token; null when sent without auth
    sender: Mapped[str | None] = mapped_column(String(64))


class RequestRecord(Base):
    """One client request, assembled from its trace: stages, instances, outcome, SLOs.

    Stage timestamps (Unix seconds): ``proxy_in`` → ``p_sent`` → ``p_done`` →
    ``d_sent`` → ``first_token`` → ``done``. Durations measured inside vLLM (its
    ``llm_request`` span attributes) are kept as ``p_queue_s`` etc. when present.
    """

    __tablename__ = "request_records"
    __table_args__ = (
        Index("ix_request_records_d_instance_ts", "d_instance", "proxy_in"),
        Index("ix_request_records_p_instance_ts", "p_instance", "proxy_in"),
        Index("ix_request_records_status_ts", "status", "proxy_in"),
        # the dashboard's window count, sample ids and status / SLO counts read this index alone
        Index("ix_request_records_window", "proxy_in", "id", "status", "ttft_s", "tpot_s"),
        # one tenant's window (pdscope explain --tenant, GET /v1/tenants?tenant=)
        Index("ix_request_records_tenant_ts", "tenant", "proxy_in"),
        # the controller's lease-expiry suspects of a window (a few among every request of it, which the
        # proxy_in index alone would walk): only the suspects are indexed; the predicate is the query's own
        # term as each dialect writes it, which both planners need to match (migration 0019)
        Index(
            "ix_request_records_lease_suspects",
            "proxy_in",
            postgresql_where=text("lease_expiry_suspect IS true"),
            sqlite_where=text("lease_expiry_suspect IS 1"),
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    request_id: Mapped[str] = mapped_column(String(128), unique=True)
    # written by the database on every insert and update (migration 0017): what store.changes reads
    stamp: Mapped[int | None] = mapped_column(BigInteger, index=True)
    trace_id: Mapped[str | None] = mapped_column(String(32), index=True)
    endpoint: Mapped[str | None] = mapped_column(String(64))
    stream: Mapped[bool | None] = mapped_column(Boolean)
    p_instance: Mapped[str | None] = mapped_column(String(128))
    d_instance: Mapped[str | None] = mapped_column(String(128))
    p_pool: Mapped[str | None] = mapped_column(String(128))
    d_pool: Mapped[str | None] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(32))
    http_status: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    retries: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    kv_blocks: Mapped[int | None] = mapped_column(Integer)
    kv_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # KV-aware routing (from the proxy's root span): the path taken ("pd" | "decode_only", see
    # pdscope.semconv.ROUTE_PATHS), the prompt tokens the router predicted the chosen P and D held,
    # the ones P and D reported they reused (usage.prompt_tokens_details.cached_tokens), and the
    # deepest matched block's chain key (hex) with the tokens of that prefix
    route_path: Mapped[str | None] = mapped_column(String(16))
    p_predicted_cached_tokens: Mapped[int | None] = mapped_column(Integer)
    d_predicted_cached_tokens: Mapped[int | None] = mapped_column(Integer)
    p_cached_tokens: Mapped[int | None] = mapped_column(Integer)
    d_cached_tokens: Mapped[int | None] = mapped_column(Integer)
    prefix_key: Mapped[str | None] = mapped_column(String(16))
    prefix_tokens: Mapped[int | None] = mapped_column(Integer)
    # how the KV went from P to D (pdscope.semconv.HANDOFFS: pull, push, push_early), from the root span
    handoff: Mapped[str | None] = mapped_column(String(16))
    # whose request it was (pdscope.semconv.TENANT, a declared tenant id: pdscope.config.tenants); null:
    # stored before the proxy named tenants, or the attribute was invalid; readers count it as "default"
    tenant: Mapped[str | None] = mapped_column(String(64))
    # The proxy's TTFT predictor (from its root span, see pdscope.semconv.PREDICTED_TTFT_S): the TTFT
    # predicted at admission for the chosen P and D (seconds from proxy_in), the target it was admitted
    # against, the uncached prefill tokens ahead of it on that P when sent, its own, and where the
    # rates came from (pdscope.semconv.PREDICT_SOURCES)
    predicted_ttft_s: Mapped[float | None] = mapped_column(Float)
    ttft_target_s: Mapped[float | None] = mapped_column(Float)
    predict_tokens_ahead: Mapped[int | None] = mapped_column(Integer)
    predict_tokens: Mapped[int | None] = mapped_column(Integer)
    predict_source: Mapped[str | None] = mapped_column(String(8))

    proxy_in: Mapped[float] = mapped_column(Float, index=True)
    p_sent: Mapped[float | None] = mapped_column(Float)
    p_done: Mapped[float | None] = mapped_column(Float)
    d_sent: Mapped[float | None] = mapped_column(Float)
    first_token: Mapped[float | None] = mapped_column(Float)
    done: Mapped[float | None] = mapped_column(Float)

    p_queue_s: Mapped[float | None] = mapped_column(Float)
    p_prefill_s: Mapped[float | None] = mapped_column(Float)
    d_queue_s: Mapped[float | None] = mapped_column(Float)
    d_prefill_s: Mapped[float | None] = mapped_column(Float)
    d_decode_s: Mapped[float | None] = mapped_column(Float)

    ttft_s: Mapped[float | None] = mapped_column(Float)
    tpot_s: Mapped[float | None] = mapped_column(Float)
    e2e_s: Mapped[float | None] = mapped_column(Float)
    slo_ttft_met: Mapped[bool | None] = mapped_column(Boolean)
    slo_tpot_met: Mapped[bool | None] = mapped_column(Boolean)
    slo_met: Mapped[bool | None] = mapped_column(Boolean)
    lease_expiry_suspect: Mapped[bool] = mapped_column(Boolean, default=False)
    attributes: Mapped[Json] = mapped_column(default=dict)
    # sender of the proxy root span (its OTLP token's name); null: sent without auth
    sender: Mapped[str | None] = mapped_column(String(64))


class Decision(Base):
    """One controller decision about one subject (an instance or a pool) in one tick.

    It carries what it saw (``inputs``), the per-signal ``scores``, the ``arithmetic``
    as an equation a person can check, a CamelCase ``reason`` and a ``message``.
    """

    __tablename__ = "decisions"
    __table_args__ = (Index("ix_decisions_subject_ts", "subject", "ts"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    ts: Mapped[float] = mapped_column(Float, index=True)
    tick: Mapped[int] = mapped_column(Integer)
    mode: Mapped[str] = mapped_column(String(16))
    subject_kind: Mapped[str] = mapped_column(String(16))
    subject: Mapped[str] = mapped_column(String(128))
    field: Mapped[str] = mapped_column(String(64))
    old_value: Mapped[float | None] = mapped_column(Float)
    new_value: Mapped[float | None] = mapped_column(Float)
    reason: Mapped[str] = mapped_column(String(64))
    message: Mapped[str] = mapped_column(Text)
    arithmetic: Mapped[str | None] = mapped_column(Text)
    inputs: Mapped[Json] = mapped_column(default=dict)
    scores: Mapped[Json] = mapped_column(default=dict)
    routing_version: Mapped[int | None] = mapped_column(Integer)
    # the policy config it was taken under: ``v<policy version>:<hash>``, a key of ``policy_configs``
    policy: Mapped[str | None] = mapped_column(String(40))
    # the epoch of the leader that took it (``controller_leader.epoch``); null: stored before leadership
    leader_epoch: Mapped[int | None] = mapped_column(Integer)


class TickRecord(Base):
    """One controller tick's whole input and its resulting state, for replay (``pdscope replay``).

    ``payload`` is zlib-compressed JSON (``codec``, ``format``): the observation, the state carried
    into the tick, the overrides, the fleet, the mode, the served weights before it, the alert config
    and the digest of the state the tick left. In format 2 a record that is not a ``keyframe`` holds
    only its difference from the record before it (``controller.tickchain``); format 1 records are
    all whole (keyframes). ``policy_version`` is ``POLICY_VERSION`` of the pdscope that wrote it: a
    replay under another version refuses. Deleted with the raw rows (``store.retention_raw_s``), each
    kept while a later record needs it as its keyframe (``collector.retention``).
    """

    __tablename__ = "tick_records"
    __table_args__ = (Index("ix_tick_records_epoch_tick", "leader_epoch", "tick"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    ts: Mapped[float] = mapped_column(Float, index=True)
    tick: Mapped[int] = mapped_column(Integer)
    leader_epoch: Mapped[int | None] = mapped_column(Integer)
    policy: Mapped[str] = mapped_column(String(40))
    policy_version: Mapped[int] = mapped_column(Integer)
    format: Mapped[int] = mapped_column(Integer)
    codec: Mapped[str] = mapped_column(String(16))
    keyframe: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    payload: Mapped[bytes] = mapped_column(LargeBinary)


class PolicyConfigRow(Base):
    """One policy config the controller ran under (every threshold), named by its fingerprint."""

    __tablename__ = "policy_configs"

    fingerprint: Mapped[str] = mapped_column(String(40), primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    config: Mapped[Json] = mapped_column(default=dict)
    first_seen: Mapped[float] = mapped_column(Float)


class ControllerLeader(Base):
    """The controller's leader epoch, the store's fencing token: one row (``id`` 1), bumped by every
    takeover (``controller.leader.claim``). A tick writes only while the epoch is its own."""

    __tablename__ = "controller_leader"

    id: Mapped[int] = mapped_column(primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer)
    holder: Mapped[str] = mapped_column(String(256))  # who took it: "host:port (pid N)"; "" before any
    since: Mapped[float] = mapped_column(Float)
    # the mode it took over in ("advisory" or "enforce"), which standbys serve; null before 0011
    mode: Mapped[str | None] = mapped_column(String(16))


class PolicyStateRow(Base):
    """What the policy carries from tick to tick for one subject (an instance's weight state, a pool's
    limit state), as it was after the newest tick that changed it: reloaded on restart."""

    __tablename__ = "policy_state"

    subject_kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    subject: Mapped[str] = mapped_column(String(128), primary_key=True)
    state: Mapped[Json] = mapped_column(default=dict)
    tick: Mapped[int] = mapped_column(Integer)
    ts: Mapped[float] = mapped_column(Float)


class WeightOverride(Base):
    """A manual weight or drain on an instance or a pool; wins until ``expires`` or cleared."""

    __tablename__ = "weight_overrides"
    __table_args__ = (Index("ix_weight_overrides_subject_active", "subject", "cleared"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    subject_kind: Mapped[str] = mapped_column(String(16))
    subject: Mapped[str] = mapped_column(String(128))
    weight: Mapped[float | None] = mapped_column(Float)
    drained: Mapped[bool] = mapped_column(Boolean, default=False)
    reason: Mapped[str] = mapped_column(Text)
    actor: Mapped[str] = mapped_column(String(128))
    created: Mapped[float] = mapped_column(Float)
    expires: Mapped[float | None] = mapped_column(Float)
    cleared: Mapped[float | None] = mapped_column(Float)


class Alert(Base):
    """One alert instance (a rule and a label set) through pending → firing → resolved."""

    __tablename__ = "alerts"
    __table_args__ = (Index("ix_alerts_rule_fingerprint", "rule", "fingerprint"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    rule: Mapped[str] = mapped_column(String(128))
    fingerprint: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16), index=True)
    severity: Mapped[str] = mapped_column(String(16))
    labels: Mapped[Json] = mapped_column(default=dict)
    annotations: Mapped[Json] = mapped_column(default=dict)
    value: Mapped[float | None] = mapped_column(Float)
    active_since: Mapped[float] = mapped_column(Float)
    fired_at: Mapped[float | None] = mapped_column(Float)
    resolved_at: Mapped[float | None] = mapped_column(Float)
    last_eval: Mapped[float] = mapped_column(Float)


class AuditEvent(Base):
    """Who changed what through the controller API: before, after and why."""

    __tablename__ = "audit_events"

    id: Mapped[int] = mapped_column(primary_key=True)
    ts: Mapped[float] = mapped_column(Float, index=True)
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(64))
    subject: Mapped[str] = mapped_column(String(128))
    before: Mapped[Json | None] = mapped_column(JSON)
    after: Mapped[Json | None] = mapped_column(JSON)
    reason: Mapped[str | None] = mapped_column(Text)
    override_id: Mapped[int | None] = mapped_column(ForeignKey("weight_overrides.id"))


class CollectorMember(Base):
    """One collector process among those sharing this store's scrape targets (PostgreSQL only).

    Each collector upserts its row every scrape round; the ids whose ``heartbeat`` is recent are
    the live membership the scrape targets are split over (``collector.shards``). ``incarnation``
    is a random token per process, so two live processes under one id are noticed.
    """

    __tablename__ = "collectors"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    incarnation: Mapped[str] = mapped_column(String(32))
    started: Mapped[float] = mapped_column(Float)
    heartbeat: Mapped[float] = mapped_column(Float)


class ProxyMember(Base):
    """One proxy among those admitting into the pools, as its routing polls report it.

    Written by whichever controller replica a poll reaches (the leader or a standby): the
    proxies whose ``last_seen`` is within ``controller.proxy_ttl_s`` are the live ones the
    pools' limits are split among (``controller.policy.shares``). ``demand`` holds the
    counters the proxy last reported (per pool, since its start), ``rates`` their smoothed
    rates, ``served`` the share it was last given. ``boot`` and ``started`` tell a restart (a
    later process) from a duplicate (an earlier one still polling under the same id).
    """

    __tablename__ = "proxies"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    boot: Mapped[str] = mapped_column(String(32))
    started: Mapped[float] = mapped_column(Float)
    first_seen: Mapped[float] = mapped_column(Float)
    last_seen: Mapped[float] = mapped_column(Float, index=True)
    served_by: Mapped[str | None] = mapped_column(String(256))
    applied_version: Mapped[int | None] = mapped_column(BigInteger)
    demand: Mapped[Json] = mapped_column(JSON)
    rates: Mapped[Json] = mapped_column(JSON)
    inflight: Mapped[Json] = mapped_column(JSON)
    served: Mapped[Json] = mapped_column(JSON)
    duplicates: Mapped[int] = mapped_column(Integer, default=0)
