"""The evidence rules as pure functions: what a window's raw figures say, and about whom."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from controller.policy import evidence as ev
from controller.policy.charges import RecordFacts
from controller.policy.config import EVIDENCE_ONLY, EvidenceConfig, PolicyConfig
from controller.policy.signals import InstanceSignals

CFG = PolicyConfig.defaults().evidence


@dataclass(frozen=True)
class Scrapes:
    """A stand-in for the store's per-instance figures (ev.ScrapeFigures is a protocol)."""

    increases: dict[str, float] = field(default_factory=dict)
    seconds: float | None = None
    up: bool = True
    last_ts: float = 0.0
    kv_cache_usage: float | None = None
    num_running: float | None = None
    num_waiting: float | None = None
    mean_ttft_s: float | None = None
    mean_nixl_xfer_s: float | None = None
    failed_transfers_per_min: float | None = None
    expired_leases_per_min: float | None = None


def record(**kw: object) -> RecordFacts:
    base: dict[str, object] = dict.fromkeys(RecordFacts._fields)
    base.update(
        status="ok",
        p_instance="p0",
        d_instance="d0",
        p_pool="P",
        d_pool="D",
        proxy_in=0.0,
        p_sent=0.1,
        p_done=0.5,
        d_sent=0.5,
        first_token=0.7,
        done=1.0,
        ttft_s=0.7,
    )
    base.update(kw)
    return RecordFacts(**base)  # type: ignore[arg-type]


def test_hold_time_is_littles_law_on_the_gauges() -> None:
    def done(n: float, key: str = "ttft_count", seconds: float | None = None) -> Scrapes:
        return Scrapes(increases={key: n}, seconds=seconds)

    assert ev.hold_time(6.0, done(12.0), "prefill", 3.0) == pytest.approx(1.5)  # 6 held / 4 per s
    assert ev.hold_time(6.0, done(12.0, seconds=2.0), "prefill", 3.0) == pytest.approx(
        1.0
    )  # the span scraped
    assert ev.hold_time(4.0, done(2.0, "nixl_xfer_time_count"), "decode", 3.0) == pytest.approx(6.0)
    # push mode: P records the transfers; a D's finished handoffs are its first tokens
    both = Scrapes(increases={"ttft_count": 4.0, "nixl_xfer_time_count": 0.0})
    assert ev.hold_time(4.0, both, "decode", 3.0, "push") == pytest.approx(3.0)
    assert ev.hold_time(4.0, both, "decode", 3.0) == pytest.approx(24.0)  # pull: no pull done counts half
    assert ev.hold_time(3.0, done(0.0), "prefill", 3.0) == pytest.approx(18.0)  # stuck: half a completion
    assert ev.hold_time(0.0, done(0.0), "prefill", 3.0) == 0.0
    assert ev.hold_time(None, done(5.0), "prefill", 3.0) is None
    assert ev.hold_time(2.0, None, "prefill", 3.0) is None


@pytest.mark.parametrize(
    ("rec", "charged"),
    [
        (record(), {}),
        (record(status="error", d_sent=None, first_token=None), {"p0": 1}),  # failed before decode: P's
        (record(status="error"), {"d0": 1}),  # failed once decode began: D's
        (record(status="timeout", d_sent=0.5), {"d0": 1}),
        (record(status="error", error="upstream_status_503", d_sent=None), {}),  # a 503 refusal is overload
        (record(status="rejected"), {}),
    ],
)
def test_a_failure_is_charged_to_the_stage_that_failed_it(rec: RecordFacts, charged: dict[str, int]) -> None:
    t = ev.WindowTally({"P": "prefill", "D": "decode"}, now=10.0)
    t.add(rec, invalid=False)
    assert {n: a.failed for n, a in t.instances.items() if a.failed} == charged
    assert t.instances["p0"].requests == t.instances["d0"].requests == 1


def test_an_invalid_request_is_counted_and_charged_to_nobody() -> None:
    t = ev.WindowTally({"P": "prefill", "D": "decode"}, now=10.0)
    t.add(record(status="error", http_status=400), invalid=True)
    assert t.instances["p0"].refused == t.instances["d0"].refused == 1
    assert t.instances["p0"].requests == 0 and t.instances["d0"].failed == 0
    assert not t.charged_handoffs and not t.handoffs and t.pools["P"].done == 0


def test_service_ttft_leaves_out_the_admission_wait_and_unqueued_also_p_queue() -> None:
    t = ev.WindowTally({"P": "prefill", "D": "decode"}, now=10.0)
    t.add(record(proxy_in=0.0, p_sent=0.3, ttft_s=1.0, p_queue_s=0.2), invalid=False)
    assert t.service_by_pair[("p0", "d0")] == [pytest.approx(0.7)]
    assert t.unqueued_by_pair[("p0", "d0")] == [pytest.approx(0.5)]
    assert t.pools["P"].residence == [pytest.approx(0.5)] and t.pools["D"].residence == [pytest.approx(1.0)]


