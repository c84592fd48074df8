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

from pdscope.routing import Role as Role  # the one definition, with the routing contract

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


class Instance(_Frozen):
    """One vLLM server (or one simulated one)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    url: str = Field(description="base URL, e.g. http://10.0.0.5:8000")
    metrics_url: str | None = Field(default=None, description="defaults to <url>/metrics")
    labels: dict[str, str] = Field(default_factory=dict)

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

    role: Role
    weight: float = Field(default=1.0, ge=0.0, description="share of traffic relative to same-role pools")
    instances: list[Instance] = Field(min_length=1)
    labels: dict[str, str] = Field(default_factory=dict)


class LatencySLO(_Frozen):
    target_ms: float = Field(gt=0)
    percentile: float = Field(default=99.0, gt=0, lt=100)


class SLOSettings(_Frozen):
    ttft: LatencySLO = LatencySLO(target_ms=2000.0, percentile=99.0)
    tpot: LatencySLO = LatencySLO(target_ms=100.0, percentile=99.0)
    goodput_attainment: float = Field(
        default=0.9, gt=0, le=1, description="share of completed requests that must meet every SLO"
    )
    window_s: float = Field(default=300.0, gt=0, description="window the SLOs are evaluated over")
    handoff_budget_ms: float | None = Field(
        default=None, gt=0, description="P->D handoff p99 budget; default: half of ttft.target_ms"
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

    for_s: float | None = Field(default=None, ge=0, description="how long the condition must hold before firing")
    severity: Severity | None = None
    enabled: bool = True


class AlertSettings(_Frozen):
    """The top-level ``alerts`` section: when and how loudly the controller alerts.

    It is not part of ``slo`` on purpose: ``slo`` holds what the service promises (targets
    agreed with its users), ``alerts`` holds the paging policy, which also covers fleet
    health that no SLO names (KV cache full, an instance down, a stale collector) -- the
    same split as SLO targets versus alerting rules in Prometheus. SLO rules take their
    thresholds from ``slo``; here they only get ``for`` durations, severities and switches.
    """

    resend_s: float = Field(default=60.0, gt=0, description="re-notify a firing alert this often")
    min_requests: int = Field(
        default=10, ge=1, description="fewer completed requests in the SLO window: SLO rules abstain"
    )
    kv_full: float = Field(default=0.95, gt=0, le=1, description="KVCacheNearlyFull fires above this usage")
    rules: dict[AlertRuleName, AlertRuleSettings] = Field(default_factory=dict)


STORE_DRIVERS = ("sqlite", "sqlite+pysqlite", "postgresql", "postgres", "postgresql+psycopg")


class StoreSettings(_Frozen):
    url: str = Field(default="sqlite:///pdscope.db",
                     description="SQLAlchemy URL: sqlite:///FILE or postgresql[+psycopg]://USER@HOST/DB")
    retention_raw_s: float = Field(default=6 * 3600.0, gt=0, description="raw snapshots and spans")
    retention_rollup_s: float = Field(default=30 * 86400.0, gt=0, description="per-minute rollups")

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
            raise ValueError(f"unsupported database {driver!r}; use sqlite:///FILE or postgresql://USER@HOST/DB "
                             "(driver psycopg)")
        return value


class ProbeSettings(_Frozen):
    """How an instance at the floor is tried again (a probe, not a ramp)."""

    after_s: float = Field(default=30.0, gt=0, le=3600,
                           description="at a lowered weight with too few requests to judge, probe after this long")
    weight: float = Field(default=0.1, gt=0, le=1, description="the most a probe raises a weight to")
    hold_s: float = Field(default=20.0, gt=0, le=3600,
                          description="a probe is judged within this long; healthy by then, it ramps normally")


class NoiseSettings(_Frozen):
    """What a cut needs to be evidence rather than noise (quiet when healthy)."""

    min_samples: int = Field(default=5, ge=1, le=10_000,
                             description="requests or NIXL transfers in the window before a latency score may cut")
    z: float = Field(default=2.0, ge=0, le=10,
                     description="margin in standard errors added to each tolerance (noise of small samples)")
    startup_s: float | None = Field(default=None, gt=0, le=3600,
                                    description="no latency/load/limit cuts until the store has watched the fleet "
                                                "this long: its warm-up and one window for it to leave the "
                                                "window (default: 2 x controller.window_s)")
    min_error_events: int = Field(default=3, ge=1, le=10_000,
                                  description="failures or attributed lease expiries in the window before errors "
                                              "score")
    queue_confirm_ticks: int = Field(default=2, ge=1, le=100,
                                     description="ticks in a row a P-queue pressure must hold before a limit cut")


class ControllerSettings(_Frozen):
    host: str = "127.0.0.1"
    port: int = Field(default=8300, ge=1, le=65535)
    interval_s: float = Field(default=2.0, gt=0)
    window_s: float = Field(default=30.0, gt=0, description="recent window each tick observes")
    mode: Literal["advisory", "enforce"] = "enforce"
    api_token_env: str = Field(default="PDSCOPE_API_TOKEN", min_length=1)
    api_tokens_env: str = Field(
        default="PDSCOPE_API_TOKENS", min_length=1,
        description="the NAME of an env variable holding name:token[,name:token...] (named API identities)",
    )
    trusted_span_senders: list[Annotated[str, Field(min_length=1, max_length=64)]] | None = Field(
        default=None,
        description="None: every stored request record counts; a list: only records whose sender "
                    "(OTLP token name) is in it feed the controller's observation",
    )
    max_body_bytes: int = Field(default=64 * 1024, ge=1024, le=16 * 2**20,
                                description="largest API request body; larger ones get 413")
    alert_webhook_url: str | None = None
    max_weight_step: float = Field(default=0.25, gt=0, le=1, description="max weight change per tick")
    min_weight: float = Field(
        default=0.02, ge=0, le=1,
        description="floor for an up, undrained instance (a trickle; recovery is probed, see README)",
    )
    kv_lease_s: float = Field(
        default=30.0, gt=0, le=3600,
        description="the fleet's KV lease (vLLM kv_connector_extra_config.kv_lease_duration, default 30 s): "
                    "an expired lease is joined with the handoffs still waiting a lease after P finished",
    )
    probe: ProbeSettings = ProbeSettings()
    noise: NoiseSettings = NoiseSettings()


class AdmissionDefaults(_Frozen):
    max_inflight_requests: int = Field(default=256, gt=0, description="per pool")
    max_inflight_kv_bytes: int = Field(default=64 * 2**30, gt=0, description="handoff KV bytes per pool")
    queue_timeout_s: float = Field(default=1.0, ge=0, description="bounded wait before a 429")
    retry_after_s: int = Field(default=1, ge=1)


class ProxyTimeouts(_Frozen):
    connect_s: float = Field(default=2.0, gt=0)
    prefill_s: float = Field(default=60.0, gt=0)
    decode_first_token_s: float = Field(default=60.0, gt=0)
    decode_total_s: float = Field(default=600.0, gt=0)


class OutlierSettings(_Frozen):
    """Outlier detection in the proxy (``proxy/outlier.py``): the one home of an instance's recent failures."""

    consecutive_failures: int = Field(default=5, ge=1, le=10_000, description="this many failures in a row eject")
    failure_ratio: float = Field(
        default=0.2, gt=0, le=1, description="failed share of the last window_s that ejects (with min_requests)",
    )
    min_requests: int = Field(default=20, ge=1, le=1_000_000, description="results in the window before the ratio counts")
    window_s: float = Field(default=10.0, gt=0, le=3600, description="window of the failure ratio")
    base_ejection_s: float = Field(default=5.0, gt=0, le=3600, description="first ejection; doubles per successive one")
    max_ejection_s: float = Field(default=60.0, gt=0, le=86400, description="cap on one ejection")
    max_ejected_share: float = Field(
        default=0.5, ge=0, le=1,
        description="share of a pool that may be ejected at once (at least one, never the last; 0: never eject)",
    )
    failure_penalty: float = Field(
        default=2.0, ge=0, le=10,
        description="exponent k: selection weighs an instance by (1 - recent failure ratio)^k (0: failures ignored)",
    )

    @model_validator(mode="after")
    def _ejection_bounds(self) -> OutlierSettings:
        if self.max_ejection_s < self.base_ejection_s:
            raise ValueError("max_ejection_s must be at least base_ejection_s")
        return self


