"""pdscope's one configuration file, ``pdscope.yaml``.

The file is read once, validated with pydantic and frozen; every service gets the
parts it needs passed down. Nothing else in pdscope reads the environment for
settings, except the API token, whose *variable name* is in the file.

An invalid file raises :class:`ConfigError`, whose ``problems`` are one line each,
naming the file, the line where YAML knows it, the dotted field and the reason.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from pdscope.routing import PROXY_ID_PATTERN
from pdscope.routing import Role as Role
from pdscope.simconfig import SimulatorConfig  # the one definition, with the routing contract
from pdscope.simtokenizer import NAME as SIM_TOKENIZER

DEFAULT_CONFIG_ENV = "PDSCOPE_CONFIG"


class ConfigError(Exception):
    """The configuration file is missing, unreadable or invalid.

    ``problems`` holds one human-readable line per problem; ``str()`` joins them.
    """

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class _Frozen(BaseModel):
    # allow_inf_nan=False: every float in the file must be finite (``.inf``, ``.nan`` and
    # ``1e400`` are refused for intervals, weights and targets alike). One rule, every section.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelSettings(_Frozen):
    """The served model, as the instances know it."""

    name: str = Field(min_length=1, description="served model name (vLLM --served-model-name)")
    kv_bytes_per_token: int = Field(
        gt=0,
        description="KV-cache bytes per token across all layers "
        "(2 * layers * kv_heads * head_dim * dtype bytes; Llama-3-70B BF16 = 327680)",
    )
    kv_block_size: int = Field(
        default=16,
        ge=1,
        le=4096,
        description="tokens per KV cache block (vLLM --block-size): the unit cached prefixes are matched in",
    )
    tokenizer: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description=f"the model's tokenizer, for proxy.kv_aware.mode precise: {SIM_TOKENIZER!r} (the "
        "simulator's) or the path of a tokenizer directory or tokenizer.json (it must exist); unset: none",
    )

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_exists(cls, value: str | None) -> str | None:
        if value is None or value == SIM_TOKENIZER:
            return value
        if not Path(value).exists():
            raise ValueError(
                f"no tokenizer at {value!r} (not {SIM_TOKENIZER!r}, and no such file or directory)"
            )
        return value


class Instance(_Frozen):
    """One vLLM server (or one simulated one)."""

    name: str = Field(
        min_length=1,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="the instance's name, unique across all pools: it keys weights, decisions, "
        "snapshots and spans (for vLLM, set OTEL_SERVICE_NAME to it)",
    )
    url: str = Field(
        description="base URL the proxy sends requests to, e.g. http://10.0.0.5:8000 "
        "(http:// or https://; a trailing / is dropped)"
    )
    metrics_url: str | None = Field(
        default=None, description="where the collector scrapes vLLM's Prometheus page; default <url>/metrics"
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="free-form labels (e.g. rack: r1), kept "
        "with the config for your own use; no pdscope service reads them",
    )
    kv_events_endpoint: str | None = Field(
        default=None,
        max_length=256,
        pattern=r"^(tcp|ipc)://[^\s*]+$",
        description="where the instance publishes its KV cache events (vLLM --kv-events-config "
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}), e.g. '
        "tcp://10.0.0.5:5557; unset: no events from this instance",
    )
    kv_events_replay_endpoint: str | None = Field(
        default=None,
        max_length=256,
        pattern=r"^(tcp|ipc)://[^\s*]+$",
        description="the instance's replay socket (vLLM replay_endpoint): messages missed in a gap are "
        "asked for again; unset: a gap makes pdscope forget this instance's cache and rebuild it",
    )
    kv_events_topic: str = Field(
        default="", max_length=128, description="the topic the instance publishes under (vLLM topic)"
    )

    @field_validator("url", "metrics_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value.rstrip("/")

    @property
    def scrape_url(self) -> str:
        return self.metrics_url or f"{self.url}/metrics"


class Pool(_Frozen):
    """A named set of instances with one role; weights apply per pool and per instance."""

    role: Role = Field(
        description="prefill (P: gets the request with max_tokens=1) or decode (D: pulls the KV "
        "cache and streams the tokens); the fleet needs at least one pool of each"
    )
    weight: float = Field(
        default=1.0,
        ge=0.0,
        description="the pool's share of traffic relative to pools of "
        "the same role; multiplies its instances' weights (0: the pool gets nothing)",
    )
    instances: list[Instance] = Field(min_length=1, description="the pool's vLLM servers (at least one)")
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="free-form labels (e.g. gpu: h100), kept "
        "with the config for your own use; no pdscope service reads them",
    )


class LatencySLO(_Frozen):
    target_ms: float = Field(
        gt=0, description="the latency target in milliseconds: a request meets the SLO at or under it"
    )
    percentile: float = Field(
        default=99.0,
        gt=0,
        lt=100,
        description="the percentile of the window's "
        "requests held against target_ms (alerts, admission, dashboard)",
    )


class SLOSettings(_Frozen):
    ttft: LatencySLO = Field(
        default=LatencySLO(target_ms=2000.0, percentile=99.0),
        description="time to first token as the client sees it at the proxy (admission "
        "wait, prefill, KV handoff, D's first token)",
    )
    tpot: LatencySLO = Field(
        default=LatencySLO(target_ms=100.0, percentile=99.0),
        description="time per output token after the first (decode speed)",
    )
    goodput_attainment: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="share of completed requests that must meet every SLO (both TTFT and TPOT); "
        "GoodputAttainmentLow fires below it",
    )
    window_s: float = Field(
        default=300.0,
        gt=0,
        description="seconds of completed requests the SLO figures (alerts, GET /v1/slo) are computed over",
    )
    handoff_budget_ms: float | None = Field(
        default=None,
        gt=0,
        description="budget of the P->D handoff (P done to D's first token) at p99: "
        "HandoffP99OverBudget and the D pools' backlog pressure; default: half of ttft.target_ms",
    )


# -- alerts -----------------------------------------------------------------------------

# The controller's built-in alert rules, in the order it evaluates them. The one list of
# names: ``controller.policy.alerts`` builds exactly these (a unit test checks both agree).
ALERT_RULE_NAMES: tuple[str, ...] = (
    "TTFTOverTarget",
    "TPOTOverTarget",
    "GoodputAttainmentLow",
    "NixlTransferFailures",
    "KVLeaseExpired",
    "KVCacheNearlyFull",
    "InstanceDown",
    "HandoffP99OverBudget",
    "CollectorBehind",
)

Severity = Literal["info", "warning", "critical"]


def _known_rule(name: str) -> str:
    if name not in ALERT_RULE_NAMES:
        raise ValueError(f"unknown alert rule {name!r}; known rules: {', '.join(ALERT_RULE_NAMES)}")
    return name


AlertRuleName = Annotated[str, AfterValidator(_known_rule)]


class AlertRuleSettings(_Frozen):
    """Overrides for one built-in rule; an unset field keeps the rule's default."""

    for_s: float | None = Field(
        default=None,
        ge=0,
        description="seconds the condition must hold before "
        "the alert fires (pending until then); default: the rule's own",
    )
    severity: Severity | None = Field(
        default=None, description="severity label sent with the alert; default: the rule's own"
    )
    enabled: bool = Field(
        default=True, description="false: the rule resolves the alerts it had and raises no new ones"
    )


