"""The ``controller`` section: the reconcile loop, its policy's knobs and its HTTP API."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pdscope.config.base import (
    Count10k,
    Count100k,
    DaySeconds,
    Fraction,
    NonEmpty,
    Port,
    PositiveFloat,
    PositiveFraction,
    Seconds,
    ShortName,
    _Frozen,
)
from pdscope.config.bundles import BundleSettings
from pdscope.config.httpserver import _HTTPServerSettings


class ProbeSettings(_Frozen):
    """How an instance at the floor is tried again (a probe, not a ramp)."""

    after_s: Seconds = 30.0
    """seconds after its last cut or outage that an instance with too few requests to judge is probed"""
    weight: PositiveFraction = 0.1
    """the most a probe raises a weight to; further only on evidence"""
    hold_s: Seconds = 20.0
    """seconds a probe is judged for: a failure within it cuts the weight back to the floor (ProbeFailed)"""


class NoiseSettings(_Frozen):
    """What a cut needs to be evidence rather than noise (quiet when healthy)."""

    min_samples: Count10k = 5
    """requests or NIXL transfers in the window before a latency score may cut"""
    z: float = Field(default=2.0, ge=0, le=10)
    """each tolerance is widened by z x the combined relative standard error of the value and its peers'
    median (small samples need a larger difference to cut)"""
    startup_s: float | None = Field(default=None, gt=0, le=3600)
    """no latency/load/limit cuts until the store has watched the fleet this long: its warm-up and one window
    for it to leave the window (default: 2 x controller.window_s)"""
    min_error_events: Count10k = 3
    """failures or attributed lease expiries in the window before errors score"""
    queue_confirm_ticks: int = Field(default=2, ge=1, le=100)
    """ticks in a row a P-queue pressure must hold before a limit cut"""


class ControllerSettings(_HTTPServerSettings):
    host: str = "127.0.0.1"
    """address the control API listens on; a non-loopback one needs an API token in the environment"""
    port: Port = 8300
    """port of the control API"""
    interval_s: PositiveFloat = 2.0
    """seconds between reconcile ticks"""
    window_s: PositiveFloat = 30.0
    """seconds of snapshots and request records each tick reads back from the store"""
    mode: Literal["advisory", "enforce"] = "enforce"
    """enforce: the proxy applies the routing table; advisory: the controller decides, stores and shows, and
    the table says enforce: false"""
    api_token_env: NonEmpty = "PDSCOPE_API_TOKEN"
    """the NAME of the env variable holding the API token of identity api (mutations need a token; with none
    they answer 403)"""
    api_tokens_env: NonEmpty = "PDSCOPE_API_TOKENS"
    """the NAME of an env variable holding name:token[,name:token...] (named API identities)"""
    trusted_span_senders: list[ShortName] | None = None
    """unset: every stored request record counts; a list: only records whose sender (OTLP token name) is in it
    feed the controller's observation"""
    max_body_bytes: int = Field(default=64 * 1024, ge=1024, le=16 * 2**20)
    """largest API request body; larger ones get 413"""
    alert_webhook_url: str | None = None
    """where firing and resolved alerts are POSTed in Alertmanager's webhook format (version 4); none: not
    sent"""
    max_weight_step: PositiveFraction = 0.25
    """the most an instance's weight moves in one tick (a severe drop is not smoothed, but still moves at most
    this)"""
    min_weight: Fraction = 0.02
    """floor of an up, undrained instance's weight: a trickle of traffic, so recovery can be probed (see
    docs/policy.md)"""
    kv_lease_s: Seconds = 30.0
    """the fleet's KV lease (vLLM kv_connector_extra_config.kv_lease_duration, default 30 s): the collector
    joins a rise of P's lease expiries with handoffs on that P still waiting two thirds of a lease after P
    finished (a D heartbeat may set a lease to 2/3 of it)"""
    probe: ProbeSettings = ProbeSettings()
    """how an instance at a low weight is tried again: a probe, not a ramp"""
    advertise_url: str | None = Field(
        default=None, min_length=8, max_length=200, pattern=r"^https?://[^\s]+$"
    )
    """where the other controller replicas reach this one's API (kept with its leadership in the store, named
    in a standby's 409, where a standby forwards changes). Unset: http://<this host's address>:<port>, the
    address being controller.host unless that is a wildcard, then the host name's address (a pod's IP)"""
    shadow: dict[ShortName, float] | None = Field(default=None, max_length=64)
    """policy settings (fields of the policy config: min_weight, max_weight_step, recover_ticks, noise_z, ...)
    a shadow policy runs with beside the live one: it decides every tick on the same observation, is never
    served or stored, and GET /v1/shadow and pdscope_controller_shadow_* say where it parts from the live
    decisions (docs/policy.md). Unset: no shadow"""
    record_ticks: bool = True
    """store each tick's whole input and resulting state (tick_records, compressed, deleted with the raw
    rows): what pdscope replay re-runs the policy from. Off: replay has nothing to read for the ticks taken
    meanwhile"""
    tick_keyframe_every: Count10k = 30
    """a tick record is whole (a keyframe) every this many ticks, and after a start, a takeover, a config
    change or a gap; the records between hold only what changed since the record before (docs/policy.md,
    policy replay). A replay reads from the keyframe at or before its window's start: up to this many
    records more. 1: every record whole"""
    full_collection_every: int = Field(default=15, ge=0, le=10_000)
    """the serving loop runs CPython's full garbage collection itself, once every this many ticks, instead of
    the allocator starting one on most ticks (its cost grows with the windows kept between ticks: about a
    fifth of a tick at 1,000 instances); garbage in reference cycles lives up to this many intervals longer.
    0: CPython's own pacing"""
    forward_changes: bool = True
    """a standby forwards an operator change to the leader's advertise_url (once: a forwarded change is never
    forwarded again) instead of answering 409; the 409 stays when the leader cannot be reached"""
    proxy_ttl_s: Seconds = 5.0
    """a proxy not heard from (no routing poll) for this long is dead: it leaves GET /v1/proxies' live set and
    its share of the pools' limits goes to the others"""
    proxy_share_floor: Fraction = 0.2
    """part of every pool's limits split equally among the live proxies (so an idle one can still admit); the
    rest follows each proxy's share of the pool's recent demand"""
    proxy_tokens_env: NonEmpty = "PDSCOPE_PROXY_TOKENS"
    """the NAME of an env variable holding name:token[,name:token...]: a token speaks for the proxy id equal
    to its name or beginning with <name>: or <name>/ (a report under another id: 403). With it or
    proxy_secret_env set, a routing poll that reports a proxy needs Authorization: Bearer <its token> (401
    otherwise; a poll without a report stays open). Neither set: any poll may report, so keep the
    controller reachable by the proxies only"""
    proxy_secret_env: NonEmpty = "PDSCOPE_PROXY_SECRET"
    """the NAME of an env variable holding the fleet's proxy secret (at least 16 characters): when it is set,
    the token of proxy id X is hex HMAC-SHA256(secret, X), which each proxy derives from its own id
    (proxy.controller_secret_env); a token speaks for its id only"""
    max_proxies: Count100k = 256
    """most live proxies the limits are split among (with no proxy credentials configured: at most
    proxy.expected_replicas); a new id beyond them gets the table without a part (it admits limit /
    proxy.expected_replicas) and is counted (over_limit)"""
    proxy_share_window_s: DaySeconds = 30.0
    """time constant of the smoothed per-proxy demand rate the shares follow"""
    noise: NoiseSettings = NoiseSettings()
    """what a cut needs to be evidence rather than noise (quiet when healthy)"""
    bundles: BundleSettings = BundleSettings()
    """incident bundles: an archive of the window before an SLO or P/D-health alert fired, with an HTML report
    (docs/alerts.md)"""
    rates_every_s: Seconds = 5.0
    """seconds between the leader's fits of the per-instance and per-pair rates served in the routing table
    (the proxies' TTFT predictor prior): a tick fits when this long has passed since the last fit, and a new
    leader or a restart fits on its first tick; between fits the last served rates stay (their fitted_at says
    their age). A fit adds the records' columns it reads and the fit itself to that tick's observe step"""
    whole_read_every_s: Seconds = 300.0
    """the leader keeps its windows between ticks (the SLO window, the 30 s evidence window and its charges,
    the snapshots, the tenants') and reads only the rows changed since the last tick (docs/policy.md "Reads
    kept between ticks"); it reads each whole on taking over, after a failed tick, when the window asked for
    changes, and at least this often (a safety net: a window that drifted from the store is right again from
    there)"""