def test_failed_attempts_and_lease_expiries_are_charged_by_name() -> None:
    t = ev.WindowTally({}, now=10.0)
    t.charge_failed_attempts(
        [
            {"instance": "d1", "kind": "timeout"},
            {"instance": "p1", "kind": "status_503"},
            "junk",
            {"kind": "error"},
        ]
    )
    assert t.instances["d1"].failed == 1 and t.instances["p1"].failed == 0
    entries = [{"to_ts": 5.0, "d_instance": "d2", "p_instance": "p2"}, {"to_ts": 99.0, "d_instance": "d3"}]
    t.charge_lease_expiries("d9", 5.0, entries, since=0.0, until=10.0)
    assert t.instances["d2"].lease_charged == 1 and t.instances["p2"].lease_on_p == 1
    assert t.instances["d3"].lease_charged == 0 and t.instances["d9"].lease_charged == 0
    t.charge_lease_expiries(
        "d9", 5.0, None, since=0.0, until=10.0
    )  # no detail: its own D, if it ended inside
    t.charge_lease_expiries("d8", 50.0, None, since=0.0, until=10.0)
    assert t.instances["d9"].lease_charged == 1 and t.instances["d8"].lease_charged == 0


def test_the_typical_member_is_the_lower_median_so_one_bad_member_does_not_move_it() -> None:
    def d(name: str, backlog: float | None, up: bool = True) -> InstanceSignals:
        return InstanceSignals(name=name, pool="D", role="decode", up=up, handoff_backlog=backlog)

    members = [d("a", 1.0), d("b", 2.0), d("c", 40.0), d("e", 3.0), d("f", 99.0, up=False)]
    assert ev.typical_times_members(members, "handoff_backlog") == pytest.approx(2.0 * 4)
    assert ev.sum_up(members, "handoff_backlog") == pytest.approx(46.0)
    assert ev.typical_times_members([d("a", None)], "handoff_backlog") is None


def _pairs_percentile(
    by_pair: dict[tuple[str, str], list[float]],
    side: int,
    members: set[str],
    pct: float,
    cfg: EvidenceConfig,
    pooled: list[float] | None = None,
) -> float | None:
    return ev.median_of_pairs(
        ev.per_pair(by_pair, pct, cfg.pair_min_samples), side, members, pct, cfg, pooled
    )


def test_a_pool_percentile_is_the_lower_median_over_pairs_with_enough_samples() -> None:
    n = CFG.pair_min_samples
    by_pair = {
        ("p0", "d0"): [1.0] * n,
        ("p0", "d1"): [1.0] * n,
        ("p0", "d2"): [9.0] * n,
        ("p1", "d0"): [5.0] * (n - 1),
    }
    assert _pairs_percentile(by_pair, 0, {"p0", "p1"}, 99.0, CFG) == pytest.approx(1.0)
    assert _pairs_percentile(by_pair, 1, {"d2"}, 99.0, CFG) == pytest.approx(9.0)
    # no pair has enough: the pooled figure, if it has enough itself
    few = {("p1", "d0"): [5.0] * (n - 1)}
    assert _pairs_percentile(few, 0, {"p1"}, 99.0, CFG) is None
    assert _pairs_percentile(few, 0, {"p1"}, 99.0, CFG, pooled=[2.0] * n) == pytest.approx(2.0)
    assert _pairs_percentile(few, 0, {"p1"}, 99.0, CFG, pooled=[2.0] * (n - 1)) is None


def test_rates_are_over_the_covered_span_right_after_a_start() -> None:
    assert (
        ev.rate_span_s(30.0, since=100.0, first_in=105.0, now=130.0, cfg=CFG) == 30.0
    )  # a quarter in: window
    assert ev.rate_span_s(30.0, since=100.0, first_in=120.0, now=130.0, cfg=CFG) == pytest.approx(10.0)
    assert ev.rate_span_s(30.0, since=100.0, first_in=129.5, now=130.0, cfg=CFG) == CFG.min_rate_span_s


def test_pool_signals_need_enough_requests_for_a_rate() -> None:
    t = ev.WindowTally({"P": "prefill"}, now=10.0)
    for i in range(CFG.pool_min_requests - 1):
        t.add(record(proxy_in=float(i) * 0.1, d_pool=None), invalid=False)
    members = [
        InstanceSignals(name="p0", pool="P", role="prefill", up=True, num_waiting=2.0, num_running=3.0)
    ]
    sig = ev.pool_signals("P", t.pools["P"], members, t, 10.0, CFG)
    assert sig.completed_per_s is None and sig.inflight_requests is None
    t.add(record(proxy_in=1.0, d_pool=None), invalid=False)
    sig = ev.pool_signals("P", t.pools["P"], members, t, 10.0, CFG)
    assert sig.completed_per_s == pytest.approx(CFG.pool_min_requests / 10.0)
    assert sig.waiting_now == 2.0 and sig.running_now == 3.0


def test_unattributed_expiries_are_the_p_counter_less_the_attributed_ones() -> None:
    tally = ev.InstanceTally(lease_on_p=2)
    assert ev.unattributed_expiries("prefill", Scrapes(increases={"nixl_kv_expired_reqs": 5.0}), tally) == 3
    assert ev.unattributed_expiries("prefill", Scrapes(increases={"nixl_kv_expired_reqs": 1.0}), tally) == 0
    assert ev.unattributed_expiries("decode", Scrapes(increases={"nixl_kv_expired_reqs": 5.0}), None) == 0


