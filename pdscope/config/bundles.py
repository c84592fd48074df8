"""``controller.bundles``: incident bundles, an archive of the window before an alert."""

from __future__ import annotations

from pydantic import Field, field_validator

from pdscope.config.alerts import ALERT_RULE_NAMES, AlertRuleName
from pdscope.config.base import Count1M, Count100k, DaySeconds, _Frozen

BUNDLE_RULES_DEFAULT: tuple[str, ...] = tuple(r for r in ALERT_RULE_NAMES if r != "CollectorBehind")


class BundleSettings(_Frozen):
    """Incident bundles: one archive of the window before an alert fired (docs/alerts.md)."""

    enabled: bool = False
    """write a bundle when one of the rules below starts firing (pdscope bundle writes one on demand either
    way)"""
    dir: str = Field(default="pdscope-bundles", min_length=1, max_length=1024)
    """directory the bundles are written to (created if missing); also pdscope bundle's default --out"""
    window_s: DaySeconds = 900.0
    """seconds of stored data before the alert fired that a bundle holds"""
    rules: list[AlertRuleName] = Field(default_factory=lambda: list(BUNDLE_RULES_DEFAULT))
    """the alert rules whose firing writes a bundle: the SLO and P/D-health rules (every rule but
    CollectorBehind, whose window has no fresh data)"""
    max_records: Count1M = 20_000
    """most rows of each table (request records, snapshots, decisions) in a bundle; over it, every k-th row is
    kept and the manifest says so"""
    max_bytes: int = Field(default=64 * 2**20, ge=2**20, le=2**31)
    """most bytes of a bundle's uncompressed content; over it, each table keeps its newest rows that fit and
    the manifest says so"""
    keep: Count100k = 50
    """the newest automatic bundles kept in dir; older ones are deleted"""
    queue_max: int = Field(default=8, ge=1, le=1024)
    """bundles waiting to be written at most; when full the oldest waiting is dropped (and counted)"""

    @field_validator("rules")
    @classmethod
    def _unique_rules(cls, rules: list[str]) -> list[str]:
        dup = sorted({r for r in rules if rules.count(r) > 1})
        if dup:
            raise ValueError(f"rule(s) listed twice: {', '.join(dup)}")
        return rules
