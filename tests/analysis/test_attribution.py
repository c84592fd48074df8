"""SLO-miss attribution as a pure function: tables of request records -> where the excess went."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from analysis.attribution import (
    Attempt,
    Attribution,
    StageRecord,
    attribute,
    group_message,
    stage_durations,
)
from pdscope.config import LatencySLO, SLOSettings

SLO = SLOSettings(ttft=LatencySLO(target_ms=500.0), tpot=LatencySLO(target_ms=50.0))
T0 = 1_700_000_000.0  # 22:13:20 UTC
PS = ("prefill-0", "prefill-1")


def approx(x: float) -> object:
    """Timestamps near 1.7e9 s carry about 1e-7 s of float error."""
    return pytest.approx(x, abs=1e-5)


DS = ("decode-0", "decode-1", "decode-2")


def rec(
    i: int,
    p: str | None = "prefill-0",
    d: str = "decode-0",
    *,
    admission: float = 0.01,
    p_queue: float | None = 0.02,
    prefill: float = 0.1,
    handoff: float = 0.05,
    tpot: float = 0.02,
    tokens: int = 11,
    status: str = "ok",
    first_token: bool = True,
    **kw: object,
) -> StageRecord:
    """A record with these stage durations; TTFT and TPOT follow from them, as the collector derives them."""
    t = T0 + i
    if p is None:  # decode-only: admission then D's wait
        d_sent = t + admission
        first = d_sent + handoff
        p_sent = p_done = None
    else:
        p_sent = t + admission
        p_done = p_sent + (p_queue or 0.0) + prefill
        d_sent = p_done
        first = p_done + handoff
    done = first + tpot * (tokens - 1)
    ft = first if first_token else None
    return StageRecord(
        request_id=f"r{i}",
        proxy_in=t,
        status=status,
        p_instance=p,
        d_instance=d,
        p_sent=p_sent,
        p_done=p_done,
        d_sent=d_sent,
        first_token=ft,
        done=done,
        p_queue_s=p_queue,
        ttft_s=None if ft is None else ft - t,
        tpot_s=tpot if ft is not None else None,
        completion_tokens=tokens,
        **kw,  # type: ignore[arg-type]
    )


def healthy(n: int, start: int = 0) -> list[StageRecord]:
    """n healthy requests spread over every P x D pair."""
    return [rec(start + k, PS[k % 2], DS[k % 3]) for k in range(n)]


def run(records: list[StageRecord]) -> Attribution:
    return attribute(records, SLO, since=T0, until=T0 + 3600)


def test_stage_durations_of_a_sampled_record() -> None:
    d = stage_durations(rec(0, admission=0.01, p_queue=0.02, prefill=0.1, handoff=0.05, tpot=0.02))
    assert d["admission"] == approx(0.01)
    assert d["p_queue"] == approx(0.02)
    assert d["prefill"] == approx(0.1)
    assert d["p_total"] == approx(0.12)
    assert d["handoff"] == approx(0.05)
    assert d["tpot"] == approx(0.02)
    assert "d_queue" not in d


def test_decode_only_record_has_a_d_queue_and_no_p_stage() -> None:
    d = stage_durations(rec(0, None, "decode-1", admission=0.03, handoff=0.2))
    assert d["admission"] == approx(0.03)
    assert d["d_queue"] == approx(0.2)
    assert not {"p_total", "p_queue", "prefill", "handoff"} & d.keys()


def test_no_misses_is_an_empty_result() -> None:
    a = run(healthy(30))
    assert (a.requests, a.healthy, a.missed) == (30, 30, 0)
    assert a.groups == () and a.top == () and a.total_excess_s == 0.0
    assert a.baseline_source == "healthy"
    assert a.summary().startswith("no request missed")


def test_no_records_says_so() -> None:
    a = run([])
    assert a.requests == 0 and a.groups == ()
    assert a.summary() == "no request records in the range"


def test_a_slow_p_concentrates_the_excess_on_prefill_at_that_p() -> None:
    slow = [rec(100 + k, "prefill-1", DS[k % 3], prefill=0.9) for k in range(12)]
    a = run(healthy(30) + slow)
    assert a.missed == 12
    top = a.top[0]
    assert (top.stage, top.place, top.cause) == ("prefill", "prefill-1", "slow")
    assert top.share > 0.95
    assert top.count == 12
    assert top.since == T0 + 100
    assert top.excess_s == approx(12 * 0.8)  # 0.9 over the healthy median 0.1
    assert top.message.startswith("prefill on prefill-1: ")
    assert "since 22:15:00 UTC (12 misses)" in top.message


def test_a_bad_link_charges_the_handoff_of_that_pair() -> None:
    bad = [rec(200 + k, "prefill-0", "decode-2", handoff=0.8) for k in range(10)]
    a = run(healthy(30) + bad)
    top = a.top[0]
    assert (top.stage, top.place, top.cause) == ("handoff", "prefill-0->decode-2", "slow")
    assert top.share == approx(1.0)
    assert top.excess_s == approx(10 * 0.75)


def test_a_d_slow_on_every_p_is_its_queue_not_a_link() -> None:
    busy = [rec(300 + k, PS[k % 2], "decode-2", handoff=0.8) for k in range(10)]
    a = run(healthy(30) + busy)
    assert len(a.groups) == 1
    g = a.top[0]
    assert (g.stage, g.place, g.cause) == ("d_queue", "decode-2", "slow")
    assert g.message.startswith("D queue on decode-2: 100% of the excess since ")


def test_expired_leases_are_flagged_on_the_pair() -> None:
    lost = [
        rec(
            400 + k,
            "prefill-1",
            "decode-1",
            handoff=6.0,
            status="timeout",
            first_token=False,
            lease_expired=True,
        )
        for k in range(4)
    ]
    slow = [rec(500 + k, "prefill-0", DS[k % 3], prefill=0.5) for k in range(3)]
    a = run(healthy(30) + lost + slow)
    top = a.top[0]
    assert (top.stage, top.place, top.cause) == ("handoff", "prefill-1->decode-1", "lease_expired")
    assert top.count == 4
    assert "expired KV leases" in top.message
    # a request without a first token waited on its handoff until it ended
    miss = next(m for m in a.misses if m.request_id == "r400")
    assert miss.missed == ("outcome",)
    assert miss.stages[0].duration_s == approx(6.0 + 0.02 * 10)


def test_transfer_failures_are_their_own_cause() -> None:
    failed = [rec(600 + k, "prefill-0", "decode-0", handoff=0.7, transfer_failed=True) for k in range(5)]
    slow = [rec(700 + k, "prefill-1", "decode-1", handoff=0.7) for k in range(5)]
    a = run(healthy(30) + failed + slow)
    keys = {(g.stage, g.place, g.cause) for g in a.groups}
    assert keys == {
        ("handoff", "prefill-0->decode-0", "transfer_failed"),
        ("handoff", "prefill-1->decode-1", "slow"),
    }


def test_a_missed_tpot_charges_decode_only() -> None:
    slow = [rec(800 + k, "prefill-0", "decode-1", tpot=0.08, handoff=0.3) for k in range(6)]
    a = run(healthy(30) + slow)
    assert len(a.groups) == 1
    g = a.top[0]
    assert (g.stage, g.place) == ("decode", "decode-1")
    # (0.08 - 0.02) per token over 10 tokens after the first; the slower handoff is not what it missed
    assert g.excess_s == approx(6 * 0.06 * 10)


def test_shares_sum_to_one_and_groups_are_sorted() -> None:
    a = run(
        healthy(40)
        + [rec(900 + k, "prefill-1", "decode-0", prefill=0.9) for k in range(6)]
        + [rec(950 + k, "prefill-0", "decode-2", handoff=0.9) for k in range(3)]
        + [rec(980 + k, "prefill-0", "decode-1", admission=0.7) for k in range(2)]
    )
    assert sum(g.share for g in a.groups) == approx(1.0)
    assert [g.share for g in a.groups] == sorted((g.share for g in a.groups), reverse=True)
    assert [(g.stage, g.place) for g in a.top] == [
        ("prefill", "prefill-1"),
        ("handoff", "prefill-0->decode-2"),
        ("admission", "proxy"),
    ]
    assert a.total_excess_s == approx(sum(m.excess_s for m in a.misses))


def test_all_misses_fall_back_to_zero_baselines() -> None:
    # no healthy part: each stage's whole time is its excess, and the result says so
    slow = [rec(k, "prefill-0", DS[k % 3], prefill=0.9) for k in range(5)]
    a = run(slow)
    assert a.healthy == 0 and a.missed == 5
    assert a.baseline_source == "zero" and a.baselines == {}
    assert "baselines are zero" in a.summary()
    assert a.top[0].stage == "prefill" and a.top[0].place == "prefill-0"
    m = a.misses[0]
    assert all(s.baseline_s == 0.0 for s in m.stages)
    # the whole of each stage, but for those under 5% of the miss's excess (admission, P queue): noise
    assert m.excess_s == approx(0.9 + 0.05)
    assert [s.stage for s in m.stages] == ["prefill", "handoff"]


def test_unsampled_records_charge_the_whole_p_time_to_prefill_unsplit() -> None:
    unsampled = [
        replace(rec(1000 + k, "prefill-1", "decode-0", p_queue=0.6), p_queue_s=None) for k in range(4)
    ]
    a = run(healthy(30) + unsampled)
    g = a.top[0]
    assert (g.stage, g.place) == ("prefill", "prefill-1")
    stage = a.misses[0].stages[0]
    assert stage.split is False
    assert stage.baseline_s == approx(0.12)  # the healthy P time, queue and prefill together
    assert stage.excess_s == approx(0.6 + 0.1 - 0.12)


def test_a_record_with_no_stage_timestamps_is_counted_unmeasured() -> None:
    bare = StageRecord(
        "x1", T0 + 5, "ok", "prefill-0", "decode-0", ttft_s=0.9, tpot_s=0.01, completion_tokens=5
    )
    failed = StageRecord("x2", T0 + 6, "error", "prefill-0", "decode-1")
    a = run([*healthy(10), bare, failed])
    assert a.missed == 2 and a.total_excess_s == 0.0
    keys = {(g.stage, g.place, g.cause): g for g in a.groups}
    assert set(keys) == {("unmeasured", "decode-0", "unknown"), ("outcome", "decode-1", "status:error")}
    assert all(g.share == approx(0.5) for g in keys.values())  # no excess: shares by count
    assert "status error" in keys[("outcome", "decode-1", "status:error")].message


def test_as_dict_is_bounded_and_carries_the_top() -> None:
    slow = [rec(100 + k, "prefill-1", "decode-0", prefill=0.5 + k * 0.1) for k in range(8)]
    out = run(healthy(20) + slow).as_dict(max_misses=3)
    assert out["missed"] == 8 and out["misses_shown"] == 3
    assert [m["request_id"] for m in out["misses"]] == ["r107", "r106", "r105"]  # most excess first
    assert out["top"][0]["message"].startswith("prefill on prefill-1")
    assert out["baseline_source"] == "healthy"


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (
            ("d_queue", "decode-2", "slow", 0.61, 14, 1_700_000_580.0),
            "D queue on decode-2: 61% of the excess since 22:23:00 UTC (14 misses)",
        ),
        (
            ("handoff", "p->d", "lease_expired", 0.2, 1, T0),
            "handoff (incl. KV pull) on p->d, expired KV leases: "
            "20% of the excess since 22:13:20 UTC (1 miss)",
        ),
        (
            ("retry", "*->decode-1", "failed:connect", 0.5, 2, T0),
            "failed attempts on every link into decode-1, failed (connect): "
            "50% of the excess since 22:13:20 UTC (2 misses)",
        ),
    ],
)
def test_group_message(args: tuple[str, str, str, float, int, float], text: str) -> None:
    assert group_message(*args) == text


def test_a_stage_barely_over_its_median_is_noise_not_a_reason() -> None:
    # a slow P whose handoff is also a hair over the healthy median: only prefill is charged
    slow = [rec(100 + k, "prefill-1", "decode-0", prefill=0.9, handoff=0.051) for k in range(5)]
    a = run(healthy(30) + slow)
    assert [(g.stage, g.place) for g in a.groups] == [("prefill", "prefill-1")]
    # at 5% of the miss's excess or more it is charged
    slower = [rec(200 + k, "prefill-1", "decode-0", prefill=0.9, handoff=0.05 + 0.05) for k in range(5)]
    b = run(healthy(30) + slower)
    assert {(g.stage, g.place) for g in b.groups} == {
        ("prefill", "prefill-1"),
        ("handoff", "prefill-1->decode-0"),
    }


def test_a_retried_request_says_so() -> None:
    retried = [rec(300 + k, "prefill-1", "decode-0", prefill=0.9, retries=1) for k in range(3)]
    a = run(healthy(30) + retried)
    g = a.top[0]
    assert (g.stage, g.place, g.cause) == ("prefill", "prefill-1", "retried")
    assert g.message.startswith("prefill on prefill-1, after retries: 100% of the excess")


# -- failed attempts, failed requests, a D's links or its queue ---------------------------------


def retried(i: int, attempt: Attempt, **kw: object) -> StageRecord:
    """A request that met a failed attempt, then went through prefill-1 -> decode-0 (its record's own)."""
    return rec(i, "prefill-1", "decode-0", retries=1, attempts=(attempt,), **kw)  # type: ignore[arg-type]


def decode_attempt(
    i: int, d: str = "decode-1", p: str = "prefill-0", *, at: float, took: float, **kw: object
) -> Attempt:
    t = T0 + i + at
    return Attempt("decode", d, "status_500", t, t + took, p, **kw)  # type: ignore[arg-type]


def test_failed_attempts_before_the_kept_path_are_charged_to_their_pair() -> None:
    # a transfer on prefill-0 -> decode-1 failed; the retry's new prefill began 0.71 s after proxy_in
    failed = [
        retried(100 + k, decode_attempt(100 + k, at=0.5, took=0.2, transfer_failed=True), admission=0.71)
        for k in range(4)
    ]
    a = run(healthy(30) + failed)
    top = a.top[0]
    assert (top.stage, top.place, top.cause) == ("retry", "prefill-0->decode-1", "transfer_failed")
    assert top.share == approx(1.0) and top.count == 4
    assert top.excess_s == approx(4 * (0.71 - 0.01))  # over the healthy admission wait
    assert "failed attempts on prefill-0->decode-1, failed KV transfers" in top.message
    assert not [g for g in a.groups if g.stage == "admission"]


def test_an_attempt_whose_lease_expired_names_its_d_not_the_records() -> None:
    lost = [
        retried(
            200 + k,
            decode_attempt(200 + k, at=0.1, took=3.0),
            admission=3.2,
            lease_expired=True,
            lease_expired_ds=("decode-1",),
        )
        for k in range(3)
    ]
    a = run(healthy(30) + lost)
    assert [(g.stage, g.place, g.cause) for g in a.groups] == [
        ("retry", "prefill-0->decode-1", "lease_expired")
    ]


def test_an_attempt_passed_on_within_the_handoff_is_cut_out_of_it() -> None:
    # decode-1 refused the connection after 0.4 s; decode-0 then pulled P's blocks: handoff 0.5 s
    passed = [
        retried(
            300 + k,
            replace(decode_attempt(300 + k, p="prefill-1", at=0.14, took=0.4), kind="connect"),
            handoff=0.5,
        )
        for k in range(3)
    ]
    a = run(healthy(30) + passed)
    keys = {(g.stage, g.place, g.cause): g for g in a.groups}
    assert set(keys) == {
        ("retry", "prefill-1->decode-1", "failed:connect"),
        ("handoff", "prefill-1->decode-0", "retried"),
    }
    assert keys[("retry", "prefill-1->decode-1", "failed:connect")].excess_s == approx(3 * 0.4)
    assert keys[("handoff", "prefill-1->decode-0", "retried")].excess_s == approx(3 * (0.1 - 0.05))


def test_a_failed_request_counts_at_least_the_ttft_target_where_it_ended() -> None:
    # D refused at once: no stage over its median, yet each failure weighs the TTFT target (0.5 s)
    refused = [
        rec(
            400 + k,
            "prefill-0",
            "decode-2",
            handoff=0.001,
            status="error",
            first_token=False,
            error="connect",
        )
        for k in range(3)
    ]
    slow = [rec(500 + k, "prefill-1", "decode-0", prefill=0.5) for k in range(3)]
    a = run(healthy(30) + refused + slow)
    top = a.top[0]
    assert (top.stage, top.place, top.cause) == ("handoff", "prefill-0->decode-2", "failed:connect")
    assert top.excess_s == approx(3 * 0.5)
    assert a.groups[1].stage == "prefill" and a.groups[1].excess_s == approx(3 * 0.4)
    # a P that never answered: the failure is its prefill's
    no_p = replace(refused[0], request_id="np", p_done=None, d_sent=None, error="timeout")
    b = run([*healthy(30), no_p])
    assert [(g.stage, g.place, g.cause) for g in b.groups] == [("prefill", "prefill-0", "failed:timeout")]


def test_a_p_slow_toward_every_d_is_its_links_out_not_each_pair() -> None:
    """Issue 29: a P's NIC slow toward every D. Each D's slow handoffs all came from that one P, so no
    D's rule applies; the P's misses are spread over its pairs alike: every link out of it."""
    nic = [rec(700 + k, "prefill-1", DS[k % 3], handoff=0.8) for k in range(12)]
    a = run(healthy(30) + nic)
    assert [(g.stage, g.place, g.cause) for g in a.groups] == [("handoff", "prefill-1->*", "slow")]
    assert a.top[0].message.startswith("handoff (incl. KV pull) on every link out of prefill-1: 100% ")
    # one pair alone: the link, as before
    link = [rec(800 + k, "prefill-1", "decode-2", handoff=0.8) for k in range(12)]
    assert [g.place for g in run(healthy(30) + link).groups] == ["prefill-1->decode-2"]
    # every pair slow: the Ds' rule comes first (their queues), not every P's links
    both = [rec(900 + k, PS[k % 2], DS[k % 3], handoff=0.8) for k in range(12)]
    assert {g.place for g in run(healthy(30) + both).groups} == set(DS)


def test_a_d_slow_on_every_p_is_its_links_when_its_kv_pulls_are_slow() -> None:
    base = [replace(r, transfer_s=0.01) for r in healthy(30)]
    # a slow NIC: D's KV pulls take 0.6 s where the healthy take 0.01 s
    nic = [replace(rec(600 + k, PS[k % 2], "decode-2", handoff=0.8), transfer_s=0.6) for k in range(10)]
    a = run(base + nic)
    assert [(g.stage, g.place, g.cause) for g in a.groups] == [("handoff", "*->decode-2", "slow")]
    assert a.top[0].excess_s == approx(10 * 0.75)
    assert a.top[0].message.startswith("handoff (incl. KV pull) on every link into decode-2: 100% ")
    # pulls under three times the healthy ones (a scrape window's mean): the D's queue
    queue = [replace(r, transfer_s=0.029) for r in nic]
    assert [(g.stage, g.place) for g in run(base + queue).groups] == [("d_queue", "decode-2")]
    # no transfer figures on the healthy requests: nothing to compare, its queue
    assert [(g.stage, g.place) for g in run(healthy(30) + nic).groups] == [("d_queue", "decode-2")]


def test_failures_into_one_d_from_every_p_name_every_link_into_it() -> None:
    refused = [
        rec(700 + k, PS[k % 2], "decode-1", handoff=0.001, status="error", first_token=False, error="connect")
        for k in range(6)
    ]
    a = run(healthy(30) + refused)
    assert [(g.stage, g.place, g.cause) for g in a.groups] == [("handoff", "*->decode-1", "failed:connect")]
    # from one P only: that pair
    one = [replace(r, p_instance="prefill-0") for r in refused]
    assert [g.place for g in run(healthy(30) + one).groups] == ["prefill-0->decode-1"]


def test_a_failed_request_with_no_token_ended_in_its_handoff() -> None:
    # the collector's first-token time of a failed request may be where its handoff span ended
    broke = rec(800, "prefill-0", "decode-2", handoff=0.01, status="error", tokens=0, error="status_500")
    assert broke.first_token is not None
    a = run([*healthy(30), broke])
    assert [(g.stage, g.place, g.cause) for g in a.groups] == [
        ("handoff", "prefill-0->decode-2", "failed:status_500")
    ]
    # one that streamed tokens before it broke ended in decode
    streamed = replace(broke, completion_tokens=4, tpot_s=0.02)
    assert [g.stage for g in run([*healthy(30), streamed]).groups] == ["decode"]


def test_a_cause_on_one_pair_stays_on_it_while_slow_handoffs_spread_over_the_d() -> None:
    failed = [rec(900 + k, "prefill-0", "decode-1", handoff=0.7, transfer_failed=True) for k in range(4)]
    slow = [rec(950 + k, PS[k % 2], "decode-1", handoff=0.7) for k in range(4)]
    a = run(healthy(30) + failed + slow)
    assert {(g.stage, g.place, g.cause) for g in a.groups} == {
        ("handoff", "prefill-0->decode-1", "transfer_failed"),
        ("d_queue", "decode-1", "slow"),
    }
    # expired leases on the handoffs of every P into one D: every link into it
    lost = [replace(r, lease_expired=True, transfer_failed=False) for r in slow]
    assert [(g.place, g.cause) for g in run(healthy(30) + lost).groups] == [("*->decode-1", "lease_expired")]


def _into_d1(start: int, through_p0: int, through_p1: int, **kw: object) -> list[StageRecord]:
    return [
        rec(start + k, "prefill-0" if k < through_p0 else "prefill-1", "decode-1", **kw)  # type: ignore[arg-type]
        for k in range(through_p0 + through_p1)
    ]


def test_a_d_queue_stays_the_ds_when_one_pair_holds_what_chance_gives_the_most_of_two() -> None:
    """12 of 16 slow handoffs into a D through one of two Ps whose met requests to it were alike: either
    pair holds that many by chance in one run of thirteen (3.8 % each), so the D's queue, not a link."""
    slow = _into_d1(1000, 12, 4, handoff=0.8)
    calm = _into_d1(1100, 20, 20)  # with healthy(30)'s: 25 met requests through each P
    a = run(healthy(30) + calm + slow)
    assert [(g.stage, g.place) for g in a.groups] == [("d_queue", "decode-1")]
    # 15 of 16 is a link (either pair 0.05 %)
    link = _into_d1(1000, 15, 1, handoff=0.8)
    assert run(healthy(30) + calm + link).top[0].place == "prefill-0->decode-1"


def test_misses_through_the_p_that_carried_most_of_a_ds_requests_are_its_queue() -> None:
    """A proxy that sent three in four of a D's requests through one P (it picks P and D each on its own
    load) has about as many of the D's misses there when the D is slow: its queue."""
    slow = _into_d1(1000, 14, 2, handoff=0.8)
    calm = _into_d1(
        1100, 70, 20
    )  # with healthy(30)'s: 75 met requests through prefill-0, 25 through prefill-1
    a = run(healthy(30) + calm + slow)
    assert [(g.stage, g.place) for g in a.groups] == [("d_queue", "decode-1")]
    # the same misses where each P's met requests to the D were alike: that pair is the link
    calm = _into_d1(1100, 45, 45)
    assert run(healthy(30) + calm + slow).top[0].place == "prefill-0->decode-1"


def test_a_link_whose_every_request_missed_is_held_against_the_met_ones() -> None:
    """Every request through the bad pair missed (12), the other P's to the D met but for 2: weighed by all
    their requests the two pairs look alike (17 each) and 12 of 14 is chance (1.3 % for either); by the met
    ones (5 and 15) it is not."""
    bad = _into_d1(1000, 12, 2, handoff=0.8)
    calm = _into_d1(1100, 0, 10)
    a = run(healthy(30) + calm + bad)
    assert (a.top[0].stage, a.top[0].place) == ("handoff", "prefill-0->decode-1")


def _windows_read_as_a_link(fault: str, share_p0: float, requests: int, n: int = 150) -> float:
    """Of ``n`` seeded windows where a D's ``requests`` came ``share_p0`` through prefill-0, the share whose
    top reason is a pair. ``queue``: each of them missed with 0.3 through either P; ``link``
    (prefill-0 -> decode-1): every one through prefill-0 missed, the others with 0.05."""
    rng = random.Random(11)
    base = [r for r in healthy(30) if r.d_instance != "decode-1"]
    links = 0
    for _ in range(n):
        window = list(base)
        for k in range(requests):
            p = "prefill-0" if rng.random() < share_p0 else "prefill-1"
            rate = 0.3 if fault == "queue" else (1.0 if p == "prefill-0" else 0.05)
            window.append(rec(1000 + k, p, "decode-1", handoff=0.8 if rng.random() < rate else 0.05))
        top = run(window).top
        links += bool(top) and "->decode-1" in top[0].place and not top[0].place.startswith("*")
    return links / n


def test_a_ds_queue_reads_as_a_link_rarely_however_the_proxy_routed_to_it() -> None:
    """Seeded windows: the old rule (an even spread over the pairs with misses, 5 %) read a D's queue as a
    link in 4 % of them with even routing and in 88 % with four in five of the D's requests through one P;
    a bad link it found in 56-100 % where its pair carried a fifth of the D's requests or more, and in 31 %
    where it carried a tenth beside the D's stray misses elsewhere (under 70 % of the D's misses)."""
    assert _windows_read_as_a_link("queue", 0.5, 40) < 0.05
    assert _windows_read_as_a_link("queue", 0.8, 80) < 0.05
    assert _windows_read_as_a_link("link", 0.5, 20) > 0.95
    assert _windows_read_as_a_link("link", 0.2, 40) > 0.9
    # a link that carried a tenth of the D's requests, beside the D's stray misses elsewhere (31 % before)
    assert _windows_read_as_a_link("link", 0.1, 100) > 0.85


def test_a_link_keeps_its_misses_beside_the_ds_stray_ones() -> None:
    """Every request through one of four Ps into a D missed (10), and 6 of the 90 through the others: the
    link held only 62 % of the D's misses, and read as the D's queue; it is the link, the rest the D's."""
    window, i = healthy(30), 1000
    for p, (missed, requests) in {"prefill-0": (10, 10), "prefill-1": (2, 30), "prefill-2": (2, 30)}.items():
        for k in range(requests):
            window.append(rec(i, p, "decode-9", handoff=0.8 if k < missed else 0.05))
            i += 1
    window += [rec(i + k, "prefill-3", "decode-9", handoff=0.8 if k < 2 else 0.05) for k in range(30)]
    a = run(window)
    assert [(g.stage, g.place, g.count) for g in a.groups] == [
        ("handoff", "prefill-0->decode-9", 10),
        ("d_queue", "decode-9", 6),
    ]


@pytest.mark.parametrize(
    "through",
    [
        {"prefill-0": (14, 14), "prefill-1": (1, 4), "prefill-2": (1, 4)},  # every request of the link missed
        {"prefill-0": (9, 25), "prefill-1": (1, 25), "prefill-2": (0, 25), "prefill-3": (0, 25)},
        {"prefill-0": (10, 20), "prefill-1": (1, 20)},  # one stray miss beside the link's
    ],
)
def test_a_bad_link_beside_a_few_stray_misses_is_the_link(through: dict[str, tuple[int, int]]) -> None:
    """(misses, requests) into decode-9 through each P: the first P's pair is the link (a review's cases,
    which the rule against the pairs' requests or against only the pairs with a miss read as the D)."""
    window, i = healthy(30), 1000
    for p, (missed, requests) in through.items():
        for k in range(requests):
            window.append(rec(i, p, "decode-9", handoff=0.8 if k < missed else 0.05))
            i += 1
    assert (run(window).top[0].stage, run(window).top[0].place) == ("handoff", "prefill-0->decode-9")


def test_a_ps_slow_row_stays_its_own_beside_a_ds_stray_misses() -> None:
    """prefill-1's NIC, slow toward every D, and two stray misses into decode-0 through prefill-0 (a
    review's case): decode-0's misses are spread, prefill-1's pair there holds its own, and the P's row
    rule still takes it: every link out of prefill-1 (the pair held in the D's column had stayed a link)."""
    nic = [rec(1000 + k, "prefill-1", DS[k % 3], handoff=0.8) for k in range(60)]
    stray = [rec(1800 + k, "prefill-0", "decode-0", handoff=0.8) for k in range(2)]
    a = run(healthy(120) + nic + stray)
    assert (a.top[0].stage, a.top[0].place, a.top[0].count) == ("handoff", "prefill-1->*", 60)


def test_a_busy_window_of_many_ps_counts_its_chances_without_overflow() -> None:
    """20 Ps into one D, 2,400 requests, 1,000 and more missed (a review's case: the binomial coefficients
    overflowed a float and the whole window's attribution failed)."""
    rng = random.Random(5)
    window = []
    for k in range(2400):
        p = f"prefill-{rng.randrange(20)}"
        window.append(rec(k, p, "decode-1", handoff=0.8 if p == "prefill-0" or rng.random() < 0.45 else 0.05))
    a = run(window)
    assert a.missed > 1000
    assert (a.top[0].stage, a.top[0].place) == ("d_queue", "decode-1")


def test_attempts_whose_p_is_not_known_hold_no_link() -> None:
    """decode-1 refuses: failed attempts from prefill-0 and prefill-1, two each, and eight from a P not
    known (a review's case): every link into decode-1, not a pair "?->decode-1"."""
    attempts = [
        retried(
            100 + k,
            replace(decode_attempt(100 + k, p=p, at=0.5, took=0.2), kind="connect"),
            admission=0.71,
        )
        for k, p in enumerate(["prefill-0", "prefill-1", None, None] * 2 + [None] * 4)
    ]
    a = run(healthy(30) + attempts)
    assert [(g.stage, g.place, g.count) for g in a.groups] == [("retry", "*->decode-1", 12)]


@pytest.mark.parametrize(("ps", "missed"), [(20, 0.9), (2, 0.95), (2, 1.0)])
def test_a_d_whose_requests_nearly_all_missed_is_the_ds(ps: int, missed: float) -> None:
    """A D's queue where (nearly) every request missed, through 20 Ps alike or 2 Ps at 4:1 (a review's
    cases: a pair of few requests that all missed looked held against the few met elsewhere)."""
    rng = random.Random(3)
    window = [r for r in healthy(30) if r.d_instance != "decode-1"]
    for k in range(200):
        p = f"prefill-{rng.randrange(ps)}" if ps > 2 else ("prefill-0" if rng.random() < 0.8 else "prefill-1")
        window.append(rec(1000 + k, p, "decode-1", handoff=0.8 if rng.random() < missed else 0.05))
    a = run(window)
    assert {g.place for g in a.groups} == {"decode-1"}


def test_a_p_slower_itself_under_a_ds_queue_is_no_link() -> None:
    """A D's queue slows every handoff alike (0.3 s); prefill-0's prefill is 150 ms slower than
    prefill-1's, so its requests miss and the other P's meet theirs: every miss fell on one pair, whose
    handoffs were slow as often as the other's. The D's queue, not a link (it was the link)."""
    window = [r for r in healthy(30) if r.d_instance != "decode-1"]
    for k in range(40):
        p = PS[k % 2]
        window.append(rec(1000 + k, p, "decode-1", handoff=0.3, prefill=0.25 if p == "prefill-0" else 0.1))
    a = run(window)
    assert {g.place for g in a.groups if g.stage in ("handoff", "d_queue")} == {"decode-1"}
    assert {g.place for g in a.groups if g.stage == "prefill"} == {"prefill-0"}


def test_slow_handoffs_are_judged_by_every_served_requests_handoff() -> None:
    """Over several pairs: a P slower itself (150 ms), its requests' handoffs 0.3 s like the other P's
    under the D's queue, and a few of both Ps' slower still: the misses crowd onto prefill-0's pair, its
    slow handoffs do not. A timed-out request's 30 s span through prefill-0 is no handoff of it."""
    window = [r for r in healthy(30) if r.d_instance != "decode-1"]
    for k in range(60):
        p = PS[k % 2]
        h = 0.6 if k % 10 in (0, 1) else 0.3
        window.append(rec(1000 + k, p, "decode-1", handoff=h, prefill=0.25 if p == "prefill-0" else 0.1))
    late = rec(
        2000, "prefill-0", "decode-1", handoff=30.0, status="timeout", first_token=False, error="timeout"
    )
    a = run([*window, late])
    assert "prefill-0->decode-1" not in {g.place for g in a.groups if g.cause == "slow"}
    assert ("d_queue", "decode-1") in {(g.stage, g.place) for g in a.groups}


def test_a_link_into_a_d_whose_handoffs_spread_wide_is_the_link() -> None:
    """The D's usual handoffs spread from 20 ms to 300 ms (KV sizes follow prompts); every request through
    prefill-0 takes 0.45 s and misses (a review's case: against 1.5x the median alone, a third of the
    other P's usual handoffs counted slow and the link read as the D's queue)."""
    usual = (0.02, 0.04, 0.06, 0.1, 0.2, 0.25, 0.3)
    window = [r for r in healthy(30) if r.d_instance != "decode-1"]
    for k in range(28):
        p = PS[k % 2]
        window.append(rec(1000 + k, p, "decode-1", handoff=0.45 if p == "prefill-0" else usual[k // 2 % 7]))
    a = run(window)
    assert (a.top[0].stage, a.top[0].place) == ("handoff", "prefill-0->decode-1")


def test_a_failed_requests_span_is_no_slow_handoff() -> None:
    """A link's 10 slow handoffs, and 8 requests through the other P that timed out after 30 s: counted as
    slow handoffs they would make that P's pair slow often enough for the link's to read as the D's."""
    link = [rec(1000 + k, "prefill-0", "decode-1", handoff=0.8) for k in range(10)]
    calm = [rec(1100 + k, "prefill-1", "decode-1") for k in range(10)]
    late = [
        rec(
            1200 + k,
            "prefill-1",
            "decode-1",
            handoff=30.0,
            status="timeout",
            first_token=False,
            error="timeout",
        )
        for k in range(8)
    ]
    a = run([r for r in healthy(30) if r.d_instance != "decode-1"] + link + calm + late)
    assert ("handoff", "prefill-0->decode-1", "slow") in {(g.stage, g.place, g.cause) for g in a.groups}


def test_attempts_with_no_p_into_one_d_are_every_link_into_it() -> None:
    """Decode-only retries: every failed attempt into decode-1 has no P (a review's case: a lone pair
    "?->decode-1" held them, and along the row of "?" they read as "every link out of ?")."""
    attempts = [
        retried(
            100 + k,
            replace(decode_attempt(100 + k, p=None, at=0.5, took=0.2), kind="connect"),
            admission=0.71,
        )
        for k in range(6)
    ]
    a = run(healthy(30) + attempts)
    assert [(g.stage, g.place, g.count) for g in a.groups] == [("retry", "*->decode-1", 6)]
