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


def test_three_proxies_sharing_a_tenant_hold_it_to_its_whole_rate_together() -> None:
    """Each proxy's bucket is the tenant's rate times its share of the tenant's demand: three proxies
    with a third each admit, over 10 s, what one proxy with the whole figure would (without the scale,
    three times it)."""
    admitted = []
    for scale in ({}, {"a": 1 / 3}):
        proxies = [_limits(a={"rate_rps": 9, "burst": 9}) for _ in range(3)]
        for lim, _ in proxies:
            lim.scale(scale)
        n = 0
        for step in range(100):  # 10 s of a flood, 30 requests a second through each proxy
            for lim, t in proxies:
                t[0] = 100.0 + step / 10
                n += sum(lim.check("a", 1) is None for _ in range(3))
        admitted.append(n)
    assert admitted[0] == pytest.approx(3 * (9 + 9 * 9.9), abs=3)  # each its whole burst and rate
    assert admitted[1] == pytest.approx(9 + 9 * 9.9, abs=3)  # the three together: one's figure


def test_a_small_share_still_passes_a_large_request_when_its_bucket_is_full() -> None:
    lim, t = _limits(a={"tokens_per_min": 6000})
    lim.scale({"a": 0.01})  # 60 tokens a minute here, 1 a second
    assert lim.check("a", 600) is None  # over the scaled bucket, within the tenant's quota: goes, in debt
    refusal = lim.check("a", 10)
    assert refusal is not None and refusal.reason == REASON_TENANT_QUOTA and refusal.retry_after_s > 60
    assert lim.check("a", 6001) == Refusal(REASON_TENANT_QUOTA, 60.0)  # over the whole quota: never
    lim.scale({})  # the controller is gone: the whole figure again, the debt carried
    t[0] += 60
    assert lim.check("a", 10) is None


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_a_scale_that_is_not_a_share_is_ignored(bad: float) -> None:
    lim, _ = _limits(a={"rate_rps": 2, "burst": 2})
    lim.scale({"a": bad})
    assert [lim.check("a", 1) for _ in range(2)] == [None, None]
