"""Decision regret (analysis.regret) as tables: undo and flapping, ticks across epochs,
recovery of the signals, the SLO before and after, the per-reason tally, and the bucketing."""

from __future__ import annotations

import pytest

from analysis.regret import (
    DecisionFact,
    RecordFact,
    RegretConfig,
    ScrapeFact,
    SignalSample,
    SLOBucket,
    cut_instances,
    healthy,
    plan,
    regret,
    regret_of,
    signal_samples,
    slo_buckets,
    ticks_between,
)

CFG = RegretConfig(flap_ticks=10, tick_s=2.0, slo_window_s=60.0, min_requests=5)


def w(
    tick: int,
    old: float | None,
    new: float,
    reason: str = "SlowHandoff",
    *,
    subject: str = "d1",
    epoch: int | None = 1,
    kind: str = "instance",
    fld: str = "weight",
) -> DecisionFact:
    """A decision at tick ``tick`` of epoch 1, 2 s per tick from t=1000."""
    return DecisionFact(1000.0 + 2.0 * tick, tick, kind, subject, fld, old, new, reason, epoch)


def run(
    decisions: list[DecisionFact],
    *,
    until: float = 2000.0,
    observed: float = 5000.0,
    samples: tuple[SignalSample, ...] = (),
    slo: tuple[SLOBucket, ...] = (),
    cfg: RegretConfig = CFG,
):
    return regret(decisions, samples, slo, since=0.0, until=until, observed_until=observed, cfg=cfg)


# -- undo and flapping --------------------------------------------------------------------------

UNDO_CASES = {
    # name: (decisions, [(undone_after_ticks, flapped, pending) per cut])
    "undone within N ticks flaps": (
        [w(0, None, 1.0), w(5, 1.0, 0.5), w(9, 0.5, 1.0, "Recovering")],
        [(4, True, False)],
    ),
    "undone at exactly N ticks flaps": ([w(5, 1.0, 0.5), w(15, 0.5, 1.0, "Recovering")], [(10, True, False)]),
    "undone after N ticks does not": ([w(5, 1.0, 0.5), w(16, 0.5, 1.0, "Recovering")], [(11, False, False)]),
    "never undone, horizon passed": ([w(5, 1.0, 0.5)], [(None, False, False)]),
    "a partial raise is no undo": (
        [w(5, 1.0, 0.5), w(8, 0.5, 0.8, "Recovering"), w(30, 0.8, 1.0, "Recovering")],
        [(25, False, False)],
    ),
    "two cuts, one raise back undoes both": (
        [w(5, 1.0, 0.7), w(6, 0.7, 0.4), w(9, 0.4, 1.0, "Recovering")],
        [(4, True, False), (3, True, False)],
    ),
    "a raise back past the old value undoes": (
        [w(5, 0.6, 0.3), w(7, 0.3, 0.9, "Probing")],
        [(2, True, False)],
    ),
    "a raise back to where the second cut began undoes only that one": (
        [w(5, 0.6, 0.3), w(6, 0.3, 0.1), w(7, 0.1, 0.3, "Probing")],
        [(None, False, False), (1, True, False)],
    ),
}


@pytest.mark.parametrize("name", list(UNDO_CASES))
def test_undo_and_flapping(name: str) -> None:
    decisions, expected = UNDO_CASES[name]
    r = run(decisions)
    assert [(c.undone_after_ticks, c.flapped, c.pending) for c in r.cuts] == expected


def test_a_cut_near_the_end_of_the_data_is_pending_and_left_out_of_the_rate() -> None:
    # cut at t=1010; 10 ticks of 2 s reach 1030, past the data's end at 1020
    r = run(
        [
            w(5, 1.0, 0.5),
            w(0, None, 1.0, subject="d2"),
            w(1, 1.0, 0.5, subject="d2"),
            w(3, 0.5, 1.0, "Recovering", subject="d2"),
        ],
        observed=1020.0,
    )
    pending = [c for c in r.cuts if c.pending]
    assert [c.subject for c in pending] == ["d1"]
    assert r.total.cuts == 2 and r.total.pending == 1 and r.total.flapped == 1
    assert r.total.flap_rate == 1.0  # one decided cut, and it flapped


def test_undo_and_the_undoing_reason_and_time() -> None:
    (c,) = run([w(5, 1.0, 0.5), w(12, 0.5, 1.0, "Recovering")]).cuts
    assert c.undone_by == "Recovering" and c.undone_at == 1024.0 and c.undone_after_s == 14.0


