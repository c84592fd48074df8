"""analysis.tenants: each declared tenant's window against its own targets, its share against its
weight, Jain's index, and labels bounded by the config whatever the records say."""

from __future__ import annotations

import pytest

from analysis.tenants import (
    MAX_REASONS,
    OTHER,
    TenantFacts,
    TenantTally,
    jain_index,
    max_min_allocation,
    tenant_slo,
    tenant_window,
    terms_of,
)
from pdscope.config import LatencySLO, Settings, SLOSettings, Tenant, TenantSettings, TenantSLO
from pdscope.tenantcost import Costs


def _settings() -> Settings:
    return Settings.model_construct(
        slo=SLOSettings(ttft=LatencySLO(target_ms=2000), tpot=LatencySLO(target_ms=100)),
        tenants=TenantSettings(
            enabled=True,
            tenants={"a": Tenant(weight=2.0, slo=TenantSLO(ttft_ms=500)), "b": Tenant(), "c": Tenant()},
        ),
    )


def _ok(tenant: str | None, ttft: float = 0.3, tokens: tuple[int, int] = (100, 10)) -> TenantFacts:
    return TenantFacts(tenant, "ok", None, 0.0, 0.1, ttft, 0.02, *tokens)


def _rejected(tenant: str, reason: str | None) -> TenantFacts:
    return TenantFacts(tenant, "rejected", reason, 0.0, None, None, None, None, None)


def test_a_tenant_is_held_to_its_own_target_and_others_to_the_fleets() -> None:
    s = _settings()
    a_slo = tenant_slo(s.tenants, s.slo, "a")
    assert a_slo.ttft.target_ms == 500 and a_slo.tpot.target_ms == 100
    assert tenant_slo(s.tenants, s.slo, "b") == s.slo and tenant_slo(s.tenants, s.slo, "nobody") == s.slo
    w = tenant_window(
        [_ok("a", 0.8), _ok("a", 0.3), _ok("b", 0.8)], terms_of(s.tenants, s.slo), since=0, until=10
    )
    a, b = w.of("a"), w.of("b")
    assert a is not None and b is not None
    assert (a.served, a.met, a.attainment) == (2, 1, 0.5)
    assert (b.served, b.met, b.attainment) == (1, 1, 1.0)
    assert a.goodput_tokens == 110 and a.goodput_tokens_per_s == pytest.approx(11.0)
    assert a.queued_p50_s == pytest.approx(0.1) and a.waited == 2


def test_shares_and_jains_index_count_only_the_tenants_with_demand() -> None:
    s = _settings()
    # a (weight 2) got twice b's service: exactly by weight; c asked nothing
    facts = [_ok("a"), _ok("a"), _ok("b")]
    w = tenant_window(facts, terms_of(s.tenants, s.slo), since=0, until=10)
    assert w.jain == pytest.approx(1.0)
    a, b, c = (w.of(n) for n in "abc")
    assert a and b and c
    assert a.fair_share == pytest.approx(2 / 3) and b.fair_share == pytest.approx(1 / 3)
    assert c.fair_share is None and c.service_share == 0.0
    assert a.service_share == pytest.approx(2 / 3)
    # b starved by a: b asked, was refused, got nothing
    w = tenant_window([_ok("a"), _rejected("b", "queue_full")], terms_of(s.tenants, s.slo), since=0, until=10)
    b2 = w.of("b")
    assert b2 is not None and b2.starved and b2.rejected == {"queue_full": 1}
    assert w.jain == pytest.approx(0.5)  # one of two tenants with demand got everything


def test_decode_tokens_cost_what_the_config_says_in_the_service() -> None:
    s = _settings()
    terms = terms_of(s.tenants, s.slo)
    w = tenant_window([_ok("b", tokens=(100, 10))], terms, since=0, until=1, costs=Costs(decode=4.0, kv=0.0))
    b = w.of("b")
    assert b is not None and b.service == pytest.approx(140.0) and b.goodput_tokens == 110
    # the KV held: 100 tokens of context for 10 steps, one more after each (1,055 token-steps)
    w = tenant_window([_ok("b", tokens=(100, 10))], terms, since=0, until=1, costs=Costs(decode=1.0, kv=0.5))
    b = w.of("b")
    assert b is not None and b.service == pytest.approx(100 + 10 + 0.5 * (100 * 10 + 55))