class AlertSettings(_Frozen):
    """The top-level ``alerts`` section: when and how loudly the controller alerts.

    It is not part of ``slo`` on purpose: ``slo`` holds what the service promises (targets
    agreed with its users), ``alerts`` holds the paging policy, which also covers fleet
    health that no SLO names (KV cache full, an instance down, a stale collector) -- the
    same split as SLO targets versus alerting rules in Prometheus. SLO rules take their
    thresholds from ``slo``; here they only get ``for`` durations, severities and switches.
    """

    resend_s: float = Field(
        default=60.0, gt=0, description="a firing alert is POSTed to the webhook again this often"
    )
    min_requests: int = Field(
        default=10,
        ge=1,
        description="fewer completed requests than this in slo.window_s: the SLO "
        "rules hold their state instead of judging",
    )
    kv_full: float = Field(
        default=0.95,
        gt=0,
        le=1,
        description="KVCacheNearlyFull fires when an instance's KV usage (0-1) is above this",
    )
    rules: dict[AlertRuleName, AlertRuleSettings] = Field(
        default_factory=dict,
        description="per built-in rule (by name, e.g. TTFTOverTarget): for_s, severity, "
        "enabled; an unknown rule name is an error",
    )


STORE_DRIVERS = ("sqlite", "sqlite+pysqlite", "postgresql", "postgres", "postgresql+psycopg")


class StoreSettings(_Frozen):
    url: str = Field(
        default="sqlite:///pdscope.db",
        description="SQLAlchemy URL of the store shared by every service: sqlite:///FILE "
        "or postgresql[+psycopg]://USER@HOST/DB (psycopg 3); another scheme is an error",
    )
    retention_raw_s: float = Field(
        default=6 * 3600.0,
        gt=0,
        description="seconds raw snapshots, spans and "
        "request records are kept (never deleted before their minute is rolled "
        "up); also the collector's too_old horizon for incoming spans",
    )
    retention_rollup_s: float = Field(
        default=30 * 86400.0,
        gt=0,
        description="seconds the per-minute rollups (per instance and per P x D pair) are kept",
    )

    @field_validator("url")
    @classmethod
    def _supported_url(cls, value: str) -> str:
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        try:
            driver = make_url(value).drivername
        except (ArgumentError, ValueError) as exc:
            raise ValueError("not a database URL; use sqlite:///FILE or postgresql://USER@HOST/DB") from exc
        if driver not in STORE_DRIVERS:
            raise ValueError(
                f"unsupported database {driver!r}; use sqlite:///FILE or postgresql://USER@HOST/DB "
                "(driver psycopg)"
            )
        return value


class ProbeSettings(_Frozen):
    """How an instance at the floor is tried again (a probe, not a ramp)."""

    after_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="seconds after its last cut or outage that an instance "
        "with too few requests to judge is probed",
    )
    weight: float = Field(
        default=0.1, gt=0, le=1, description="the most a probe raises a weight to; further only on evidence"
    )
    hold_s: float = Field(
        default=20.0,
        gt=0,
        le=3600,
        description="seconds a probe is judged for: a failure within it cuts "
        "the weight back to the floor (ProbeFailed)",
    )


class NoiseSettings(_Frozen):
    """What a cut needs to be evidence rather than noise (quiet when healthy)."""

    min_samples: int = Field(
        default=5,
        ge=1,
        le=10_000,
        description="requests or NIXL transfers in the window before a latency score may cut",
    )
    z: float = Field(
        default=2.0,
        ge=0,
        le=10,
        description="each tolerance is widened by z x the combined relative "
        "standard error of the value and its peers' median (small samples need a larger "
        "difference to cut)",
    )
    startup_s: float | None = Field(
        default=None,
        gt=0,
        le=3600,
        description="no latency/load/limit cuts until the store has watched the fleet "
        "this long: its warm-up and one window for it to leave the "
        "window (default: 2 x controller.window_s)",
    )
    min_error_events: int = Field(
        default=3,
        ge=1,
        le=10_000,
        description="failures or attributed lease expiries in the window before errors score",
    )
    queue_confirm_ticks: int = Field(
        default=2, ge=1, le=100, description="ticks in a row a P-queue pressure must hold before a limit cut"
    )


BUNDLE_RULES_DEFAULT: tuple[str, ...] = tuple(r for r in ALERT_RULE_NAMES if r != "CollectorBehind")


class BundleSettings(_Frozen):
    """Incident bundles: one archive of the window before an alert fired (docs/alerts.md)."""

    enabled: bool = Field(
        default=False,
        description="write a bundle when one of the rules below starts firing (pdscope bundle "
        "writes one on demand either way)",
    )
    dir: str = Field(
        default="pdscope-bundles",
        min_length=1,
        max_length=1024,
        description="directory the bundles are written to (created if missing); also pdscope bundle's "
        "default --out",
    )
    window_s: float = Field(
        default=900.0,
        gt=0,
        le=86400,
        description="seconds of stored data before the alert fired that a bundle holds",
    )
    rules: list[AlertRuleName] = Field(
        default_factory=lambda: list(BUNDLE_RULES_DEFAULT),
        description="the alert rules whose firing writes a bundle: the SLO and P/D-health rules "
        "(every rule but CollectorBehind, whose window has no fresh data)",
    )
    max_records: int = Field(
        default=20_000,
        ge=1,
        le=1_000_000,
        description="most rows of each table (request records, snapshots, decisions) in a bundle; "
        "over it, every k-th row is kept and the manifest says so",
    )
    max_bytes: int = Field(
        default=64 * 2**20,
        ge=2**20,
        le=2**31,
        description="most bytes of a bundle's uncompressed content; over it, each table keeps its "
        "newest rows that fit and the manifest says so",
    )
    keep: int = Field(
        default=50,
        ge=1,
        le=100_000,
        description="the newest automatic bundles kept in dir; older ones are deleted",
    )
    queue_max: int = Field(
        default=8,
        ge=1,
        le=1024,
        description="bundles waiting to be written at most; when full the oldest waiting is dropped "
        "(and counted)",
    )

    @field_validator("rules")
    @classmethod
    def _unique_rules(cls, rules: list[str]) -> list[str]:
        dup = sorted({r for r in rules if rules.count(r) > 1})
        if dup:
            raise ValueError(f"rule(s) listed twice: {', '.join(dup)}")
        return rules