def test_ticks_across_epochs_come_from_the_elapsed_time() -> None:
    a = w(40, 1.0, 0.5, epoch=3)
    b = DecisionFact(a.ts + 10.0, 2, "instance", "d1", "weight", 0.5, 1.0, "Recovering", 4)  # restarted
    assert ticks_between(a, b, 2.0) == 5  # 10 s / 2 s, not 2 - 40
    same = DecisionFact(a.ts + 9.0, 45, "instance", "d1", "weight", 0.5, 1.0, "Recovering", 3)
    assert ticks_between(a, same, 2.0) == 5
    unknown = DecisionFact(a.ts + 30.0, 45, "instance", "d1", "weight", 0.5, 1.0, "Recovering", None)
    assert ticks_between(w(40, 1.0, 0.5, epoch=None), unknown, 2.0) == 15  # no epoch: time
    (c,) = run([a, b]).cuts
    assert c.undone_after_ticks == 5 and c.flapped


def test_only_cuts_of_the_range_and_the_cut_fields_are_judged() -> None:
    decisions = [
        w(0, None, 1.0, "Initial"),  # no old value: not a cut
        w(600, 1.0, 0.5),  # at t=2200: after the range
        w(601, 0.5, 1.0, "Recovering"),
        w(5, 64.0, 48.0, "HandoffBacklog", subject="decode", kind="pool", fld="max_inflight_kv_bytes"),
        w(6, 256.0, 128.0, "TTFTOverBudget", subject="prefill", kind="pool", fld="max_inflight_requests"),
        w(7, 0.5, 0.5, "Steady", subject="d3"),  # not lower
    ]
    r = run(decisions, until=2000.0)
    assert [(c.subject, c.field) for c in r.cuts] == [("prefill", "max_inflight_requests")]
    assert r.cuts[0].recovered_at is None  # pools have no per-instance signals
    assert cut_instances(decisions, 0.0, 2000.0) == frozenset()
    assert cut_instances(decisions, 0.0, 3000.0) == {"d1"}


def test_a_raise_before_the_range_does_not_undo_a_cut_in_it_but_a_later_one_after_it_does() -> None:
    decisions = [
        w(5, 1.0, 0.5),
        w(8, 0.5, 1.0, "Recovering"),
        w(20, 1.0, 0.5),
        w(600, 0.5, 1.0, "Recovering"),
    ]
    r = regret(decisions, (), (), since=1030.0, until=1050.0, observed_until=5000.0, cfg=CFG)
    (c,) = r.cuts
    assert c.ts == 1040.0 and c.undone_after_ticks == 580 and not c.flapped


# -- recovery and the SLO -----------------------------------------------------------------------


def s(start: float, **kw: object) -> SignalSample:
    base: dict[str, object] = {
        "up": True,
        "kv_usage": 0.3,
        "requests": 10,
        "failed": 0,
        "stage_s": 0.1,
        "peer_stage_s": 0.1,
    }
    return SignalSample("d1", start, start + 30.0, **{**base, **kw})  # type: ignore[arg-type]


HEALTHY_CASES = {
    # name: (sample, reason, expected)
    "all good": (s(0), "SlowHandoff", True),
    "down": (s(0, up=False), "SlowHandoff", False),
    "KV past the limit": (s(0, kv_usage=0.9), "SlowHandoff", False),
    "too few requests to say": (s(0, requests=4), "SlowHandoff", None),
    "too many failed": (s(0, failed=1, requests=10), "RequestFailures", False),
    "stage past tolerance of its peers": (s(0, stage_s=0.16), "SlowHandoff", False),
    "stage at the tolerance": (s(0, stage_s=0.15), "SlowHandoff", True),
    "no peers to compare": (s(0, stage_s=5.0, peer_stage_s=None), "SlowHandoff", True),
    "down cut: up again is enough": (s(0, requests=0, stage_s=None), "InstanceDown", True),
    "down cut: not scraped": (s(0, up=None, requests=0), "InstanceDown", None),
    "KV cut: KV down again": (s(0, requests=0, kv_usage=0.5), "KVCachePressure", True),
}


@pytest.mark.parametrize("name", list(HEALTHY_CASES))
def test_healthy(name: str) -> None:
    sample, reason, expected = HEALTHY_CASES[name]
    assert healthy(sample, reason, CFG) is expected


