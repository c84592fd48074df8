"""The tenants' fair queue as pure policy (``proxy.fairqueue``): order, no banked credit, bounds,
shedding for priority, charges and their correction, weights, Jain's index. The clock is a list."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from pdscope.config.tenants import TenantSettings
from pdscope.tenantcost import kv_token_steps
from proxy.fairqueue import (
    REASON_QUEUE_FULL,
    REASON_TENANT_QUEUE_FULL,
    FairQueue,
    Ticket,
    Work,
)


def _settings(**tenants: dict[str, Any]) -> TenantSettings:
    return TenantSettings.model_validate(
        {"enabled": True, "tenants": tenants or {"a": {}, "b": {}}, "cost_per_decode_token": 1.0}
    )


def _queue(max_waiters: int = 100, **tenants: dict[str, Any]) -> tuple[FairQueue, list[float]]:
    t = [0.0]
    return FairQueue(_settings(**tenants), max_waiters, lambda: t[0]), t


def _wait(q: FairQueue, tenant: str) -> Ticket:
    ticket = q.arrive(tenant)
    why, victim = q.enqueue(ticket)
    assert why is None and victim is None
    return ticket


def test_the_least_served_tenant_goes_first_and_an_arrival_does_not_overtake_it() -> None:
    q, _ = _queue()
    q.admitted("a", Work(1000))  # a is busy and has been served
    a1 = _wait(q, "a")
    b1 = _wait(q, "b")  # b arrives idle: lifted to a's counter, so a (earlier) first at a tie
    assert q.order() == [a1, b1]
    q.leave(a1)
    q.admitted("a", Work(500))  # a served again: b is now the least served
    a2 = _wait(q, "a")
    assert q.order()[0] is b1
    late_a = q.arrive("a")  # a new request of a must not try the pools before b's waiter
    assert q.ahead(late_a) and not q.ahead(b1)
    assert q.ahead(a2)


def test_a_higher_class_waiter_always_goes_first() -> None:
    q, _ = _queue(interactive={"priority": "interactive"}, batch={"priority": "batch"})
    q.admitted("interactive", Work(10_000))  # far more served than batch
    q.admitted("batch", Work(1))
    b = _wait(q, "batch")
    i = _wait(q, "interactive")
    assert q.order() == [i, b]
    assert q.ahead(b) and not q.ahead(i)


def test_a_tenant_back_from_idle_is_lifted_to_the_least_busy_counter() -> None:
    """No banked credit: without the lift, b (counter 0) would go first until it had caught up 900."""
    q, t = _queue(a={}, b={}, c={})
    q.admitted("b", Work(100))
    q.finished("b", Work(), None)  # b goes idle at 100
    t[0] = 2.0  # past the grace
    q.admitted("a", Work(1000))
    q.admitted("c", Work(700))  # a and c are busy
    _wait(q, "a")
    b = q.arrive("b")
    assert q.counter("b") == 700  # the least among the busy ones (c's), not a's, not its own
    assert q.counter("c") == 700  # others untouched
    assert not q.ahead(b)  # at the lifted counter it ranks before a's waiter (1000), as c would


def test_a_busy_tenant_is_not_lifted_and_none_busy_lifts_to_the_highest() -> None:
    q, t = _queue()
    q.admitted("a", Work(50))
    q.admitted("b", Work(500))
    q.arrive("a")  # a is busy (in flight): its counter stays
    assert q.counter("a") == 50
    q.finished("a", Work(), None)
    q.finished("b", Work(), None)
    q.arrive("a")  # between two requests (within the grace): not idle, its credit stays
    assert q.counter("a") == 50
    t[0] = 1.5
    q.arrive("a")  # idle, nobody busy: to the level of the most served
    assert q.counter("a") == 500


def test_a_flood_fills_its_own_queue_only() -> None:
    q, _ = _queue(max_waiters=10, a={"max_queued": 3}, b={})
    for _ in range(3):
        _wait(q, "a")
    assert q.enqueue(q.arrive("a")) == (REASON_TENANT_QUEUE_FULL, None)
    assert q.enqueue(q.arrive("b")) == (None, None)  # b's place is its own


def test_default_bounds_share_max_waiters_by_weight() -> None:
    q, _ = _queue(max_waiters=90, a={"weight": 2}, b={"weight": 1})
    # three tenants with default's weight 1: 90 x 2/4, 90 x 1/4
    assert (q.tenants["a"].bound, q.tenants["b"].bound, q.tenants["default"].bound) == (45, 22, 22)


def test_a_full_queue_sheds_the_lowest_class_for_a_higher_arrival() -> None:
    q, _ = _queue(
        max_waiters=3,
        i={"priority": "interactive", "max_queued": 3},
        x={"priority": "batch", "max_queued": 3},
        y={"priority": "batch", "max_queued": 3},
    )
    q.admitted("x", Work(10))
    q.admitted("y", Work(500))
    x1, y1, y2 = _wait(q, "x"), _wait(q, "y"), _wait(q, "y")
    # a batch arrival finds no lower class to shed: refused
    assert q.enqueue(q.arrive("x")) == (REASON_QUEUE_FULL, None)
    i1 = q.arrive("i")
    why, victim = q.enqueue(i1)
    assert why is None and victim is y2  # the most served batch tenant's latest request
    assert victim.shed and not victim.queued
    assert q.order() == [i1, x1, y1] and q.waiting == 3


def test_decode_charged_at_max_tokens_is_corrected_when_the_request_ends() -> None:
    q, _ = _queue(a={"weight": 2})
    work = Work(p_prefill=100, context=100, decode=300)  # 100 uncached prompt tokens, max_tokens 300
    q.admitted("a", work)
    m = q.costs.kv
    assert q.tenants["a"].p == pytest.approx(50)  # 100 / 2
    assert q.tenants["a"].d == pytest.approx((300 + m * (300 * 100 + 300 * 301 / 2)) / 2)
    q.finished("a", work, 20)  # it stopped after 20
    assert q.tenants["a"].p == pytest.approx(50)
    assert q.tenants["a"].d == pytest.approx((20 + m * (20 * 100 + 20 * 21 / 2)) / 2)
    assert q.inflight["a"] == 0


def test_kv_held_times_its_steps_is_charged_to_d() -> None:
    """Two requests of the same decode steps: the one holding a long context in D costs D more."""
    assert kv_token_steps(0, 1) == 1 and kv_token_steps(10, 2) == 2 * 10 + 3
    q, _ = _queue()
    short, long_ = Work(p_prefill=100, context=100, decode=64), Work(p_prefill=100, context=8000, decode=64)
    p_short, d_short = q.cost(short)
    p_long, d_long = q.cost(long_)
    assert p_short == p_long == 100
    assert d_long - d_short == pytest.approx(q.costs.kv * 64 * 7900)
    sent_to_d = Work(d_prefill=700, context=1000, decode=64)  # D alone computes the 700 it does not hold
    assert q.cost(sent_to_d) == (0.0, pytest.approx(700 + 64 + q.costs.kv * kv_token_steps(1000, 64)))


def _serve(q: FairQueue, rounds: int, cost: int) -> Counter[str]:
    """One slot: the first waiter is admitted each round; every tenant always has one waiting."""
    served: Counter[str] = Counter()
    for _ in range(rounds):
        first = q.order()[0]
        q.leave(first)
        q.admitted(first.tenant, Work(cost))
        q.finished(first.tenant, Work(), None)
        served[first.tenant] += 1
        _wait(q, first.tenant)
    return served


def test_backlogged_tenants_are_served_in_proportion_to_their_weights() -> None:
    q, _ = _queue(a={"weight": 3}, b={"weight": 1})
    _wait(q, "a")
    _wait(q, "b")
    served = _serve(q, 400, 50)
    assert served["a"] == 300 and served["b"] == 100
    assert q.jain() == pytest.approx(1.0, abs=0.01)  # weighted service is even


def test_the_controllers_scale_shrinks_a_weight_here() -> None:
    q, _ = _queue(a={"weight": 1}, b={"weight": 1})
    q.scale({"b": 1 / 3, "a": float("nan"), "ghost": 0.5})
    assert q.weight("a") == 1.0 and q.weight("b") == pytest.approx(1 / 3)
    _wait(q, "a")
    _wait(q, "b")
    served = _serve(q, 400, 10)
    assert served["a"] == 300 and served["b"] == 100
    q.scale({"b": 0.0})
    assert q.weight("b") == pytest.approx(0.01)  # never 0: a tenant here still gets some share


def test_jain_reads_one_tenant_served_of_two_backlogged_as_half() -> None:
    q, t = _queue()
    _wait(q, "a")
    _wait(q, "b")
    q.admitted("a", Work(100))
    assert q.jain() == pytest.approx(0.5)
    q.admitted("b", Work(100))
    assert q.jain() == pytest.approx(1.0)
    q.leave(q.order()[0])
    q.leave(q.order()[0])
    t[0] = 11.0  # nobody has waited within the window: nobody is backlogged
    assert q.jain() is None


def _reserved(**tenants: dict[str, Any]) -> tuple[FairQueue, list[float]]:
    t = [0.0]
    ts = TenantSettings.model_validate({"enabled": True, "tenants": tenants, "reserve": 0.3})
    return FairQueue(ts, 100, lambda: t[0], fleet_ttft_s=2.0), t


def test_a_tenant_alone_has_no_reserve_line() -> None:
    q, _ = _reserved(a={}, b={})
    q.admitted("a", Work(5000))
    assert q.reserve_line("a") is None  # b has never been busy: a may fill the whole budget


def test_a_lower_class_keeps_the_reserve_behind_the_tightest_busy_higher_target() -> None:
    q, t = _reserved(live={"slo": {"ttft_ms": 1500}}, batch={"priority": "batch"}, other={})
    q.admitted("batch", Work(100))
    assert q.reserve_line("batch") is None
    q.admitted("live", Work(10))  # interactive, its own 1.5 s target, busy
    assert q.reserve_line("batch") == pytest.approx(1.5 * 0.7)
    assert q.reserve_line("live") is None  # nobody of a higher class: interactive is never held back
    q.finished("live", Work(decode=10), 10)
    t[0] = 10.5  # idle for longer than SERVICE_TAU_S: batch has the whole budget again
    assert q.reserve_line("batch") is None


def test_a_tenant_served_past_its_share_keeps_the_reserve_for_its_peers() -> None:
    q, _ = _reserved(flood={}, calm={"weight": 1.0})
    q.admitted("flood", Work(9000))
    q.admitted("calm", Work(1000))
    assert q.reserve_line("flood") == pytest.approx(2.0 * 0.7)  # 90 % of the service, half its weight
    assert q.reserve_line("calm") is None  # within its share: the whole budget
    q.charge("calm", 9000)
    assert q.reserve_line("flood") is None  # 9,000 of 19,000: within its half


def test_the_line_keeps_the_reserve_of_the_tightest_target_within_its_share() -> None:
    """A flood with a lax target (the fleet's 2 s) beside a peer of 1 s: held to 0.7 of the peer's target,
    not of its own, or P's queue would be past what the peer can wait before the peer's request came."""
    q, _ = _reserved(flood={}, tight={"slo": {"ttft_ms": 1000}}, lax={"slo": {"ttft_ms": 8000}})
    q.admitted("flood", Work(9000))
    q.admitted("lax", Work(1000))
    assert q.reserve_line("flood") == pytest.approx(8.0 * 0.7)  # the one busy peer within its share
    q.admitted("tight", Work(1000))
    assert q.reserve_line("flood") == pytest.approx(1.0 * 0.7)
    q.admitted("tight", Work(20000))  # 21,000 of 31,000: past its share, and the flood within its own
    assert q.reserve_line("flood") is None
    assert q.reserve_line("tight") == pytest.approx(2.0 * 0.7)  # the flood's 2 s, the tighter of the two


def test_a_burst_within_its_share_gets_no_line_however_many_it_has_in_flight() -> None:
    """A tenant within its share that sends a few requests together holds most of what waits on P for a
    moment, while the one past its share is held back. It is not the one taking more."""
    q, _ = _reserved(flood={}, calm={})
    q.admitted("flood", Work(9000))
    for _ in range(8):
        q.admitted("calm", Work(200))
    assert q.reserve_line("calm") is None and not q.over_share("calm")
    assert q.reserve_line("flood") is not None and q.over_share("flood")


def test_a_waiter_held_by_its_own_line_does_not_hold_back_the_one_behind_it() -> None:
    """The flood's head ranks first (it came first, at the same counter) but waits for P's queues to drain
    below its tenant's reserve line: the calm tenant's request behind it may try the pools meanwhile."""
    q, _ = _reserved(flood={}, calm={})
    head = q.arrive("flood")
    q.enqueue(head)
    calm = q.arrive("calm")
    assert q.ahead(calm)  # the same counters: the older waiter first
    head.held = True
    assert not q.ahead(calm)
    head.held = False  # at its next try the line had let it go, and the pools were full
    assert q.ahead(calm)


def test_no_reserve_means_no_line() -> None:
    t = [0.0]
    ts = TenantSettings.model_validate(
        {"enabled": True, "tenants": {"a": {}, "b": {"priority": "batch"}}, "reserve": 0}
    )
    q = FairQueue(ts, 100, lambda: t[0], fleet_ttft_s=2.0)
    q.admitted("a", Work(1))
    q.admitted("b", Work(1))
    assert q.reserve_line("b") is None


def _serve_works(q: FairQueue, rounds: int, works: dict[str, Work], role: str) -> dict[str, list[float]]:
    """One slot of the pool of ``role``: it refuses the first waiter before each admission (the pool is
    full until a release); every tenant always has one waiting. Each tenant's P and D tokens served."""
    served = {name: [0.0, 0.0] for name in works}
    for name in works:
        _wait(q, name)
    for _ in range(rounds):
        q.blocked(role)
        first = q.order()[0]
        q.leave(first)
        q.admitted(first.tenant, works[first.tenant])
        q.finished(first.tenant, works[first.tenant], None)
        p, d = q.cost(works[first.tenant])
        served[first.tenant][0] += p
        served[first.tenant][1] += d
        _wait(q, first.tenant)
    return served


WORKS = {
    "rag": Work(p_prefill=4000, context=4000, decode=8),  # long prompts, short answers: heavy in P
    "writer": Work(p_prefill=200, context=200, decode=800),  # short prompts, long answers: heavy in D
}


@pytest.mark.parametrize(("role", "pool"), [("prefill", 0), ("decode", 1)])
def test_each_pool_is_shared_by_weight_in_its_own_tokens(role: str, pool: int) -> None:
    """Waiting for P, tenants go by P's counter (their prefill tokens); waiting for D, by D's. One counter
    of both (``P + D``) would hold the D-heavy tenant back from P by what it asked of D, and the other way
    round: the share each pool gives is then not its weight's."""
    q, _ = _queue(rag={"weight": 1}, writer={"weight": 1})
    served = _serve_works(q, 600, WORKS, role)
    ratio = served["rag"][pool] / served["writer"][pool]
    assert ratio == pytest.approx(1.0, rel=0.1)


def test_before_any_pool_refused_and_once_nobody_waits_the_order_is_by_the_sum() -> None:
    q, _ = _queue(rag={}, writer={})
    q.admitted("rag", WORKS["rag"])
    q.admitted("writer", WORKS["writer"])
    assert q.tight is None
    assert q.counter("rag") == pytest.approx(sum(q.cost(WORKS["rag"])))
    r = _wait(q, "rag")
    q.blocked("decode")
    assert q.counter("rag") == pytest.approx(q.cost(WORKS["rag"])[1])
    q.leave(r)  # the last waiter left: the pool it waited for is no longer known
    assert q.tight is None