class AuthThrottleSettings(_Frozen):
    """How wrong bearer tokens from one client address are throttled (``pdscope.auththrottle``)."""

    max_failures: int = Field(
        default=20,
        ge=1,
        le=100_000,
        description="wrong tokens one client address may send within window_s; past it, 429 "
        "with Retry-After for block_s, its token not even compared",
    )
    window_s: float = Field(default=60.0, gt=0, le=86_400, description="the window max_failures counts in")
    block_s: float = Field(default=300.0, gt=0, le=86_400, description="how long an address is refused")
    max_sources: int = Field(
        default=10_000,
        ge=1,
        le=1_000_000,
        description="client addresses remembered; past it the least recently seen is forgotten",
    )


class _HTTPServerSettings(_Frozen):
    """What a pdscope HTTP server (the controller's API, the collector's receiver) bounds per client."""

    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="time a client has to send a request's headers (from its first byte, or from "
        "connecting); then the connection is closed",
    )
    max_connections: int = Field(
        default=1000,
        ge=1,
        le=1_000_000,
        description="open connections served at once; a request past it is answered 503",
    )
    auth_throttle: AuthThrottleSettings = Field(
        default=AuthThrottleSettings(),
        description="wrong bearer tokens from one client address: counted, logged once per window, throttled",
    )


class ControllerSettings(_HTTPServerSettings):
    host: str = Field(
        default="127.0.0.1",
        description="address the control API listens on; a non-loopback "
        "one needs an API token in the environment",
    )
    port: int = Field(default=8300, ge=1, le=65535, description="port of the control API")
    interval_s: float = Field(default=2.0, gt=0, description="seconds between reconcile ticks")
    window_s: float = Field(
        default=30.0,
        gt=0,
        description="seconds of snapshots and request records each tick reads back from the store",
    )
    mode: Literal["advisory", "enforce"] = Field(
        default="enforce",
        description="enforce: the proxy applies the routing table; advisory: the controller "
        "decides, stores and shows, and the table says enforce: false",
    )
    api_token_env: str = Field(
        default="PDSCOPE_API_TOKEN",
        min_length=1,
        description="the NAME of the env variable holding the API token of identity api "
        "(mutations need a token; with none they answer 403)",
    )
    api_tokens_env: str = Field(
        default="PDSCOPE_API_TOKENS",
        min_length=1,
        description="the NAME of an env variable holding name:token[,name:token...] (named API identities)",
    )
    trusted_span_senders: list[Annotated[str, Field(min_length=1, max_length=64)]] | None = Field(
        default=None,
        description="unset: every stored request record counts; a list: only records whose sender "
        "(OTLP token name) is in it feed the controller's observation",
    )
    max_body_bytes: int = Field(
        default=64 * 1024, ge=1024, le=16 * 2**20, description="largest API request body; larger ones get 413"
    )
    alert_webhook_url: str | None = Field(
        default=None,
        description="where firing and resolved alerts are POSTed in Alertmanager's webhook "
        "format (version 4); none: not sent",
    )
    max_weight_step: float = Field(
        default=0.25,
        gt=0,
        le=1,
        description="the most an instance's weight moves "
        "in one tick (a severe drop is not smoothed, but still moves at most this)",
    )
    min_weight: float = Field(
        default=0.02,
        ge=0,
        le=1,
        description="floor of an up, undrained instance's weight: a trickle of traffic, so recovery can "
        "be probed (see docs/policy.md)",
    )
    kv_lease_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="the fleet's KV lease (vLLM kv_connector_extra_config.kv_lease_duration, default 30 s): "
        "the collector joins a rise of P's lease expiries with handoffs on that P still waiting "
        "two thirds of a lease after P finished (a D heartbeat may set a lease to 2/3 of it)",
    )
    probe: ProbeSettings = Field(
        default=ProbeSettings(),
        description="how an instance at a low weight is tried again: a probe, not a ramp",
    )
    advertise_url: str | None = Field(
        default=None,
        min_length=8,
        max_length=200,
        pattern=r"^https?://[^\s]+$",
        description="where the other controller replicas reach this one's API (kept with its leadership "
        "in the store, named in a standby's 409, where a standby forwards changes). Unset: "
        "http://<this host's address>:<port>, the address being controller.host unless that is a "
        "wildcard, then the host name's address (a pod's IP)",
    )
    shadow: dict[Annotated[str, Field(min_length=1, max_length=64)], float] | None = Field(
        default=None,
        max_length=64,
        description="policy settings (fields of the policy config: min_weight, max_weight_step, "
        "recover_ticks, noise_z, ...) a shadow policy runs with beside the live one: it decides every "
        "tick on the same observation, is never served or stored, and GET /v1/shadow and "
        "pdscope_controller_shadow_* say where it parts from the live decisions (docs/policy.md). "
        "Unset: no shadow",
    )
    record_ticks: bool = Field(
        default=True,
        description="store each tick's whole input and resulting state (tick_records, compressed, "
        "deleted with the raw rows): what pdscope replay re-runs the policy from. Off: replay has "
        "nothing to read for the ticks taken meanwhile",
    )
    forward_changes: bool = Field(
        default=True,
        description="a standby forwards an operator change to the leader's advertise_url (once: a "
        "forwarded change is never forwarded again) instead of answering 409; the 409 stays when "
        "the leader cannot be reached",
    )
    proxy_ttl_s: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="a proxy not heard from (no routing poll) for this long is dead: it leaves "
        "GET /v1/proxies' live set and its share of the pools' limits goes to the others",
    )
    proxy_share_floor: float = Field(
        default=0.2,
        ge=0,
        le=1,
        description="part of every pool's limits split equally among the live proxies (so an idle "
        "one can still admit); the rest follows each proxy's share of the pool's recent demand",
    )
    proxy_tokens_env: str = Field(
        default="PDSCOPE_PROXY_TOKENS",
        min_length=1,
        description="the NAME of an env variable holding name:token[,name:token...]: a token speaks for "
        "the proxy id equal to its name or beginning with <name>: or <name>/ (a report under another id: "
        "403). With it or proxy_secret_env set, a routing poll that reports a proxy needs Authorization: "
        "Bearer <its token> (401 otherwise; a poll without a report stays open). Neither set: any poll "
        "may report, so keep the controller reachable by the proxies only",
    )
    proxy_secret_env: str = Field(
        default="PDSCOPE_PROXY_SECRET",
        min_length=1,
        description="the NAME of an env variable holding the fleet's proxy secret (at least 16 "
        "characters): when it is set, the token of proxy id X is hex HMAC-SHA256(secret, X), which each "
        "proxy derives from its own id (proxy.controller_secret_env); a token speaks for its id only",
    )
    max_proxies: int = Field(
        default=256,
        ge=1,
        le=100_000,
        description="most live proxies the limits are split among (with no proxy credentials "
        "configured: at most proxy.expected_replicas); a new id beyond them gets the table without a "
        "part (it admits limit / proxy.expected_replicas) and is counted (over_limit)",
    )
    proxy_share_window_s: float = Field(
        default=30.0,
        gt=0,
        le=86400,
        description="time constant of the smoothed per-proxy demand rate the shares follow",
    )
    noise: NoiseSettings = Field(
        default=NoiseSettings(),
        description="what a cut needs to be evidence rather than noise (quiet when healthy)",
    )
    bundles: BundleSettings = Field(
        default=BundleSettings(),
        description="incident bundles: an archive of the window before an SLO or P/D-health alert "
        "fired, with an HTML report (docs/alerts.md)",
    )