def test_recovered_at_the_end_of_the_first_healthy_bucket_after_the_cut() -> None:
    samples = (s(980.0), s(1010.0, stage_s=1.0), s(1040.0, requests=2), s(1070.0), s(1100.0))
    (c,) = run([w(5, 1.0, 0.5)], samples=samples).cuts  # cut at 1010
    assert c.recovered_at == 1100.0 and c.recovered_after_s == 90.0


def test_never_recovered() -> None:
    (c,) = run([w(5, 1.0, 0.5)], samples=(s(1010.0, stage_s=1.0),)).cuts
    assert c.recovered_at is None and c.recovered_after_s is None


def test_slo_before_and_after_the_cut() -> None:
    slo = (
        SLOBucket(900.0, 930.0, 100, 100),  # mid 915: more than 60 s before the cut at 1010
        SLOBucket(960.0, 990.0, 10, 5),  # before
        SLOBucket(990.0, 1020.0, 10, 3),  # mid 1005: before
        SLOBucket(1020.0, 1050.0, 10, 9),  # after
        SLOBucket(1050.0, 1080.0, 10, 10),  # mid 1065: after (up to 1070)
        SLOBucket(1080.0, 1110.0, 10, 0),  # mid 1095: past the window
    )
    (c,) = run([w(5, 1.0, 0.5)], slo=slo).cuts
    assert c.slo_before == pytest.approx(8 / 20) and c.slo_after == pytest.approx(19 / 20)
    assert c.slo_delta == pytest.approx(0.55)
    (none,) = run([w(5, 1.0, 0.5)]).cuts
    assert none.slo_delta is None


# -- the tally ----------------------------------------------------------------------------------


def test_tally_per_reason() -> None:
    slo = (SLOBucket(990.0, 1010.0, 10, 5), SLOBucket(1010.0, 1030.0, 10, 9))
    decisions = [
        w(0, 1.0, 0.5, "SlowHandoff", subject="d1"),
        w(4, 0.5, 1.0, "Recovering", subject="d1"),  # 4 ticks: flapped
        w(5, 1.0, 0.5, "SlowHandoff", subject="d1"),
        w(25, 0.5, 1.0, "Recovering", subject="d1"),  # 20 ticks: undone, no flap
        w(5, 1.0, 0.6, "SlowHandoff", subject="d2"),  # never undone
        w(6, 1.0, 0.0, "InstanceDown", subject="p1"),
        w(8, 0.0, 1.0, "InstanceUp", subject="p1"),  # 2 ticks: flapped
    ]
    r = run(decisions, slo=slo)
    by = {t.reason: t for t in r.reasons}
    assert list(by) == ["SlowHandoff", "InstanceDown"]  # most cuts first
    sh = by["SlowHandoff"]
    assert (sh.cuts, sh.undone, sh.flapped, sh.pending) == (3, 2, 1, 0)
    assert sh.flap_rate == pytest.approx(1 / 3)
    assert sh.median_ticks_to_undo == 12.0 and sh.median_s_to_undo == 24.0
    down = by["InstanceDown"]
    assert (down.cuts, down.flapped, down.flap_rate, down.median_ticks_to_undo) == (1, 1, 1.0, 2)
    assert r.total.cuts == 4 and r.total.flapped == 2 and r.total.flap_rate == 0.5
    # every cut at t<=1012 sees buckets mid 1000 (before) and 1020 (after) in its 60 s windows
    assert sh.mean_slo_delta is not None
    d = r.as_dict()
    assert d["total"]["cuts"] == 4 and d["reasons"][0]["reason"] == "SlowHandoff" and d["cuts_listed"] == 4
    assert run([]).total.flap_rate is None


def test_the_answer_lists_the_newest_cuts() -> None:
    decisions = [w(i * 20, 1.0, 0.5) for i in range(5)]
    d = run(decisions).as_dict(max_cuts=2)
    assert [c["tick"] for c in d["cuts"]] == [60, 80] and d["cuts_listed"] == 2 and d["total"]["cuts"] == 5
    assert run(decisions).as_dict(max_cuts=0)["cuts"] == []


def test_bad_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="flap_ticks"):
        RegretConfig(flap_ticks=0)
    with pytest.raises(ValueError, match="tick_s"):
        RegretConfig(tick_s=0.0)


# -- bucketing ----------------------------------------------------------------------------------


