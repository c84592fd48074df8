"""observe(): the store window, read into one Observation."""

from __future__ import annotations

import pytest

from controller import observe as observe_mod
from controller.kept import PairMemo
from controller.observe import observe
from store.db import transaction
from store.models import UNREACHABLE
from store.queries import HandoffStats
from tests.controller.conftest import World
from tests.controller.seed import all_pairs


def test_observation_from_a_seeded_store(world: World) -> None:
    for i in range(5):
        now = world.clock.advance(2.0)
        world.seeder.scrape(
            now - 0.5,
            decode_2={
                "xfer_s": 0.1,
                "failed": 3.0,
                "kv_cache_usage": 0.9,
                "kv_fetch_in_progress": 4.0,
                "kv_fetch_waiting_to_start": 3.0,
            },
            decode_0={"kv_fetch_waiting_to_start": 1.0},
            decode_1={"kv_fetch_completed_waiting": 1.0},
            prefill_1={"expired": 1.0, "num_waiting": float(i)},
            decode_3={"up": i < 4, "error": UNREACHABLE + "ConnectError: refused"},
            prefill_0={"up": i != 3},
        )
        world.seeder.requests(
            now - 1.9,
            all_pairs(),
            handoff_s={"decode-2": 0.5},
            prefill_s={"prefill-0": 0.6},
            suspect={"decode-2"},
        )
    now = world.clock()
    with transaction(world.factory) as s:
        obs = observe(s, world.settings, now)
    assert obs.now == now and obs.window_s == 10.0
    assert obs.newest_data == pytest.approx(now - 0.5)
    with world.factory() as s:  # the records' clock: the newest record's arrival at the proxy
        from sqlalchemy import func, select

        from store.models import RequestRecord

        newest_in = s.scalar(select(func.max(RequestRecord.proxy_in)))
    assert newest_in is not None and obs.records_until == newest_in
    d2 = obs.instance("decode-2")
    assert d2 is not None and d2.up is True
    assert d2.nixl_xfer_mean_s == pytest.approx(0.1)
    assert d2.failed_transfers_per_min == pytest.approx(3.0 * 4 / 8.0 * 60.0)  # 4 increments over 8 s
    # waiting at D: 3 for their pull to start; its load, every stage: 3 + the 4 pulling
    assert d2.kv_usage == 0.9 and d2.handoff_backlog == 3.0 and d2.load_now == 7.0
    assert d2.handoff_p50_s == pytest.approx(0.5) and d2.lease_expiry_suspects == 10
    assert d2.contribution_s == pytest.approx(0.499)  # d_sent .. first token
    p0 = obs.instance("prefill-0")
    assert p0 is not None and p0.contribution_s == pytest.approx(0.6)
    assert p0.handoff_p50_s is not None and p0.lease_expiry_suspects == 0
    p1 = obs.instance("prefill-1")
    assert p1 is not None and p1.expired_leases_per_min == pytest.approx(1.0 * 4 / 8.0 * 60.0)
    d3 = obs.instance("decode-3")
    assert (
        d3 is not None and d3.up is False and d3.unreachable_scrapes == 1
    )  # its last scrape could not connect
    p0 = obs.instance("prefill-0")
    assert (
        p0 is not None and p0.up is True and p0.unreachable_scrapes == 0
    )  # a scrape that failed, then an up one
    d0 = obs.instance("decode-0")
    assert d0 is not None and d0.nixl_xfer_mean_s == pytest.approx(0.01) and d0.failed_transfers_per_min == 0
    assert d0.requests == 10 and d0.failed_requests == 0

    # a pair's handoffs of the last handoff_recent_s (5 s) by first token: those of the last two batches
    pair = next(x for x in obs.pairs if (x.p_instance, x.d_instance) == ("prefill-1", "decode-2"))
    assert pair.requests == 5 and pair.recent_requests == 2 and pair.recent_p50_s == pytest.approx(0.5)

    pools = {p.name: p for p in obs.pools}
    dec = pools["decode"]
    assert dec.completed_per_s == pytest.approx(40 / 10.0)
    assert dec.inflight_requests is not None and dec.inflight_requests > 0
    # median(3, 1, 1) x 3 members: decode-2's own backlog is its weight's business; decode-3 is down; the
    # pulls in progress (1 on each D, 4 on decode-2) are the links' time, not a queue at D
    assert dec.handoff_backlog_requests == pytest.approx(1.0 * 3)
    assert dec.mean_kv_bytes_per_request == 1_000_000
    assert pools["prefill"].handoff_backlog_requests is None
    # P queue gauges at the latest scrape: prefill-1 has 4 waiting, prefill-0 none; the lower median x 2
    # members is 0 (one P's queue is the weights' business)
    assert pools["prefill"].waiting_now == pytest.approx(0.0)
    assert pools["prefill"].running_now == pytest.approx(4.0 + 4.0)
    assert dec.waiting_now is None
    # TTFT without the 1 ms between proxy in and P sent (the seeder's admission wait)
    svc = pools["prefill"].service_ttft_at_slo_s
    assert (
        svc is not None
        and obs.slo.ttft_at_slo_s is not None
        and svc == pytest.approx(obs.slo.ttft_at_slo_s - 0.001)
    )
    # the fast load signal: running + waiting at P's latest scrape, the KV-fetch backlog at D's (every stage)
    assert p1.load_now == 4.0 + 4 and d2.load_now == 4.0 + 3 and d0.load_now == 1.0 + 1

    assert {(p.p_instance, p.d_instance) for p in obs.pairs} == set(all_pairs())
    slow_pair = next(p for p in obs.pairs if p.d_instance == "decode-2")
    assert slow_pair.handoff_p50_s == pytest.approx(0.5)
    assert obs.slo.completed == 40 and obs.slo.met == 40 and obs.slo.attainment == 1.0
    assert obs.slo.handoff_p99_s == pytest.approx(0.5)
    assert obs.slo.ttft_at_slo_s is not None and obs.slo.ttft_at_slo_s > 0.5


