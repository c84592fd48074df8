"""The values the policy reads: one frozen ``Observation`` per tick.

``controller.observe`` builds an :class:`Observation` from the store; tests build one by
hand. Nothing here does I/O or knows about the store, HTTP or the clock: every time is
passed in as a float of Unix seconds (``Observation.now``).

A ``None`` signal means "not observed in the window" and never means zero: the policy
holds its previous output for a signal it cannot see rather than acting on a guess.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from analysis.tenants import TenantWindow
from pdscope.kvcompat import Identity
from pdscope.routing import Role as Role


@dataclass(frozen=True)
class InstanceSignals:
    """What one P or D instance looked like over the observed window."""

    name: str
    pool: str
    role: Role
    up: bool | None = None  # latest scrape; None = never scraped in the window
    last_seen: float | None = None  # ts of the latest snapshot
    down_for_s: float | None = None  # while down: since the first failed scrape of this streak
    unreachable_scrapes: int = 0  # while down: its latest scrapes in a row that could not connect
    kv_usage: float | None = None  # 0..1, latest
    num_running: float | None = None
    num_waiting: float | None = None
    # D: requests waiting at D in a KV-fetch stage (latest gauges): for their pull to start, or pulled and
    # for a batch slot; not those pulling, whose time is the link's (a slow P's NIC filled it on every D)
    handoff_backlog: float | None = None
    # D: requests still to pull their KV from a P (latest gauges, stages waiting_to_start and in_progress)
    pulls_pending: float | None = None
    # The fastest load signal (one scrape old): P: requests running + waiting; D: the KV-fetch backlog.
    load_now: float | None = None
    # Little's law on it: load_now ÷ requests (P) or transfers (D) finished per second over the last
    # three scrapes = how long a request spends there now.
    hold_time_now_s: float | None = None
    # From vLLM's histograms (differences over the window), seconds per request:
    ttft_mean_s: float | None = None
    queue_mean_s: float | None = None
    nixl_xfer_mean_s: float | None = None
    nixl_transfers: float = 0.0
    # The same two means over the last three scrapes only, and how many requests/transfers they cover:
    # a fault shows here within seconds, where the window's mean is still mostly from before it.
    ttft_recent_s: float | None = None
    ttft_recent_count: float = 0.0
    nixl_recent_s: float | None = None
    nixl_recent_count: float = 0.0
    failed_transfers_per_min: float = 0.0
    expired_leases_per_min: float = 0.0
    # From request records (seconds): P = p_sent..p_done, D = d_sent..first_token.
    contribution_s: float | None = None
    handoff_p50_s: float | None = None  # p_done..first_token over requests through it
    handoff_p99_s: float | None = None
    requests: int = 0
    failed_requests: int = 0  # its own: failed in its stage (D: once decode began), incl. retried attempts
    refused_requests: int = 0  # refused as invalid (a 4xx): counted, never charged to it
    # D: lease expiries (counted in the window) the collector attributed to handoffs sent to it
    lease_expiry_suspects: int = 0
    # P: lease expiries of its own in the window that no waiting handoff explains (charged to no one)
    unattributed_lease_expiries: int = 0
    # Relative standard errors of contribution_s and the handoff times (sample noise; None: too few)
    contribution_rse: float | None = None
    handoff_rse: float | None = None
    # Requests (P) or NIXL transfers (D) finished over the last three scrapes (hold_time_now_s's divisor)
    load_done: float | None = None
    # P: the window's handoffs it prefilled that no D served (P done, no first token), and the newest few
    # request ids of them: the requests whose blocks a lease may have stranded (``StrandedKV``)
    unpulled_handoffs: int = 0
    unpulled_ids: tuple[str, ...] = ()
    # the start time of its process after its latest restart the collector confirmed (two signals: its
    # process start time moved and its counters reset); None: none on record
    restarted_at: float | None = None
    # what it reports of the fields a P x D pair must agree on (pdscope.kvcompat: model, block_size,
    # cache_dtype as last scraped up, revision from the config); None: nothing on record yet
    identity: Identity | None = None


@dataclass(frozen=True)
class PairSignals:
    """The handoff between one P and one D over the window."""

    p_instance: str
    d_instance: str
    requests: int
    handoff_p50_s: float
    handoff_p99_s: float
    # failed handoffs on the pair: failed decode attempts, requests failed at D, expired leases
    failures: int = 0
    # the handoffs that finished (first token) in the window's last handoff_recent_s
    recent_requests: int = 0
    recent_p50_s: float | None = None
    # handoffs P finished after its latest confirmed restart that failed on this pair, and that were served
    # (both 0 while P has no restart on record): a D with a stale agent for the restarted P fails them all
    failed_since_restart: int = 0
    served_since_restart: int = 0


@dataclass(frozen=True)
class PoolSignals:
    """Pool-level load: what admission limits are computed from."""

    name: str
    role: Role
    inflight_requests: float | None = None  # Little's law: completions/s * mean time in the pool
    completed_per_s: float | None = None
    ttft_at_slo_s: float | None = None  # SLO percentile of TTFT: lower median over the P x D pairs through it
    kv_usage: float | None = None  # mean over up instances
    handoff_backlog_requests: float | None = None  # D pools: handoff_backlog, lower median member x members
    mean_kv_bytes_per_request: float | None = None
    # P pools, latest scrape: requests waiting in P's queues (the lower median member's x members) and
    # running there (the sum over up members).
    waiting_now: float | None = None
    running_now: float | None = None
    # The SLO percentile of TTFT minus the time spent waiting for admission in the proxy: what the
    # fleet itself takes; the TTFT target minus this is what a request can afford to wait for a slot.
    service_ttft_at_slo_s: float | None = None
    # The same without the time spent in P's queue (vLLM's queued span): what a request that found P's
    # queue empty would take. P's queue factor adds the queue of now to this, so the queue of the window
    # is not counted twice. None where P's spans do not carry their queue time.
    unqueued_ttft_at_slo_s: float | None = None


@dataclass(frozen=True)
class SLOFigures:
    """Fleet SLO figures over ``slo.window_s``."""

    window_s: float
    completed: int = 0
    met: int = 0
    rejected: int = 0
    ttft_at_slo_s: float | None = None
    tpot_at_slo_s: float | None = None
    handoff_p99_s: float | None = None
    goodput_rps: float = 0.0
    # The proxy's TTFT predictor over the window (analysis.prediction): the records with a prediction
    # and an observed TTFT, and the median |observed / predicted - 1| over them (None: none)
    predictions: int = 0
    prediction_error_p50: float | None = None

    @property
    def attainment(self) -> float | None:
        return self.met / self.completed if self.completed else None


@dataclass(frozen=True)
class Observation:
    """Everything one tick sees. ``newest_data`` is the newest snapshot's time (staleness)."""

    now: float
    window_s: float
    instances: tuple[InstanceSignals, ...]
    pools: tuple[PoolSignals, ...] = ()
    pairs: tuple[PairSignals, ...] = ()
    slo: SLOFigures = field(default_factory=lambda: SLOFigures(window_s=300.0))
    newest_data: float | None = None
    # the newest record's arrival at the proxy (None: no record in the window): the records' own clock,
    # behind ``now`` by their assembly lag
    records_until: float | None = None
    # records in the window left out because their sender is not in controller.trusted_span_senders
    untrusted_records: int = 0
    # how long the store has watched the fleet (now - its first snapshot); None: unknown (then the policy
    # does not treat the window as a start-up one)
    history_s: float | None = None
    # lease expiries in the window that the evidence could not attribute to any instance
    unattributed_lease_expiries: int = 0
    # each declared tenant's SLO figures over slo.window_s (analysis.tenants); None: tenants are off
    tenants: TenantWindow | None = None

    def instance(self, name: str) -> InstanceSignals | None:
        for inst in self.instances:
            if inst.name == name:
                return inst
        return None

    @property
    def data_age_s(self) -> float | None:
        return None if self.newest_data is None else max(0.0, self.now - self.newest_data)