class AdmissionDefaults(_Frozen):
    max_inflight_requests: int = Field(
        default=256,
        gt=0,
        description="requests a pool may hold in flight "
        "when the routing table sets no limit; the limit AIMD grows back to",
    )
    max_inflight_kv_bytes: int = Field(
        default=64 * 2**30,
        gt=0,
        description="handoff KV bytes (prompt tokens "
        "x model.kv_bytes_per_token, from P's answer to D's first token) a pool "
        "may hold; the controller scales it by the KV headroom",
    )
    queue_timeout_s: float = Field(
        default=1.0,
        ge=0,
        description="seconds a request over a limit waits for "
        "room before its 429; a pool's max_queue_wait_s in the table can shorten it",
    )
    retry_after_s: int = Field(default=1, ge=1, description="Retry-After seconds sent with a 429")


class ProxyTimeouts(_Frozen):
    connect_s: float = Field(default=2.0, gt=0, description="seconds to connect to a P or D instance")
    prefill_s: float = Field(
        default=60.0,
        gt=0,
        description="seconds for P's whole max_tokens=1 answer; past "
        "it another P is tried if the retry budget allows, else 504",
    )
    decode_first_token_s: float = Field(
        default=60.0,
        gt=0,
        description="seconds from sending to D until its "
        "first token of a streamed request (504 before any byte)",
    )
    decode_total_s: float = Field(
        default=600.0,
        gt=0,
        description="seconds for D's whole answer (a "
        "non-streamed request's first-token bound too); past it the outcome is "
        "timeout",
    )


class OutlierSettings(_Frozen):
    """Outlier detection in the proxy (``proxy/outlier.py``): the one home of an instance's recent
    failures."""

    consecutive_failures: int = Field(
        default=5, ge=1, le=10_000, description="this many failures in a row eject the instance"
    )
    failure_ratio: float = Field(
        default=0.2,
        gt=0,
        le=1,
        description="failed share of the last window_s that ejects (with min_requests)",
    )
    min_requests: int = Field(
        default=20, ge=1, le=1_000_000, description="results in the window before the ratio counts"
    )
    window_s: float = Field(
        default=10.0, gt=0, le=3600, description="seconds of results the failure ratio is computed over"
    )
    base_ejection_s: float = Field(
        default=5.0, gt=0, le=3600, description="first ejection; doubles per successive one"
    )
    max_ejection_s: float = Field(default=60.0, gt=0, le=86400, description="cap on one ejection")
    max_ejected_share: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description=(
            "share of a pool that may be ejected at once (at least one, never the last; 0: never eject)"
        ),
    )
    failure_penalty: float = Field(
        default=2.0,
        ge=0,
        le=10,
        description=(
            "exponent k: selection weighs an instance by (1 - recent failure ratio)^k (0: failures ignored)"
        ),
    )

    @model_validator(mode="after")
    def _ejection_bounds(self) -> OutlierSettings:
        if self.max_ejection_s < self.base_ejection_s:
            raise ValueError("max_ejection_s must be at least base_ejection_s")
        return self


class AdaptiveLimitSettings(_Frozen):
    """The proxy's local adaptive concurrency limit per pool (``proxy/concurrency.py``), AIMD on its
    own TTFT."""

    enabled: bool = Field(
        default=True,
        description="hold each pool's request limit under an AIMD limit "
        "driven by the proxy's own TTFT against slo.ttft; off under policy round-robin",
    )
    min_limit: int = Field(default=1, ge=1, le=1_000_000, description="floor of a pool's adaptive limit")
    increase: int = Field(
        default=2, ge=1, le=1_000_000, description="added per window comfortably under target"
    )
    decrease_factor: float = Field(
        default=0.75, gt=0, lt=1, description="limit multiplied by this per window over target"
    )
    window_s: float = Field(
        default=1.0, gt=0, le=600, description="one decision per window (once min_samples arrived)"
    )
    min_samples: int = Field(default=10, ge=1, le=1_000_000, description="samples a decision needs")
    headroom: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="'comfortably under': the SLO percentile under headroom x target",
    )


class DecodeOnlySettings(_Frozen):
    """Conditional disaggregation: when P would add little, D alone computes the prompt."""

    enabled: bool = Field(
        default=False,
        description="send a request to D alone (no prefill round trip, no KV handoff) when the "
        "thresholds below say its P would add little",
    )
    max_uncached_tokens: int = Field(
        default=256,
        ge=0,
        le=10_000_000,
        description="D alone when the prompt tokens the best D does not hold are at most this many",
    )
    min_d_cached_ratio: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="D alone when the best D already holds at least this share of the prompt",
    )


class KvAwareSettings(_Frozen):
    """KV-aware routing (docs/proxy.md): P and D chosen by expected TTFT given the KV cache each holds."""

    mode: Literal["off", "approximate", "precise"] = Field(
        default="off",
        description="off: load-only routing (weights and in-flight load); approximate: a tree of the "
        "prompts this proxy routed (no tokenizer, no events); precise: the prompt tokenized with "
        "model.tokenizer and matched against the instances' KV events (kv_events_endpoint)",
    )
    affinity_bound: float = Field(
        default=1.5,
        ge=1,
        le=1000,
        description="an instance whose load (in-flight requests per weight) would go over this multiple "
        "of its role's mean load loses its cache credit for the request, so a hot prefix spills "
        "onto another instance instead of melting one",
    )
    prefill_tokens_per_s: float = Field(
        default=16000,
        gt=0,
        le=1e9,
        description="the prefill rate of one P (at weight 1) the cost model assumes",
    )
    transfer_tokens_per_s: float = Field(
        default=200000,
        gt=0,
        le=1e12,
        description="the rate at which D pulls KV from P, in tokens, that the cost model assumes",
    )
    max_index_blocks: int = Field(
        default=1_000_000,
        ge=1,
        le=1_000_000_000,
        description="precise mode: (instance, block) entries the prefix index holds fleet-wide; the "
        "least recently stored go first",
    )
    approx_block_chars: int = Field(
        default=64,
        ge=1,
        le=1_000_000,
        description="approximate mode: characters of prompt text per block of the prompt tree",
    )
    approx_chars_per_token: float = Field(
        default=4.0,
        gt=0,
        le=1000,
        description="approximate mode: characters per token, to estimate a prompt's tokens",
    )
    approx_ttl_s: float = Field(
        default=300,
        gt=0,
        le=86400 * 7,
        description="approximate mode: a prompt routed this long ago is assumed evicted",
    )
    approx_capacity_tokens: int = Field(
        default=500000,
        ge=1,
        le=10**12,
        description="approximate mode: the prompt tokens one instance is assumed to keep cached "
        "(its KV capacity); past it, its least recently routed prompts are forgotten",
    )
    event_queue_max: int = Field(
        default=10000,
        ge=1,
        le=10_000_000,
        description="precise mode: KV event messages queued per instance before the newest are "
        "dropped (a drop shows as a sequence gap)",
    )
    decode_only: DecodeOnlySettings = Field(
        default=DecodeOnlySettings(), description="conditional disaggregation: when D alone serves a request"
    )