def test_pool_service_ttft_is_not_one_slow_instance(world: World) -> None:
    """One slow D (the weights' business) slows a quarter of the pairs: the pool's service TTFT is the
    lower median over the pairs, not the pooled p99 that those requests alone make; the unqueued
    TTFT takes P's queue time out of it."""
    for _ in range(12):
        now = world.clock.advance(1.0)
        world.seeder.scrape(now - 0.2)
        world.seeder.requests(
            now - 0.5, all_pairs(), handoff_s={"decode-2": 3.0}, queue_s={"prefill-0": 0.1, "prefill-1": 0.1}
        )
    with transaction(world.factory) as s:
        obs = observe(s, world.settings, world.clock())
    pools = {p.name: p for p in obs.pools}
    assert (
        obs.slo.ttft_at_slo_s is not None and obs.slo.ttft_at_slo_s > 3.0
    )  # the pooled percentile: decode-2's
    for name in ("prefill", "decode"):
        # 0.001 admission + 0.2 prefill + 0.05 handoff, less the admission wait
        assert pools[name].service_ttft_at_slo_s == pytest.approx(0.25)
        assert pools[name].unqueued_ttft_at_slo_s == pytest.approx(0.15)  # less P's 0.1 s in its queue


def test_empty_store_observes_unknowns(world: World) -> None:
    with transaction(world.factory) as s:
        obs = observe(s, world.settings, world.clock())
    assert obs.newest_data is None and obs.data_age_s is None
    assert all(i.up is None for i in obs.instances)
    assert len(obs.instances) == 6 and obs.slo.completed == 0