def test_an_expiry_explained_by_a_request_d_refused_as_invalid_is_evidence_against_nobody() -> None:
    t = ev.WindowTally({}, now=10.0)
    entries = [{"to_ts": 5.0, "d_instance": "d0", "p_instance": "p0"}]
    t.charge_lease_expiries("d0", 5.0, entries, since=0.0, until=10.0, invalid=True)
    t.charge_lease_expiries("d0", 5.0, None, since=0.0, until=10.0, invalid=True)  # no detail: nobody
    assert t.instances["d0"].lease_charged == 0 and t.instances["p0"].lease_on_p == 0
    p0 = t.instances["p0"]
    assert p0.lease_refused == 1
    window = Scrapes(increases={"nixl_kv_expired_reqs": 1.0}, seconds=60.0, expired_leases_per_min=1.0)
    sig = ev.instance_signals("p0", "P", "prefill", CFG, window, None, None, p0, None)
    assert sig.unattributed_lease_expiries == 0  # explained, not a mystery on P
    assert sig.expired_leases_per_min == 0.0  # nothing for the KVLeaseExpired alert
    d0 = ev.instance_signals("d0", "D", "decode", CFG, Scrapes(), None, None, t.instances["d0"], None)
    assert d0.lease_expiry_suspects == 0
    two = Scrapes(increases={"nixl_kv_expired_reqs": 2.0}, seconds=60.0, expired_leases_per_min=2.0)
    assert (
        ev.instance_signals("p0", "P", "prefill", CFG, two, None, None, p0, None).expired_leases_per_min
        == 1.0
    )


def test_the_evidence_config_is_the_policy_configs_evidence_part() -> None:
    cfg = PolicyConfig.defaults(pair_min_samples=3, recent_s=7.0)
    assert cfg.evidence == EvidenceConfig(7.0, cfg.kv_lease_s, cfg.ttft_percentile, pair_min_samples=3)
    assert "ttft_percentile" not in EVIDENCE_ONLY  # the policy reads it too
    assert len(EVIDENCE_ONLY) == 9


def test_a_handoff_p_finished_that_no_d_served_is_counted_on_p_with_its_id() -> None:
    t = ev.WindowTally({"P": "prefill", "D": "decode"}, now=10.0)
    t.add(record(request_id="served"), invalid=False)  # first token: D pulled
    t.add(
        record(request_id="not-prefilled", p_done=None, d_sent=None, first_token=None, status="error"), False
    )
    t.add(record(request_id="refused", first_token=None, status="error", http_status=400), invalid=True)
    for i in range(ev.UNPULLED_IDS + 2):  # P done, no first token (D failed, the client left)
        t.add(record(request_id=f"u{i}", first_token=None, status="cancelled"), invalid=False)
    p0 = t.instances["p0"]
    assert p0.unpulled == ev.UNPULLED_IDS + 2
    assert p0.unpulled_ids == [f"u{i}" for i in range(2, ev.UNPULLED_IDS + 2)]  # the last few, bounded
    assert t.instances["d0"].unpulled == 0
    sig = ev.instance_signals(
        "p0", "P", "prefill", EvidenceConfig(7.0, 30.0, 0.99), None, None, None, p0, None
    )
    assert (sig.unpulled_handoffs, sig.unpulled_ids) == (ev.UNPULLED_IDS + 2, tuple(p0.unpulled_ids))
    d_sig = ev.instance_signals(
        "d0",
        "D",
        "decode",
        EvidenceConfig(7.0, 30.0, 0.99),
        None,
        None,
        ev.LatestGauges(3.0, None, None, 1.0, 0, 2.0),
        None,
        None,
    )
    assert (d_sig.pulls_pending, d_sig.handoff_backlog, d_sig.unpulled_handoffs) == (2.0, 1.0, 0)


def test_handoffs_p_finished_after_its_restart_are_counted_per_pair_failed_and_served() -> None:
    t = ev.WindowTally({"P": "prefill", "D": "decode"}, now=10.0, restarted={"p0": 1.0})
    t.add(record(p_done=0.5, status="error"), invalid=False)  # before the restart: not counted
    t.add(record(p_done=1.5, status="error"), invalid=False)  # failed at D after it
    t.add(record(p_done=2.0), invalid=False)  # served after it
    t.add(record(p_instance="p1", p_done=2.0, status="error"), invalid=False)  # p1 did not restart
    t.charge_failed_attempts(
        [
            {"stage": "decode", "instance": "d1", "kind": "status_500", "p_instance": "p0", "p_done": 3.0},
            {"stage": "decode", "instance": "d1", "kind": "status_500", "p_instance": "p0", "p_done": 0.2},
            "not a dict",
        ]
    )
    assert dict(t.failed_since_restart) == {("p0", "d0"): 1, ("p0", "d1"): 1}
    assert dict(t.served_since_restart) == {("p0", "d0"): 1}
    assert t.pair_failures[("p0", "d1")] == 2  # every failure still counts on the pair