class ProxySettings(_Frozen):
    host: str = Field(default="127.0.0.1", description="address the client-facing API listens on")
    port: int = Field(default=8000, ge=1, le=65535, description="port of the client-facing API")
    id: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=PROXY_ID_PATTERN,
        description="this proxy's id among the proxies in front of the fleet, sent on every routing "
        "poll; the controller apportions each pool's limits among the live ids. Unique per "
        "process. Unset: <hostname>:<port>",
    )
    controller_token_env: str = Field(
        default="PDSCOPE_PROXY_TOKEN",
        min_length=1,
        description="env variable whose value the routing poll sends as Authorization: Bearer <value> "
        "(needed when the controller sets controller.proxy_tokens_env; unset: no header)",
    )
    controller_secret_env: str = Field(
        default="PDSCOPE_PROXY_SECRET",
        min_length=1,
        description="env variable holding the fleet's proxy secret (controller.proxy_secret_env): when "
        "set, the routing poll sends the token derived from it and this proxy's id, and "
        "controller_token_env is not read",
    )
    expected_replicas: int = Field(
        default=1,
        ge=1,
        le=10_000,
        description="how many proxies normally run: with no share from the controller (never "
        "reached, or unreachable past fail_static_s) this proxy admits the config's limits "
        "divided by this, never the whole limit",
    )
    controller_url: str | None = Field(
        default=None,
        description="where GET /v1/routing is polled; default http://<controller.host>:<controller.port>",
    )
    controller_urls: (
        list[Annotated[str, Field(min_length=8, max_length=512, pattern=r"^https?://")]] | None
    ) = Field(
        default=None,
        min_length=1,
        max_length=16,
        description="several controller replicas to poll GET /v1/routing from (every replica serves it): "
        "the one that last answered first, the next on a failure; overrides controller_url",
    )
    routing_poll_s: float = Field(
        default=1.0, gt=0, description="seconds between polls of the routing table (with If-None-Match)"
    )
    fail_static_s: float = Field(
        default=60.0,
        ge=0,
        description="seconds the last table is kept while the "
        "controller is unreachable; then equal weights from the config (fallback)",
    )
    policy: Literal["weighted", "round-robin"] = Field(
        default="weighted",
        description="weighted: power of two choices on the table's weights; round-robin: "
        "cycles like vLLM's toy proxy (a baseline: no failure weighing, no adaptive limit)",
    )
    retry_budget: float = Field(
        default=0.2,
        ge=0,
        le=1,
        description="retries may be at most this share of "
        "requests (plus a small reserve), so a failing pool cannot double the load",
    )
    outlier: OutlierSettings = Field(
        default=OutlierSettings(),
        description="outlier detection: when a failing instance is ejected, and for how long",
    )
    adaptive_limit: AdaptiveLimitSettings = Field(
        default=AdaptiveLimitSettings(), description="the proxy's own AIMD limit per pool on its TTFT"
    )
    admission: AdmissionDefaults = Field(
        default=AdmissionDefaults(),
        description="per-pool admission limits used where the routing table sets none",
    )
    timeouts: ProxyTimeouts = Field(
        default=ProxyTimeouts(),
        description="bounds on each stage of a request (a timeout is a 504 before the first byte)",
    )
    otlp_endpoint: str | None = Field(
        default=None, description="where spans are exported (OTLP/HTTP); default the collector's /v1/traces"
    )
    otlp_token_env: str = Field(
        default="PDSCOPE_OTLP_TOKEN",
        min_length=1,
        description="env variable whose value the span exporter sends as Authorization: Bearer <value> "
        "(unset: no header)",
    )
    tracing: bool = Field(
        default=True,
        description="emit and export OpenTelemetry spans and forward "
        "traceparent to P and D (off: no spans, nothing for the collector to assemble)",
    )
    trace_sample_ratio: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="share of requests whose whole trace is kept (head sampling on the trace id, sent "
        "on as the traceparent sampled flag so vLLM follows it; a caller's sampled traceparent is "
        "always kept); every other request exports its root span only (its record is complete), "
        "except a failed or retried one or one over slo.ttft.target_ms, whose proxy spans are kept",
    )
    span_queue_max: int = Field(
        default=32768,
        ge=1,
        le=2**22,
        description=(
            "spans held for export (a down collector costs nothing until this fills; then counted drops)"
        ),
    )
    span_retry_max_s: float = Field(
        default=5.0,
        gt=0,
        le=300,
        description="longest pause between tries of a failed span batch",
    )
    client_read_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="time a client has to send a request's headers and body; then the connection is closed",
    )
    max_request_bytes: int = Field(
        default=32 * 2**20, gt=0, le=2**30, description="largest client body (413)"
    )
    max_model_len: int | None = Field(
        default=None,
        gt=1,
        description=(
            "the model's context length; when set, max_tokens that cannot fit is a 400 before prefill. "
            "Unset: the smallest max_model_len the instances report on GET /v1/models"
        ),
    )
    max_tokens_overflow: Literal["refuse", "clamp"] = Field(
        default="refuse",
        description=(
            "a prompt plus max_tokens over the context: refuse (a 400 before prefill, as OpenAI and "
            "older vLLM do) or clamp (let it through: vLLM 0.32 and the simulator cut max_tokens to the "
            "room left; only a prompt that leaves no room is refused)"
        ),
    )
    model_info_refresh_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="how often the proxy asks every instance for GET /v1/models and GET /version",
    )
    kv_aware: KvAwareSettings = Field(
        default=KvAwareSettings(),
        description="KV-aware routing: P and D chosen by the KV cache they hold, bounded by load",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_cooldown(cls, data: Any) -> Any:
        if isinstance(data, dict) and "failure_cooldown_s" in data:
            raise ValueError(
                "failure_cooldown_s was replaced by proxy.outlier (consecutive_failures, failure_ratio, "
                "base_ejection_s, ...): see docs/proxy.md"
            )
        return data


class CollectorSettings(_HTTPServerSettings):
    host: str = Field(
        default="127.0.0.1",
        description="address of the OTLP/HTTP receiver, /metrics and "
        "/healthz; a non-loopback one needs OTLP tokens",
    )
    port: int = Field(
        default=4318, ge=1, le=65535, description="port of the OTLP/HTTP receiver, /metrics and /healthz"
    )
    id: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@-]*$",
        description="this collector's id among the collectors sharing a PostgreSQL store, which split "
        "the instances to scrape between them; unique per process. Unset: <hostname>:<receiver port>",
    )
    scrape_interval_s: float = Field(
        default=5.0,
        gt=0,
        description="seconds between scrapes of every instance's /metrics (or Prometheus queries)",
    )
    scrape_timeout_s: float = Field(
        default=3.0,
        gt=0,
        description="hard deadline of one scrape (connect, "
        "headers and body); must be shorter than scrape_interval_s",
    )
    max_body_bytes: int = Field(
        default=8 * 2**20, gt=0, description="a /metrics page is cut here (a Prometheus answer at 8 x this)"
    )
    prometheus_url: str | None = Field(
        default=None,
        description="read vLLM's series from this Prometheus "
        "(/api/v1/query) instead of scraping; also pdscope collect "
        "--prometheus-url",
    )
    prometheus_instance_label: str = Field(
        default="instance",
        min_length=1,
        description="Prometheus label holding the pdscope instance name or the metrics URL's host:port",
    )
    prometheus_selector: str = Field(
        default="", description='label matchers added to every Prometheus query, e.g. job="vllm"'
    )
    otlp_tokens_env: str = Field(
        default="PDSCOPE_OTLP_TOKENS",
        min_length=1,
        description="name of the env variable holding sender:token[,sender:token...] for POST /v1/traces; "
        "unset: no authentication, and the collector binds only a loopback host",
    )
    otlp_max_body_bytes: int = Field(
        default=16 * 2**20, gt=0, description="largest OTLP body as sent (or by Content-Length); larger: 413"
    )
    otlp_max_inflated_bytes: int = Field(
        default=64 * 2**20,
        gt=0,
        description="largest OTLP body after gzip/deflate decompression; larger: 413",
    )
    otlp_inflight_bytes: int = Field(
        default=128 * 2**20,
        gt=0,
        description="OTLP bytes (as sent plus inflated) held by all requests at once; past it: 429",
    )
    otlp_retry_after_s: int = Field(default=1, ge=1, le=3600, description="Retry-After of a 429/503")
    span_queue_spans: int = Field(
        default=200_000,
        gt=0,
        description="spans waiting for the store held decoded in memory; past it they wait on disk only "
        "(with spool_dir ':memory:' this is the spool's bound: a full spool answers 503)",
    )
    spool_dir: str | None = Field(
        default=None,
        min_length=1,
        description="folder of the durable span spool: every accepted OTLP export is written here "
        "before its 2xx and kept until the store has it, so a store outage loses nothing; one "
        "collector process per folder. Unset: <temp dir>/pdscope-spool/<hash of store url and "
        "collector id> (survives a restart of the process, not of the host: set a persistent "
        "volume in production). ':memory:': in memory only (lost when the process stops)",
    )
    spool_max_bytes: int = Field(
        default=2**30,
        ge=2**20,
        description="bytes of span batches the spool holds for the store; past it OTLP exports get "
        "503 with Retry-After (never 2xx and dropped). Disk use can exceed it by one segment",
    )
    spool_max_age_s: float = Field(
        default=3600.0,
        gt=0,
        allow_inf_nan=False,
        description="while the spool's oldest batch has waited longer than this for the store, new "
        "exports get 503 with Retry-After",
    )
    spool_fsync: Literal["always", "never"] = Field(
        default="always",
        description="always: each export is fsynced before its 2xx (survives a host crash); never: "
        "left to the OS (survives the collector's crash or kill, not the host's)",
    )
    spool_segment_bytes: int = Field(
        default=64 * 2**20,
        ge=2**16,
        description="size of one spool file; a file goes once the store has all of it",
    )
    span_max_attributes: int = Field(default=128, gt=0, le=10_000, description="attribute keys kept per span")
    span_max_value_chars: int = Field(default=2048, gt=0, description="longest attribute string kept")
    span_max_attribute_chars: int = Field(
        default=32 * 1024, gt=0, description="all of a span's attributes together, serialised"
    )
    span_max_future_s: float = Field(
        default=300.0,
        ge=0,
        allow_inf_nan=False,
        description="spans starting or ending further ahead of the collector's clock than this are "
        "dropped (in_future)",
    )

    @model_validator(mode="after")
    def _timeout_below_interval(self) -> CollectorSettings:
        if self.scrape_timeout_s >= self.scrape_interval_s:
            raise ValueError("scrape_timeout_s must be shorter than scrape_interval_s")
        if self.otlp_max_inflated_bytes < self.otlp_max_body_bytes:
            raise ValueError("otlp_max_inflated_bytes must be at least otlp_max_body_bytes")
        if self.otlp_inflight_bytes < self.otlp_max_body_bytes + self.otlp_max_inflated_bytes:
            raise ValueError(
                "otlp_inflight_bytes must hold one largest request: "
                "otlp_max_body_bytes + otlp_max_inflated_bytes"
            )
        return self

    def otlp_tokens(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """token -> sender, from ``$otlp_tokens_env``; empty when unset (no authentication).

        Raises ConfigError naming the variable when an entry is not ``sender:token``.
        """
        raw = (os.environ if environ is None else environ).get(self.otlp_tokens_env, "")
        try:
            by_sender = parse_named_tokens(raw, self.otlp_tokens_env)
        except ValueError as exc:
            raise ConfigError([str(exc)]) from exc
        return {token: sender for sender, token in by_sender.items()}


# Names of token holders (API identities, span senders): they end up in audit rows and in
# request records, so they are short and plain.
MAX_TOKEN_NAME_CHARS = 63
MIN_PROXY_SECRET_CHARS = 16


def parse_named_tokens(raw: str, env_name: str) -> dict[str, str]:
    """``name:token[,name:token...]`` (the value of ``$env_name``) -> {name: token}.

    The one parser of named-token variables (controller API identities, OTLP senders).
    Raises ``ValueError`` naming the variable and the entry: not ``name:token``, a name that is
    not 1-63 of letters, digits, ``-_.@``, a name given twice, or one token given two names.
    """
    out: dict[str, str] = {}
    for i, entry in enumerate(p.strip() for p in raw.split(",")):
        if not entry:
            continue
        name, sep, token = entry.partition(":")
        name, token = name.strip(), token.strip()
        where = f"${env_name} entry {i + 1}"
        if not sep or not token:
            raise ValueError(f"{where}: expected name:token")
        if not (
            0 < len(name) <= MAX_TOKEN_NAME_CHARS
            and all(c.isascii() and (c.isalnum() or c in "-_.@") for c in name)
        ):
            raise ValueError(
                f"{where}: name {name!r} must be 1-{MAX_TOKEN_NAME_CHARS} characters "
                "of letters, digits, '-', '_', '.', '@'"
            )
        if name in out:
            raise ValueError(f"{where}: name {name!r} appears twice")
        if token in out.values():
            raise ValueError(f"${env_name}: two names share one token")
        out[name] = token
    return out


def is_loopback(host: str) -> bool:
    """Whether a bind address only accepts local connections (127.x, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class DashboardSettings(_Frozen):
    host: str = Field(
        default="127.0.0.1",
        description="address the Streamlit app listens on; a non-loopback one needs auth login or header",
    )
    port: int = Field(default=8501, ge=1, le=65535, description="port of the Streamlit app")
    auth: Literal["login", "header", "none"] = Field(
        default="login",
        description="login: each user signs in with their own controller API token (checked with "
        "GET /v1/whoami) and changes are made with it; header: the identity comes from "
        "identity_header, set by a trusted auth proxy, and changes use the server's token with "
        "X-Actor; none: read-only (forms disabled). A non-loopback host needs login or header.",
    )
    identity_header: str | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9-]+$",
        description="request header carrying the user set by the auth proxy (auth: header), "
        "e.g. X-Forwarded-User; required with auth: header, ignored otherwise",
    )

    @model_validator(mode="after")
    def _header_mode_names_its_header(self) -> DashboardSettings:
        if self.auth == "header" and self.identity_header is None:
            raise ValueError(
                "auth: header needs identity_header (e.g. X-Forwarded-User, set by your auth proxy)"
            )
        return self


class Settings(_Frozen):
    """The whole file. Sections other than ``model`` and ``pools`` have defaults."""

    model: ModelSettings = Field(description="The served model, as every instance knows it. Required.")
    pools: dict[str, Pool] = Field(
        description="The fleet: named pools of instances, each pool prefill or "
        "decode; at least one of each. Required."
    )
    slo: SLOSettings = Field(
        default=SLOSettings(),
        description="What the service promises its users: the "
        "targets alerts, admission, the dashboard and the benchmarks judge against.",
    )
    alerts: AlertSettings = Field(
        default=AlertSettings(),
        description="The controller's paging policy: when "
        "and how loudly the built-in rules (docs/alerts.md) alert.",
    )
    store: StoreSettings = Field(
        default=StoreSettings(),
        description="The database every service meets in, and how long it keeps what it holds.",
    )
    controller: ControllerSettings = Field(
        default=ControllerSettings(),
        description="The reconcile loop and its HTTP API (docs/policy.md, docs/api.md).",
    )
    proxy: ProxySettings = Field(
        default=ProxySettings(), description="The P/D router, the data plane (docs/proxy.md)."
    )
    collector: CollectorSettings = Field(
        default=CollectorSettings(),
        description="The scraper, the OTLP receiver and the request-record builder (docs/collector.md).",
    )
    dashboard: DashboardSettings = Field(
        default=DashboardSettings(),
        description="The Streamlit dashboard and who may change things through it (docs/dashboard.md).",
    )
    simulator: SimulatorConfig = Field(
        default_factory=SimulatorConfig,
        description="The simulated "
        "fleet's model (docs/simulator.md); only pdscope sim and the demo read "
        "it. simulator: {} is a working fleet.",
    )

    @field_validator("pools")
    @classmethod
    def _pools_cover_both_roles(cls, pools: dict[str, Pool]) -> dict[str, Pool]:
        roles = {pool.role for pool in pools.values()}
        missing = [role for role in ("prefill", "decode") if role not in roles]
        if missing:
            raise ValueError(f"no {' or '.join(missing)} pool: a P/D fleet needs at least one of each")
        seen: dict[str, tuple[str, int]] = {}
        for pool_name, pool in pools.items():
            for i, inst in enumerate(pool.instances):
                if inst.name in seen:
                    first_pool, first_i = seen[inst.name]
                    where = "also" if first_pool == pool_name else f"also in pool {first_pool!r},"
                    # ctx "loc"/"first": the formatter reports this at the duplicate's own line.
                    message = (
                        f"duplicate instance name {inst.name!r} in pool {pool_name!r}: {where} at "
                        f"pools.{first_pool}.instances.{first_i}; instance names must be unique"
                    )
                    raise PydanticCustomError(
                        "duplicate_instance",
                        "{message}",
                        {
                            "message": message,
                            "loc": ("pools", pool_name, "instances", i, "name"),
                            "first": ("pools", first_pool, "instances", first_i, "name"),
                        },
                    )
                seen[inst.name] = (pool_name, i)
        return pools

    @model_validator(mode="after")
    def _proxy_ttl_spans_polls(self) -> Settings:
        if self.controller.proxy_ttl_s < 2 * self.proxy.routing_poll_s:
            raise PydanticCustomError(
                "proxy_ttl",
                "{message}",
                {
                    "message": f"controller.proxy_ttl_s ({self.controller.proxy_ttl_s:g}) must be at least "
                    f"two routing polls (2 x proxy.routing_poll_s = {2 * self.proxy.routing_poll_s:g}): "
                    "a live proxy would be counted dead between its polls",
                    "loc": ("controller", "proxy_ttl_s"),
                },
            )
        return self

    @model_validator(mode="after")
    def _precise_needs_tokenizer(self) -> Settings:
        if self.proxy.kv_aware.mode == "precise" and self.model.tokenizer is None:
            raise PydanticCustomError(
                "kv_aware_tokenizer",
                "{message}",
                {
                    "message": "proxy.kv_aware.mode precise tokenizes prompts with model.tokenizer, "
                    f"which is unset (set it to {SIM_TOKENIZER!r} or a tokenizer path, or use approximate)",
                    "loc": ("proxy", "kv_aware", "mode"),
                },
            )
        return self

    # -- lookups used by every service -------------------------------------------------

    def instances(self, role: Role | None = None) -> Iterator[tuple[str, Instance]]:
        """Yield ``(pool_name, instance)`` for every instance, optionally of one role."""
        for pool_name, pool in self.pools.items():
            if role is None or pool.role == role:
                for inst in pool.instances:
                    yield pool_name, inst

    def pool_of(self, instance_name: str) -> str | None:
        for pool_name, inst in self.instances():
            if inst.name == instance_name:
                return pool_name
        return None

    def proxy_tokens(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """token -> proxy identity, from ``$controller.proxy_tokens_env``; empty when unset (open).

        Raises ConfigError naming the variable when an entry is not ``name:token``.
        """
        name = self.controller.proxy_tokens_env
        raw = (os.environ if environ is None else environ).get(name, "")
        try:
            by_name = parse_named_tokens(raw, name)
        except ValueError as exc:
            raise ConfigError([str(exc)]) from exc
        return {token: who for who, token in by_name.items()}

    def proxy_secret(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The fleet's proxy secret from ``$controller.proxy_secret_env``; None when unset or empty.

        Raises ConfigError naming the variable when it is shorter than 16 characters.
        """
        name = self.controller.proxy_secret_env
        raw = (os.environ if environ is None else environ).get(name, "").strip()
        if raw and len(raw) < MIN_PROXY_SECRET_CHARS:
            raise ConfigError([f"${name}: a proxy secret of at least {MIN_PROXY_SECRET_CHARS} characters"])
        return raw or None

    def api_token(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The controller API token, read from the variable named in the file."""
        env = os.environ if environ is None else environ
        token = env.get(self.controller.api_token_env)
        return token or None

    @property
    def controller_url(self) -> str:
        return self.proxy.controller_url or f"http://{self.controller.host}:{self.controller.port}"

    @property
    def controller_urls(self) -> list[str]:
        """Where the proxy polls the routing table, in the order it tries them."""
        return list(self.proxy.controller_urls or [self.controller_url])

    @property
    def collector_url(self) -> str:
        return f"http://{self.collector.host}:{self.collector.port}"


# -- loading --------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (PyYAML silently keeps the last)."""


def _construct_mapping(
    loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False
) -> dict[Any, Any]:
    mapping: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in mapping:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        mapping[key] = loader.construct_object(value_node, deep=deep)
    return mapping


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


@dataclass(frozen=True)
class _Located:
    """Line numbers (1-based) of each dotted path in a YAML document."""

    lines: dict[tuple[str | int, ...], int]

    def line_of(self, path: tuple[str | int, ...]) -> int | None:
        # The deepest known ancestor: an unknown key or a missing field points at its parent.
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return None


def _locate(node: yaml.Node | None) -> _Located:
    lines: dict[tuple[str | int, ...], int] = {}

    def walk(n: yaml.Node, path: tuple[str | int, ...]) -> None:
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                sub = (*path, str(k.value))
                lines[sub] = k.start_mark.line + 1
                walk(v, sub)
        elif isinstance(n, yaml.SequenceNode):
            for i, v in enumerate(n.value):
                sub = (*path, i)
                lines[sub] = v.start_mark.line + 1
                walk(v, sub)

    if node is not None:
        walk(node, ())
    return _Located(lines)


def _format_error(source: str, located: _Located, err: Mapping[str, Any]) -> str:
    ctx = err.get("ctx") or {}
    # A validator that knows better (a duplicate instance) names the exact field in ctx["loc"].
    loc = tuple(ctx["loc"]) if isinstance(ctx.get("loc"), tuple) else tuple(err["loc"])
    bad_key = bool(loc) and loc[-1] == "[key]"
    if bad_key:  # a bad mapping key: name the key itself (its line), not pydantic's marker
        loc = loc[:-1]
    field = ".".join(str(p) for p in loc) or "(top level)"
    line = located.line_of(loc)
    where = f"{source}:{line}" if line else source
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    first = ctx.get("first")
    if isinstance(first, tuple) and (first_line := located.line_of(first)):
        first_field = ".".join(str(p) for p in first[:-1])
        msg = msg.replace(f"at {first_field}", f"at {first_field} (line {first_line})", 1)
    if err["type"] == "extra_forbidden":
        msg = "unknown key (not a pdscope setting; check its spelling and indentation)"
    elif err["type"] == "missing":
        msg = "required field is missing"
    elif (
        "input" in err
        and not bad_key
        and "loc" not in ctx
        and err["type"] not in ("model_type", "dict_type", "list_type")
    ):
        shown = repr(err["input"])
        if len(shown) <= 60:
            msg = f"{msg} (got {shown})"
    return f"{where}: {field}: {msg}"


# Bounds on what a config file may cost to read: its size, and the number of values after
# YAML aliases are expanded (an alias bomb -- "billion laughs" -- is a few hundred bytes
# that expand to billions of values). Both are far above any real fleet's file.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_VALUES = 200_000


def _expanded_size_over(node: yaml.Node, limit: int) -> bool:
    """Whether ``node`` expands to more than ``limit`` values, counting every alias use.

    Aliases share node objects, so the count follows each reference; it stops at ``limit``,
    which also ends a recursive alias (a node that contains itself).
    """
    count = 0
    stack: list[yaml.Node] = [node]
    while stack:
        n = stack.pop()
        count += 1
        if count > limit:
            return True
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                stack.append(k)
                stack.append(v)
        elif isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)
    return False


def _compose(text: str, source: str) -> tuple[yaml.Node | None, Any]:
    """Compose (bounded), then construct, the one YAML document in ``text``."""
    size = len(text.encode("utf-8", errors="replace"))
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(
            [f"{source}: the file is {size} bytes; a config may be at most {MAX_CONFIG_BYTES} bytes"]
        )
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        if _expanded_size_over(node, MAX_CONFIG_VALUES):
            raise ConfigError(
                [
                    f"{source}: more than {MAX_CONFIG_VALUES} values once YAML aliases (*name) are "
                    "expanded; refusing to read it (an alias bomb?)"
                ]
            )
        return node, loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([f"{where}: not valid YAML: {problem}"]) from exc
    except RecursionError as exc:
        raise ConfigError([f"{source}: not valid YAML: nested too deeply"]) from exc
    finally:
        loader.dispose()


def parse_config(text: str, source: str = "<config>") -> Settings:
    """Parse and validate YAML text. Raises :class:`ConfigError` with one line per problem."""
    node, data = _compose(text, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"{source}: the top level must be a mapping of sections (model, pools, ...)"])
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        located = _locate(node)
        raise ConfigError([_format_error(source, located, e) for e in exc.errors()]) from exc