def test_jain_index() -> None:
    assert jain_index([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain_index([]) is None and jain_index([0.0, 0.0]) is None


def test_the_labels_are_the_configs_whatever_the_records_say() -> None:
    s = _settings()
    facts = [_ok(None), _ok("default"), _ok("gone-tenant"), _ok("a")]
    w = tenant_window(facts, terms_of(s.tenants, s.slo), since=0, until=10)
    assert [t.tenant for t in w.tenants] == ["default", "a", "b", "c"]
    d = w.of("default")
    assert d is not None and d.requests == 3 and w.undeclared == 1


def test_reject_reasons_are_words_and_bounded_the_most_common_by_name() -> None:
    s = _settings()
    odd = ["queue_full", "tenant_rate", "x" * 300, "Bad Reason\n", None, "tenant_rate", "queue_full"]
    many = [f"reason_{i}" for i in range(40)]
    facts = [_rejected("b", r) for r in odd + many]
    w = tenant_window(facts, terms_of(s.tenants, s.slo), since=0, until=10)
    b = w.of("b")
    assert b is not None and b.rejected_total == len(odd) + len(many)
    assert len(b.rejected) == MAX_REASONS and b.rejected[OTHER] == 3 + 40 - (MAX_REASONS - 3)
    assert b.rejected["queue_full"] == 2 and b.rejected["tenant_rate"] == 2
    assert b.rejected["reason_0"] == 1 and "reason_9" not in b.rejected  # ties: by name
    # whatever order the records come in (a kept tally adds and retires them in any order)
    assert tenant_window(facts[::-1], terms_of(s.tenants, s.slo), since=0, until=10) == w
    assert not b.starved or b.served == 0


def test_fair_allocation_is_weighted_max_min() -> None:
    # 90 to share, weights 2:1:1; c asked 10 (all of it), a and b share the other 80 by weight
    got = max_min_allocation(90.0, {"a": (2.0, 100.0), "b": (1.0, 100.0), "c": (1.0, 10.0)})
    assert got == pytest.approx({"a": 160 / 3, "b": 80 / 3, "c": 10.0})
    # everybody asked less than there is: each gets what it asked
    assert max_min_allocation(50.0, {"a": (2.0, 10.0), "b": (1.0, 20.0)}) == {"a": 10.0, "b": 20.0}
    assert max_min_allocation(0.0, {"a": (1.0, 5.0)}) == {"a": 0.0}


def test_jain_reads_one_when_each_tenant_got_all_it_asked_whatever_the_weights() -> None:
    """At low load a tenant of weight 2 served as much as one of weight 1 is no unfairness: each got all
    it asked (by weight alone the index read 0.90)."""
    s = _settings()
    w = tenant_window([_ok("a"), _ok("b")], terms_of(s.tenants, s.slo), since=0, until=10)
    assert w.jain == pytest.approx(1.0)
    # backlogged (b refused twice while a was served twice, weights 2:1): a got its 2/3, b its 1/3
    facts = [_ok("a"), _ok("a"), _ok("b"), _rejected("b", "queue_full"), _rejected("b", "queue_full")]
    w = tenant_window(facts, terms_of(s.tenants, s.slo), since=0, until=10)
    # service 330 shared 2:1: fair 220 / 110; got 220 / 110
    assert w.jain == pytest.approx(1.0)
    facts = [_ok("a"), _ok("a"), _ok("a"), _rejected("b", "queue_full"), _rejected("b", "queue_full")]
    w = tenant_window(facts, terms_of(s.tenants, s.slo), since=0, until=10)
    assert w.jain is not None and w.jain < 0.6  # b asked and got nothing of its third


def test_a_record_with_a_non_finite_latency_counts_but_has_no_rank() -> None:
    s = _settings()
    terms = terms_of(s.tenants, s.slo)
    odd = [_ok("b", ttft=float("nan")), _ok("b", ttft=float("inf")), _ok("b", ttft=0.4)]
    w = tenant_window(odd, terms, since=0, until=10)
    b = w.of("b")
    assert b is not None and b.served == 3 and b.ttft_at_slo_s == 0.4  # only the finite TTFT is ranked
    kept = TenantTally(terms)  # and a kept tally takes them back as it added them
    for r in odd:
        kept.add(r)
    kept.remove(odd[0])
    assert kept.window(0, 10) == tenant_window(odd[1:], terms, since=0, until=10)
