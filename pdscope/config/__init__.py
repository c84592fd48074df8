"""pdscope's one configuration file, ``pdscope.yaml``.

The file is read once, validated with pydantic and frozen; every service gets the
parts it needs passed down. Nothing else in pdscope reads the environment for
settings, except the API token, whose *variable name* is in the file.

An invalid file raises :class:`ConfigError`, whose ``problems`` are one line each,
naming the file, the line where YAML knows it, the dotted field and the reason.

One module per section of the file, on a shared base; import from here, not from them:

- ``base``: :class:`ConfigError`, the frozen base model, the bounded types the fields share;
- ``model``, ``pools``, ``slo``, ``alerts``, ``store``, ``controller`` (with ``bundles`` and
  ``httpserver``), ``proxy`` (with ``kvaware``), ``collector``, ``dashboard``, ``tenants``: the sections
  (``simulator:`` is ``pdscope.simconfig``);
- ``access``: named-token variables and loopback hosts, which the sections' lookups use;
- ``settings``: :class:`Settings`, the whole file and the checks across sections;
- ``load``: reading a file (bounded YAML, one line per problem): :func:`parse_config`,
  :func:`load_config`, :func:`load_settings`.

Part of the kernel: it imports no service and no store.
"""

from __future__ import annotations

from pdscope.config.access import (
    MAX_TOKEN_NAME_CHARS,
    MIN_PROXY_SECRET_CHARS,
    is_loopback,
    parse_named_tokens,
)
from pdscope.config.alerts import (
    ALERT_RULE_NAMES,
    AlertRuleName,
    AlertRuleSettings,
    AlertSettings,
    Severity,
)
from pdscope.config.base import ConfigError, validated
from pdscope.config.bundles import BUNDLE_RULES_DEFAULT, BundleSettings
from pdscope.config.collector import CollectorSettings
from pdscope.config.controller import ControllerSettings, NoiseSettings, ProbeSettings
from pdscope.config.dashboard import DashboardSettings
from pdscope.config.httpserver import AuthThrottleSettings
from pdscope.config.kvaware import DecodeOnlySettings, KvAwareSettings
from pdscope.config.load import (
    DEFAULT_CONFIG_ENV,
    MAX_CONFIG_BYTES,
    MAX_CONFIG_VALUES,
    load_config,
    load_settings,
    parse_config,
    resolve_config_path,
)
from pdscope.config.model import ModelSettings
from pdscope.config.pools import Instance, Pool
from pdscope.config.proxy import (
    AdaptiveLimitSettings,
    AdmissionDefaults,
    OutlierSettings,
    PredictSettings,
    ProxySettings,
    ProxyTimeouts,
)
from pdscope.config.settings import Settings
from pdscope.config.slo import LatencySLO, SLOSettings
from pdscope.config.store import STORE_DRIVERS, StoreSettings
from pdscope.config.tenants import DEFAULT_TENANT, TENANT_ID, Tenant, TenantSettings, TenantSLO
from pdscope.routing import Role

__all__ = [
    "ALERT_RULE_NAMES",
    "BUNDLE_RULES_DEFAULT",
    "DEFAULT_CONFIG_ENV",
    "DEFAULT_TENANT",
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_VALUES",
    "MAX_TOKEN_NAME_CHARS",
    "MIN_PROXY_SECRET_CHARS",
    "STORE_DRIVERS",
    "TENANT_ID",
    "AdaptiveLimitSettings",
    "AdmissionDefaults",
    "AlertRuleName",
    "AlertRuleSettings",
    "AlertSettings",
    "AuthThrottleSettings",
    "BundleSettings",
    "CollectorSettings",
    "ConfigError",
    "ControllerSettings",
    "DashboardSettings",
    "DecodeOnlySettings",
    "Instance",
    "KvAwareSettings",
    "LatencySLO",
    "ModelSettings",
    "NoiseSettings",
    "OutlierSettings",
    "Pool",
    "PredictSettings",
    "ProbeSettings",
    "ProxySettings",
    "ProxyTimeouts",
    "Role",
    "SLOSettings",
    "Settings",
    "Severity",
    "StoreSettings",
    "Tenant",
    "TenantSLO",
    "TenantSettings",
    "is_loopback",
    "load_config",
    "load_settings",
    "parse_config",
    "parse_named_tokens",
    "resolve_config_path",
    "validated",
]
