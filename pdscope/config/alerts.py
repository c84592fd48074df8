"""The ``alerts`` section and the one list of the controller's alert rule names."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from pdscope.config.base import PositiveFloat, PositiveFraction, _Frozen

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
    "StrandedKV",
    "IncompatiblePair",
    "HandoffP99OverBudget",
    "CollectorBehind",
    "TTFTMispredicted",
    "TenantSLOBreach",
    "TenantStarved",
)

Severity = Literal["info", "warning", "critical"]


def _known_rule(name: str) -> str:
    if name not in ALERT_RULE_NAMES:
        raise ValueError(f"unknown alert rule {name!r}; known rules: {', '.join(ALERT_RULE_NAMES)}")
    return name


AlertRuleName = Annotated[str, AfterValidator(_known_rule)]


class AlertRuleSettings(_Frozen):
    """Overrides for one built-in rule; an unset field keeps the rule's default."""

    for_s: float | None = Field(default=None, ge=0)
    """seconds the condition must hold before the alert fires (pending until then); default: the rule's own"""
    severity: Severity | None = None
    """severity label sent with the alert; default: the rule's own"""
    enabled: bool = True
    """false: the rule resolves the alerts it had and raises no new ones"""


class AlertSettings(_Frozen):
    """The top-level ``alerts`` section: when and how loudly the controller alerts.

    It is not part of ``slo`` on purpose: ``slo`` holds what the service promises (targets
    agreed with its users), ``alerts`` holds the paging policy, which also covers fleet
    health that no SLO names (KV cache full, an instance down, a stale collector) -- the
    same split as SLO targets versus alerting rules in Prometheus. SLO rules take their
    thresholds from ``slo``; here they only get ``for`` durations, severities and switches.
    """

    resend_s: PositiveFloat = 60.0
    """a firing alert is POSTed to the webhook again this often"""
    min_requests: int = Field(default=10, ge=1)
    """fewer completed requests than this in slo.window_s: the SLO rules hold their state instead of judging
    """
    kv_full: PositiveFraction = 0.95
    """KVCacheNearlyFull fires when an instance's KV usage (0-1) is above this"""
    mispredicted_error: PositiveFloat = Field(default=0.3, le=100.0)
    """TTFTMispredicted fires when the median |observed / predicted - 1| of the TTFT predictions in
    slo.window_s is over this (the fleet changed under the proxy's predictor)"""
    mispredicted_min_records: int = Field(default=50, ge=1, le=1_000_000)
    """fewer records with a TTFT prediction and an observed TTFT than this in slo.window_s: TTFTMispredicted
    holds its state instead of judging"""
    stranded_kv_usage: float = Field(default=0.0, ge=0.0, lt=1.0)
    """StrandedKV fires when an idle P (nothing running or waiting) holds more KV than this (0-1) while no D
    waits to pull: vLLM's usage counts leased blocks and is 0 on an idle instance with nothing leased"""
    rules: dict[AlertRuleName, AlertRuleSettings] = Field(default_factory=dict)
    """per built-in rule (by name, e.g. TTFTOverTarget): for_s, severity, enabled; an unknown rule name is an
    error"""
