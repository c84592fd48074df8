"""A tenant's share held across three proxies (``controller.proxies``, ``proxy.fairqueue``).

Tenant a sends all its requests through proxy p1; tenant b, as many, spread over p1, p2 and p3.
Equal weights: each should have half of the pools. The controller splits each pool among the
proxies by their demand (p1 gets two thirds) and answers each proxy with its fraction of each
tenant's demand (p1: a 1, b 1/3); the proxies' fair queues scale the weights by it. Served by the
real fair queue on each proxy, a and b then get half each; without the scales, b would get two
thirds (it has p2 and p3 to itself and half of p1). Reports with undeclared tenants are dropped
and counted. The registry runs in-process on SQLite.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from sqlalchemy.orm import Session, sessionmaker

from controller.proxies import ProxyRegistry
from pdscope import routing
from pdscope.config import Settings, parse_config, tenants
from pdscope.routing import ProxyReport, ProxyShare, RoutingTable
from proxy.fairqueue import FairQueue, Work
from store.db import opened
from store.migrate import upgrade

LIMIT = 60


def _settings() -> Settings:
    doc = {
        "model": {"name": "m", "kv_bytes_per_token": 1000},
        "pools": {
            "prefill": {"role": "prefill", "instances": [{"name": "p0", "url": "http://p0:8000"}]},
            "decode": {"role": "decode", "instances": [{"name": "d0", "url": "http://d0:8000"}]},
        },
        "proxy": {"expected_replicas": 3, "admission": {"max_inflight_requests": LIMIT}},
        "controller": {"proxy_share_floor": 0.0, "proxy_ttl_s": 30},
        "tenants": {"enabled": True, "tenants": {"a": {}, "b": {}}},
    }
    return parse_config(yaml.safe_dump(doc), "<test>")


@pytest.fixture
def factory(tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade(url)
    with opened(url) as f:
        yield f


TABLE = RoutingTable(version=1, generated_at=0.0, mode="enforce", enforce=True, instances=[], pools=[])
# requests per second of each tenant through each proxy
RATES = {"p1": {"a": 30, "b": 10}, "p2": {"b": 10}, "p3": {"b": 10}}


def _poll_for(registry: ProxyRegistry, clock: list[float], seconds: int) -> dict[str, ProxyShare]:
    """Each proxy polls once a second for ``seconds``, its counters growing at RATES; the last parts."""
    shares: dict[str, ProxyShare] = {}
    for s in range(1, seconds + 1):
        clock[0] = float(s)
        for pid, rates in RATES.items():
            total = sum(rates.values()) * s
            by_tenant = {t: n * s for t, n in rates.items()}
            report = ProxyReport(pid, "b0", 0.0, 1, {"prefill": total, "decode": total}, {}, by_tenant)
            answer = registry.poll(report, TABLE)
            assert answer.share is not None
            shares[pid] = answer.share
    return shares


def _served(share: ProxyShare, scaled: bool) -> Counter[str]:
    """The slots of the prefill pool this proxy's fair queue gives each tenant asking through it, with
    both always backlogged: 600 admissions of equal cost, in proportion."""
    clock = [0.0]
    q = FairQueue(_settings().tenants, 1000, lambda: clock[0])
    if scaled:
        q.scale(share.tenants)
    asking = list(RATES[share.id])
    for t in asking:
        q.enqueue(q.arrive(t))
    served: Counter[str] = Counter()
    for _ in range(600):
        first = q.order()[0]
        q.leave(first)
        q.admitted(first.tenant, Work(p_prefill=10))
        q.finished(first.tenant, Work(p_prefill=10), None)
        served[first.tenant] += 1
        q.enqueue(q.arrive(first.tenant))
    part = share.pools["prefill"].max_inflight_requests
    return Counter({t: part * n / 600 for t, n in served.items()})


def test_a_tenants_share_holds_across_three_proxies(factory: sessionmaker[Session]) -> None:
    clock = [0.0]
    registry = ProxyRegistry(factory, _settings(), me="c0", clock=lambda: clock[0])
    shares = _poll_for(registry, clock, 150)  # five smoothing windows
    assert abs(shares["p1"].pools["prefill"].max_inflight_requests - 40) <= 2  # two thirds of the demand
    assert shares["p1"].tenants == pytest.approx({"a": 1.0, "b": 1 / 3}, abs=0.01)
    assert shares["p2"].tenants == pytest.approx({"a": 0.0, "b": 1 / 3}, abs=0.01)
    listed = {v.id: v for v in registry.listing()}
    assert listed["p1"].tenant_demand_per_s == pytest.approx({"a": 30.0, "b": 10.0, "default": 0.0}, abs=0.5)
    assert set(listed["p1"].demand_per_s) == {"prefill", "decode"}
    fair = sum((_served(s, scaled=True) for s in shares.values()), Counter())
    unfair = sum((_served(s, scaled=False) for s in shares.values()), Counter())
    assert fair["a"] == pytest.approx(LIMIT / 2, rel=0.05) and fair["b"] == pytest.approx(LIMIT / 2, rel=0.05)
    assert unfair["b"] == pytest.approx(2 * LIMIT / 3, rel=0.05)  # what the scales correct


def test_undeclared_tenants_in_a_report_are_dropped_and_counted(factory: sessionmaker[Session]) -> None:
    clock = [1.0]
    registry = ProxyRegistry(factory, _settings(), me="c0", clock=lambda: clock[0])
    report = ProxyReport("p1", "b0", 0.0, 1, {"prefill": 5}, {}, {"a": 5, "ghost": 7, "other": 1})
    answer = registry.poll(report, TABLE)
    assert answer.share is not None and set(answer.share.tenants) <= {"a", "b"}
    assert registry.clipped["tenant"] == 2


def test_the_reports_tenant_id_is_the_configs() -> None:
    assert routing.TENANT_ID.pattern == tenants.TENANT_ID.pattern
    assert routing.MAX_TENANTS == tenants.MAX_TENANTS


def test_a_report_of_tenants_reads_back_as_sent_and_is_bounded() -> None:
    report = ProxyReport("p1", "b0", 1.0, 1, {}, {}, {"a": 3, "b.c@d": 4})
    assert ProxyReport.from_params(report.params()) == report
    with pytest.raises(ValueError, match="tenants"):
        ProxyReport.from_params({**report.params(), "tenants": "a\n:3"})
    with pytest.raises(ValueError, match="more than 64"):
        ProxyReport.from_params({**report.params(), "tenants": ",".join(f"t{i}:1" for i in range(65))})
    with pytest.raises(ValueError, match="characters"):
        ProxyReport.from_params({**report.params(), "tenants": "a:1" + "," * 10_000})