def load_config(path: str | os.PathLike[str]) -> Settings:
    """Read and validate a config file. Raises :class:`ConfigError`."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)  # never more than the limit, whatever the file's size
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError([f"{p}: larger than {MAX_CONFIG_BYTES} bytes; a config may be at most that"])
        text = raw.decode("utf-8")
    except OSError as exc:
        raise ConfigError([f"{p}: cannot read: {exc.strerror or exc}"]) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{p}: not UTF-8 text: {exc.reason} at byte {exc.start}"]) from exc
    return parse_config(text, str(p))


def resolve_config_path(cli_value: str | None, environ: Mapping[str, str] | None = None) -> Path:
    """``--config`` wins, then ``$PDSCOPE_CONFIG``, then ``./pdscope.yaml``."""
    env = os.environ if environ is None else environ
    return Path(cli_value or env.get(DEFAULT_CONFIG_ENV) or "pdscope.yaml")


def load_settings(args: argparse.Namespace) -> Settings:
    """The settings a ``pdscope`` subcommand runs with: the file ``args.config`` names (else
    ``$PDSCOPE_CONFIG``, else ``./pdscope.yaml``), read and validated once. Raises
    :class:`ConfigError`, which the command line prints one problem a line."""
    return load_config(resolve_config_path(args.config))
