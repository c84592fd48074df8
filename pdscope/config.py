"""pdscope's one configuration file, ``pdscope.yaml``.

The file is read once, validated with pydantic and frozen; every service gets the
parts it needs passed down. Nothing else in pdscope reads the environment for
settings, except the API token, whose *variable name* is in the file.

An invalid file raises :class:`ConfigError`, whose ``problems`` are one line each,
naming the file, the line where YAML knows it, the dotted field and the reason.
"""

from __future__ import annotations

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

DEFAULT_CONFIG_ENV = "PDSCOPE_CONFIG"

Role = Literal["prefill", "decode"]


class ConfigError(Exception):
    """The configuration file is missing, unreadable or invalid.

    ``problems`` holds one human-readable line per problem; ``str()`` joins them.
    """

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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


class StoreSettings(_Frozen):
    url: str = "sqlite:///pdscope.db"
    retention_raw_s: float = Field(default=6 * 3600.0, gt=0, description="raw snapshots and spans")
    retention_rollup_s: float = Field(default=30 * 86400.0, gt=0, description="per-minute rollups")


class ControllerSettings(_Frozen):
    host: str = "127.0.0.1"
    port: int = Field(default=8300, ge=1, le=65535)
    interval_s: float = Field(default=2.0, gt=0)
    window_s: float = Field(default=30.0, gt=0, description="recent window each tick observes")
    mode: Literal["advisory", "enforce"] = "enforce"
    api_token_env: str = Field(default="PDSCOPE_API_TOKEN", min_length=1)
    alert_webhook_url: str | None = None
    max_weight_step: float = Field(default=0.25, gt=0, le=1, description="max weight change per tick")
    min_weight: float = Field(
        default=0.02, ge=0, le=1,
        description="floor for an up, undrained instance (a trickle; recovery is probed, see README)",
    )


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


class ProxySettings(_Frozen):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    controller_url: str | None = Field(default=None, description="defaults to the controller's host:port")
    routing_poll_s: float = Field(default=1.0, gt=0)
    fail_static_s: float = Field(default=60.0, ge=0, description="keep the last table this long")
    policy: Literal["weighted", "round-robin"] = "weighted"
    retry_budget: float = Field(default=0.2, ge=0, le=1, description="retries as a share of requests")
    failure_cooldown_s: float = Field(default=5.0, ge=0)
    admission: AdmissionDefaults = AdmissionDefaults()
    timeouts: ProxyTimeouts = ProxyTimeouts()
    otlp_endpoint: str | None = Field(default=None, description="defaults to the collector's receiver")
    tracing: bool = True


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

    @model_validator(mode="after")
    def _timeout_below_interval(self) -> CollectorSettings:
        if self.scrape_timeout_s >= self.scrape_interval_s:
            raise ValueError("scrape_timeout_s must be shorter than scrape_interval_s")
        return self


class DashboardSettings(_Frozen):
    host: str = "127.0.0.1"
    port: int = Field(default=8501, ge=1, le=65535)


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
        seen: dict[str, str] = {}
        for pool_name, pool in pools.items():
            for inst in pool.instances:
                if inst.name in seen:
                    raise ValueError(
                        f"instance name {inst.name!r} is in pools {seen[inst.name]!r} and {pool_name!r}; "
                        "instance names must be unique"
                    )
                seen[inst.name] = pool_name
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
    loc = tuple(err["loc"])
    bad_key = bool(loc) and loc[-1] == "[key]"
    if bad_key:  # a bad mapping key: name the key itself (its line), not pydantic's marker
        loc = loc[:-1]
    field = ".".join(str(p) for p in loc) or "(top level)"
    line = located.line_of(loc)
    where = f"{source}:{line}" if line else source
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if err["type"] == "extra_forbidden":
        msg = "unknown key (not a pdscope setting; check its spelling and indentation)"
    elif err["type"] == "missing":
        msg = "required field is missing"
    elif "input" in err and not bad_key and err["type"] not in ("model_type", "dict_type", "list_type"):
        shown = repr(err["input"])
        if len(shown) <= 60:
            msg = f"{msg} (got {shown})"
    return f"{where}: {field}: {msg}"


def parse_config(text: str, source: str = "<config>") -> Settings:
    """Parse and validate YAML text. Raises :class:`ConfigError` with one line per problem."""
    try:
        node = yaml.compose(text, Loader=_UniqueKeyLoader)
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([f"{where}: not valid YAML: {problem}"]) from exc
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
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{p}: cannot read: {exc.strerror or exc}"]) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{p}: not UTF-8 text: {exc.reason} at byte {exc.start}"]) from exc
    return parse_config(text, str(p))


def resolve_config_path(cli_value: str | None, environ: Mapping[str, str] | None = None) -> Path:
    """``--config`` wins, then ``$PDSCOPE_CONFIG``, then ``./pdscope.yaml``."""
    env = os.environ if environ is None else environ
    return Path(cli_value or env.get(DEFAULT_CONFIG_ENV) or "pdscope.yaml")