@pytest.mark.parametrize(
    ("handoff", "prefill", "overloaded"),
    [
        ({"decode-2": 3.0}, None, False),  # one slow D: 2 of 8 pairs
        (None, {"prefill-0": 3.0}, False),  # one slow P: 4 of 8 pairs
        ({f"decode-{i}": 3.0 for i in range(4)}, None, True),  # every pair slow: overload
    ],
)
def test_pool_ttft_is_the_lower_median_of_pairs_so_one_slow_instance_is_not_overload(
    world: World, handoff: dict[str, float] | None, prefill: dict[str, float] | None, overloaded: bool
) -> None:
    for _ in range(6):  # two requests per P x D pair every 2 s: 10+ per pair in the 10 s window
        now = world.clock.advance(2.0)
        world.seeder.scrape(now - 0.5)
        for k in (1.9, 0.9):
            world.seeder.requests(now - k, all_pairs(), handoff_s=handoff, prefill_s=prefill)
    with transaction(world.factory) as s:
        obs = observe(s, world.settings, world.clock())
    pools = {p.name: p for p in obs.pools}
    assert obs.slo.ttft_at_slo_s is not None and obs.slo.ttft_at_slo_s > 3.0  # the fleet's p99 does see them
    for pool in ("prefill", "decode"):
        ttft = pools[pool].ttft_at_slo_s
        assert ttft is not None and (ttft > 3.0 if overloaded else ttft < 1.0), (pool, ttft)


def test_the_observation_measures_the_ttft_predictions(world: World) -> None:
    """The records' predicted TTFT against their observed one: how many, and the median error, for the
    TTFTMispredicted alert; records without a prediction are not counted."""
    from sqlalchemy import select, update

    from store.models import RequestRecord

    now = world.clock.advance(2.0)
    world.seeder.scrape(now - 0.5)
    world.seeder.requests(now - 1.9, all_pairs())
    with transaction(world.factory) as s:
        obs = observe(s, world.settings, now)
    assert obs.slo.predictions == 0 and obs.slo.prediction_error_p50 is None
    rr = RequestRecord
    with transaction(world.factory) as s:
        ids = sorted(s.scalars(select(rr.id)))
        # 5 predicted at half their TTFT (error 1.0), 2 exactly (error 0), the rest without a prediction
        s.execute(update(rr).where(rr.id.in_(ids[:5])).values(predicted_ttft_s=rr.ttft_s / 2))
        s.execute(update(rr).where(rr.id.in_(ids[5:7])).values(predicted_ttft_s=rr.ttft_s))
    with transaction(world.factory) as s:
        obs = observe(s, world.settings, now)
    assert obs.slo.predictions == 7
    assert obs.slo.prediction_error_p50 == pytest.approx(1.0)


def test_a_pairs_signals_are_the_same_object_while_what_they_are_made_of_is() -> None:
    """The memo kept between ticks: a pair whose handoff figures are the same object (kept until its
    handoffs change) and whose other fields are equal keeps its signals object, so the tick record dumps it
    once; any change makes it anew, and the signals are those made without the memo either way."""
    ab, cd = HandoffStats("a->b", 2, 0.1, 0.2, 0.3, 0.15, 0), HandoffStats("c->d", 1, 0.4, 0.4, 0.4, 0.4, 0)
    memo: PairMemo = {}
    first = observe_mod._pairs({"a->b": ab, "c->d": cd}, {}, memo=memo)
    again = observe_mod._pairs({"a->b": ab, "c->d": cd}, {}, memo=memo)
    assert again == first == observe_mod._pairs({"a->b": ab, "c->d": cd}, {})
    assert again[0] is first[0] and again[1] is first[1]
    ab2 = HandoffStats("a->b", 3, 0.1, 0.2, 0.3, 0.15, 0)  # a handoff joined: new figures
    moved = observe_mod._pairs({"a->b": ab2, "c->d": cd}, {("c", "d"): 1}, memo=memo)
    assert moved == observe_mod._pairs({"a->b": ab2, "c->d": cd}, {("c", "d"): 1})
    assert moved[0] is not again[0] and moved[0].requests == 3
    assert moved[1] is not again[1] and moved[1].failures == 1  # the same figures, a failure more
    assert set(memo) == {("a", "b"), ("c", "d")}
    assert observe_mod._pairs({"c->d": cd}, {("c", "d"): 1}, memo=memo)[0] is moved[1] and set(memo) == {
        ("c", "d")
    }
