"""Each tenant's rate limit and token quota (``proxy.tenantlimits``), on a clock the test moves."""

from __future__ import annotations

import pytest

from pdscope.config.tenants import TenantSettings
from proxy.tenantlimits import REASON_TENANT_QUOTA, REASON_TENANT_RATE, Refusal, TenantLimits


def _limits(**tenants: dict[str, object]) -> tuple[TenantLimits, list[float]]:
    t = [100.0]
    ts = TenantSettings.model_validate({"enabled": True, "tenants": tenants})
    return TenantLimits(ts, lambda: t[0]), t


def test_the_rate_allows_its_burst_then_says_when_to_come_back() -> None:
    lim, t = _limits(a={"rate_rps": 2, "burst": 3}, b={})
    assert [lim.check("a", 10) for _ in range(3)] == [None, None, None]
    assert lim.check("a", 10) == Refusal(REASON_TENANT_RATE, 0.5)
    assert all(lim.check("b", 10) is None for _ in range(50))  # b has no limit; a's is a's
    t[0] += 0.5
    assert lim.check("a", 10) is None


def test_the_burst_defaults_to_one_second_of_the_rate() -> None:
    lim, _ = _limits(a={"rate_rps": 0.5})
    assert lim.check("a", 1) is None
    refusal = lim.check("a", 1)
    assert refusal is not None and refusal.retry_after_s == pytest.approx(2.0)


def test_the_quota_counts_tokens_per_minute() -> None:
    lim, t = _limits(a={"tokens_per_min": 600})
    assert lim.check("a", 500) is None
    assert lim.check("a", 200) == Refusal(REASON_TENANT_QUOTA, 10.0)  # 100 left: 100 more in 10 s
    t[0] += 10
    assert lim.check("a", 200) is None


def test_a_request_over_a_whole_minutes_quota_comes_back_in_a_minute() -> None:
    lim, _ = _limits(a={"tokens_per_min": 100})
    assert lim.check("a", 101) == Refusal(REASON_TENANT_QUOTA, 60.0)


def test_a_refusal_by_the_quota_takes_nothing_from_the_rate() -> None:
    lim, _ = _limits(a={"rate_rps": 1, "burst": 1, "tokens_per_min": 60})
    assert lim.check("a", 100) is not None  # over the quota
    assert lim.check("a", 10) is None  # the rate's one request is still there