class AdaptiveLimitSettings(_Frozen):
    """The proxy's local adaptive concurrency limit per pool (``proxy/concurrency.py``), AIMD on its own TTFT."""

    enabled: bool = True
    min_limit: int = Field(default=1, ge=1, le=1_000_000, description="floor of a pool's adaptive limit")
    increase: int = Field(default=2, ge=1, le=1_000_000, description="added per window comfortably under target")
    decrease_factor: float = Field(default=0.75, gt=0, lt=1, description="limit multiplied by this per window over target")
    window_s: float = Field(default=1.0, gt=0, le=600, description="one decision per window (once min_samples arrived)")
    min_samples: int = Field(default=10, ge=1, le=1_000_000, description="samples a decision needs")
    headroom: float = Field(
        default=0.8, gt=0, le=1, description="'comfortably under': the SLO percentile under headroom x target",
    )


class ProxySettings(_Frozen):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    controller_url: str | None = Field(default=None, description="defaults to the controller's host:port")
    routing_poll_s: float = Field(default=1.0, gt=0)
    fail_static_s: float = Field(default=60.0, ge=0, description="keep the last table this long")
    policy: Literal["weighted", "round-robin"] = "weighted"
    retry_budget: float = Field(default=0.2, ge=0, le=1, description="retries as a share of requests")
    outlier: OutlierSettings = OutlierSettings()
    adaptive_limit: AdaptiveLimitSettings = AdaptiveLimitSettings()
    admission: AdmissionDefaults = AdmissionDefaults()
    timeouts: ProxyTimeouts = ProxyTimeouts()
    otlp_endpoint: str | None = Field(default=None, description="defaults to the collector's receiver")
    otlp_token_env: str = Field(
        default="PDSCOPE_OTLP_TOKEN", min_length=1,
        description="env variable whose value the span exporter sends as Authorization: Bearer <value>",
    )
    tracing: bool = True
    span_queue_max: int = Field(
        default=32768, ge=1, le=2**22,
        description="spans held for export (a down collector costs nothing until this fills; then counted drops)",
    )
    span_retry_max_s: float = Field(
        default=5.0, gt=0, le=300, description="longest pause between tries of a failed span batch",
    )
    client_read_timeout_s: float = Field(
        default=30.0, gt=0, le=3600,
        description="time a client has to send a request's headers and body; then the connection is closed",
    )
    max_request_bytes: int = Field(default=32 * 2**20, gt=0, le=2**30, description="largest client body (413)")
    max_model_len: int | None = Field(
        default=None, gt=1,
        description="the model's context length; when set, max_tokens that cannot fit is a 400 before prefill",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_cooldown(cls, data: Any) -> Any:
        if isinstance(data, dict) and "failure_cooldown_s" in data:
            raise ValueError(
                "failure_cooldown_s was replaced by proxy.outlier (consecutive_failures, failure_ratio, "
                "base_ejection_s, ...): see the README's Proxy section"
            )
        return data


class CollectorSettings(_Frozen):
    host: str = "127.0.0.1"
    port: int = Field(default=4318, ge=1, le=65535, description="OTLP/HTTP receiver and /metrics")
    scrape_interval_s: float = Field(default=5.0, gt=0)
    scrape_timeout_s: float = Field(default=3.0, gt=0)
    max_body_bytes: int = Field(default=8 * 2**20, gt=0)
    prometheus_url: str | None = Field(default=None, description="read from Prometheus instead of scraping")
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
        description="name of the env variable holding sender:token[,sender:token...] for POST /v1/traces",
    )
    otlp_max_body_bytes: int = Field(default=16 * 2**20, gt=0, description="largest OTLP body as sent")
    otlp_max_inflated_bytes: int = Field(
        default=64 * 2**20, gt=0, description="largest OTLP body after gzip/deflate decompression"
    )
    otlp_inflight_bytes: int = Field(
        default=128 * 2**20, gt=0,
        description="OTLP bytes (as sent plus inflated) held by all requests at once; past it: 429",
    )
    otlp_retry_after_s: int = Field(default=1, ge=1, le=3600, description="Retry-After of a 429/503")
    span_queue_spans: int = Field(
        default=200_000, gt=0, description="spans waiting for the store; a full queue answers 503"
    )
    span_max_attributes: int = Field(default=128, gt=0, le=10_000, description="attribute keys kept per span")
    span_max_value_chars: int = Field(default=2048, gt=0, description="longest attribute string kept")
    span_max_attribute_chars: int = Field(
        default=32 * 1024, gt=0, description="all of a span's attributes together, serialised"
    )
    span_max_future_s: float = Field(
        default=300.0, ge=0, allow_inf_nan=False,
        description="spans starting further ahead of the collector's clock are refused",
    )

    @model_validator(mode="after")
    def _timeout_below_interval(self) -> CollectorSettings:
        if self.scrape_timeout_s >= self.scrape_interval_s:
            raise ValueError("scrape_timeout_s must be shorter than scrape_interval_s")
        if self.otlp_max_inflated_bytes < self.otlp_max_body_bytes:
            raise ValueError("otlp_max_inflated_bytes must be at least otlp_max_body_bytes")
        if self.otlp_inflight_bytes < self.otlp_max_body_bytes + self.otlp_max_inflated_bytes:
            raise ValueError("otlp_inflight_bytes must hold one largest request: otlp_max_body_bytes + otlp_max_inflated_bytes")
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
        if not (0 < len(name) <= MAX_TOKEN_NAME_CHARS
                and all(c.isascii() and (c.isalnum() or c in "-_.@") for c in name)):
            raise ValueError(f"{where}: name {name!r} must be 1-{MAX_TOKEN_NAME_CHARS} characters "
                             "of letters, digits, '-', '_', '.', '@'")
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
    host: str = "127.0.0.1"
    port: int = Field(default=8501, ge=1, le=65535)
    auth: Literal["login", "header", "none"] = Field(
        default="login",
        description="login: each user signs in with their own controller API token (checked with "
        "GET /v1/whoami) and changes are made with it; header: the identity comes from "
        "identity_header, set by a trusted auth proxy, and changes use the server's token with "
        "X-Actor; none: read-only (forms disabled). A non-loopback host needs login or header.",
    )
    identity_header: str | None = Field(
        default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9-]+$",
        description="request header carrying the user set by the auth proxy (auth: header), "
        "e.g. X-Forwarded-User; trusted only in header mode",
    )

    @model_validator(mode="after")
    def _header_mode_names_its_header(self) -> DashboardSettings:
        if self.auth == "header" and self.identity_header is None:
            raise ValueError("auth: header needs identity_header (e.g. X-Forwarded-User, set by your auth proxy)")
        return self