def rec(
    t: float,
    p: str | None,
    d: str | None,
    *,
    status: str = "ok",
    p_s: float = 0.1,
    h_s: float = 0.2,
    met: bool = True,
    prefilled: bool = True,
) -> RecordFact:
    p_done = t + p_s if prefilled else None
    d_sent = None if p_done is None else p_done + 0.001
    return RecordFact(t, status, p, d, t, p_done, d_sent, None if p_done is None else p_done + h_s, met)


def test_signal_samples_per_instance_and_bucket_with_peer_medians() -> None:
    records = [
        rec(1.0, "p1", "d1", h_s=1.0),
        rec(2.0, "p1", "d2", h_s=0.2),
        rec(3.0, "p2", "d3", h_s=0.4),
        rec(4.0, "p1", "d1", h_s=3.0),
        rec(5.0, "p2", "d1", status="error", prefilled=False),  # failed before prefill: P's failure
        rec(6.0, "p2", "d2", status="timeout"),  # failed after: D's
        rec(12.0, "p1", "d1"),  # the next bucket
        RecordFact(15.0, "ok", None, "d3", None, None, 15.0, 15.3, True),  # decode-only: sent to D -> first
        rec(25.0, "p1", "d1"),  # past hi
    ]
    scrapes = [
        ScrapeFact("d1", 1.0, True, 0.4),
        ScrapeFact("d1", 6.0, False, None),
        ScrapeFact("d1", 7.0, True, 0.6),
        ScrapeFact("d4", 8.0, True, 0.1),
    ]
    out = {(x.subject, x.start): x for x in signal_samples(records, scrapes, 0.0, 20.0, 10.0)}
    d1 = out[("d1", 0.0)]
    assert (d1.requests, d1.failed, d1.up, d1.kv_usage) == (3, 0, False, 0.6)
    assert d1.stage_s == pytest.approx(2.0)  # median of 1.0 and 3.0 (the failed one has no first token)
    assert d1.peer_stage_s == pytest.approx(0.3)  # median of d2 (0.2, 0.2) and d3 (0.4) medians
    assert out[("d2", 0.0)].failed == 1 and out[("p2", 0.0)].failed == 1 and out[("p1", 0.0)].failed == 0
    assert out[("p1", 0.0)].stage_s == pytest.approx(0.1)
    assert out[("d1", 10.0)].requests == 1 and out[("d1", 10.0)].end == 20.0
    assert out[("d3", 10.0)].stage_s == pytest.approx(0.3) and out[
        ("d1", 10.0)
    ].peer_stage_s == pytest.approx(0.3)
    assert out[("d4", 0.0)].requests == 0 and out[("d4", 0.0)].up is True
    with pytest.raises(ValueError, match="bucket_s"):
        signal_samples([], [], 0.0, 1.0, 0.0)


def test_slo_buckets_count_completed_and_met() -> None:
    records = [
        rec(1.0, "p", "d"),
        rec(2.0, "p", "d", met=False),
        rec(3.0, "p", "d", status="error", met=False),
        rec(15.0, "p", "d"),
        rec(30.0, "p", "d"),
    ]
    assert slo_buckets(records, 0.0, 20.0, 10.0) == (SLOBucket(0.0, 10.0, 2, 1), SLOBucket(10.0, 20.0, 1, 1))


def test_plan_and_regret_of_end_to_end() -> None:
    cfg = RegretConfig(flap_ticks=3, tick_s=2.0, slo_window_s=60.0, min_requests=1)
    p = plan(1000.0, 1100.0, now=1200.0, cfg=cfg)
    assert (p.records_from, p.data_until, p.bucket_s, p.slo_bucket_s) == (940.0, 1200.0, 30.0, 2.0)
    assert plan(0.0, 100.0, now=10_000.0, cfg=cfg).data_until == 3700.0  # an hour after the range
    records = [rec(t, "p1", "d1" if t % 2 else "d2", h_s=0.2) for t in range(950, 1190)]
    decisions = [
        DecisionFact(1010.0, 5, "instance", "d1", "weight", 1.0, 0.5, "SlowHandoff", 1),
        DecisionFact(1014.0, 7, "instance", "d1", "weight", 0.5, 1.0, "Recovering", 1),
    ]
    r = regret_of(
        p, decisions, records, [ScrapeFact("d1", 1050.0, True, 0.2)], observed_until=1200.0, cfg=cfg
    )
    (c,) = r.cuts
    assert c.flapped and c.undone_after_ticks == 2
    assert c.recovered_at == 1060.0  # [1000, 1030) began before the cut at 1010: [1030, 1060) is the first
    assert c.slo_before == 1.0 and c.slo_after == 1.0