class Settings(_Frozen):
    """The whole file. Sections other than ``model`` and ``pools`` have defaults."""

    model: ModelSettings
    pools: dict[str, Pool]
    slo: SLOSettings = SLOSettings()
    alerts: AlertSettings = AlertSettings()
    store: StoreSettings = StoreSettings()
    controller: ControllerSettings = ControllerSettings()
    proxy: ProxySettings = ProxySettings()
    collector: CollectorSettings = CollectorSettings()
    dashboard: DashboardSettings = DashboardSettings()
    # Free-form here; the simulator validates its own section (simulator.config).
    simulator: dict[str, Any] = Field(default_factory=dict)

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
                    message = (f"duplicate instance name {inst.name!r} in pool {pool_name!r}: {where} at "
                               f"pools.{first_pool}.instances.{first_i}; instance names must be unique")
                    raise PydanticCustomError(
                        "duplicate_instance", "{message}",
                        {"message": message,
                         "loc": ("pools", pool_name, "instances", i, "name"),
                         "first": ("pools", first_pool, "instances", first_i, "name")},
                    )
                seen[inst.name] = (pool_name, i)
        return pools

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

    def api_token(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The controller API token, read from the variable named in the file."""
        env = os.environ if environ is None else environ
        token = env.get(self.controller.api_token_env)
        return token or None

    @property
    def controller_url(self) -> str:
        return self.proxy.controller_url or f"http://{self.controller.host}:{self.controller.port}"

    @property
    def collector_url(self) -> str:
        return f"http://{self.collector.host}:{self.collector.port}"


# -- loading --------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (PyYAML silently keeps the last)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    mapping: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in mapping:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
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
    elif "input" in err and not bad_key and "loc" not in ctx and err["type"] not in ("model_type", "dict_type", "list_type"):
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
        raise ConfigError([f"{source}: the file is {size} bytes; a config may be at most {MAX_CONFIG_BYTES} bytes"])
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        if _expanded_size_over(node, MAX_CONFIG_VALUES):
            raise ConfigError([f"{source}: more than {MAX_CONFIG_VALUES} values once YAML aliases (*name) are "
                               "expanded; refusing to read it (an alias bomb?)"])
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
