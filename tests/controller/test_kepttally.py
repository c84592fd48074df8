"""The evidence tally kept between ticks equals the tally of a whole read of the same records."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from controller.policy import evidence as ev
from controller.policy.charges import RecordFacts, charge_of
from controller.policy.kepttally import KeptTally
from store.queries import is_client_error

POOLS: dict[str, ev.Role] = {"P": "prefill", "D": "decode"}


def _maybe(rng: random.Random, value: float) -> float | None:
    return None if rng.random() < 0.15 else value


def _record(rng: random.Random, t_in: float) -> RecordFacts:
    """A record of every kind the rules tell apart: refused, failed at P or D, unpulled, served."""
    p_sent = t_in + rng.random() * 0.2
    p_done = p_sent + rng.random()
    d_sent = p_sent + rng.random() * 0.1
    first = p_done + rng.random() * 0.5
    status = rng.choice(["ok", "ok", "ok", "error", "timeout", "cancelled", "rejected"])
    return RecordFacts(
        p_instance=rng.choice(["p0", "p1", "p2", None]),
        d_instance=rng.choice(["d0", "d1", "p1", None]),  # p1 also as a D: one name, both slots
        p_pool=rng.choice(["P", "P", "other", None]),
        d_pool=rng.choice(["D", "D", "P", None]),
        status=status,
        http_status=rng.choice([None, None, 400, 429, 500]),
        proxy_in=t_in,
        p_sent=_maybe(rng, p_sent),
        p_done=_maybe(rng, p_done),
        d_sent=_maybe(rng, d_sent),
        first_token=_maybe(rng, first),
        done=_maybe(rng, first + 1.0),
        ttft_s=_maybe(rng, first - t_in),
        kv_bytes=rng.choice([None, 4096, 8192]),
        error=rng.choice([None, "upstream_status_503", "upstream_timeout"]),
        lease_expiry_suspect=rng.choice([None, False, True]),
        p_queue_s=_maybe(rng, rng.random() * 0.1),
        request_id=rng.choice([None, "", f"r{rng.randrange(10**6)}"]),
    )


def _whole(records: dict[int, RecordFacts], now: float, restarted: dict[str, float]) -> ev.WindowTally:
    """What a whole read builds: every record charged, in (arrival, id) order."""
    t = ev.WindowTally(POOLS, now, restarted)
    for _, rid in sorted((r.proxy_in or 0.0, rid) for rid, r in records.items()):
        r = records[rid]
        t.add(r, is_client_error(r.status, r.http_status))
    return t


def _lists(by: dict[object, list[float]]) -> dict[object, list[float]]:
    return {k: sorted(v) for k, v in by.items() if v}


def assert_same(kept: ev.WindowTally, whole: ev.WindowTally) -> None:
    """Every figure equal; each list the same values (the order is not read)."""
    assert kept.instances.keys() == whole.instances.keys()
    for name, w in whole.instances.items():
        k = kept.instances[name]
        assert (k.requests, k.failed, k.refused, k.unpulled) == (w.requests, w.failed, w.refused, w.unpulled)
        assert k.unpulled_ids == w.unpulled_ids
        assert sorted(k.contribution) == sorted(w.contribution) and sorted(k.handoff) == sorted(w.handoff)
        assert (ev.mean(k.contribution), ev.rse(k.handoff)) == (ev.mean(w.contribution), ev.rse(w.handoff))
    for name, w_pool in whole.pools.items():
        k_pool = kept.pools[name]
        assert k_pool.done == w_pool.done
        for attr in ("residence", "kv_bytes", "service_ttft", "unqueued_ttft"):
            assert sorted(getattr(k_pool, attr)) == sorted(getattr(w_pool, attr)), attr
        assert ev.mean(k_pool.residence) == ev.mean(w_pool.residence)
    for attr in ("ttft_by_pair", "service_by_pair", "unqueued_by_pair"):
        assert _lists(getattr(kept, attr)) == _lists(getattr(whole, attr)), attr
    assert sorted(kept.handoffs) == sorted(whole.handoffs)
    assert Counter(kept.charged_handoffs) == Counter(whole.charged_handoffs)
    for attr in ("pair_failures", "failed_since_restart", "served_since_restart"):
        k_counts = {p: n for p, n in getattr(kept, attr).items() if n}
        assert k_counts == {p: n for p, n in getattr(whole, attr).items() if n}, attr
    assert (kept.first_in, kept.last_in) == (whole.first_in, whole.last_in)


@pytest.mark.parametrize("seed", range(8))
def test_records_added_updated_and_removed_tally_as_a_whole_read_of_those_left(seed: int) -> None:
    rng = random.Random(seed)
    kept, records = KeptTally(), {}
    for step in range(300):
        rid = rng.randrange(60)
        if rng.random() < 0.25:
            kept.remove(rid)
            records.pop(rid, None)
        else:
            r = records[rid] = _record(rng, rng.choice([1.0, 2.0, float(step) / 10]))  # ties in arrival
            kept.add(rid, charge_of(r, is_client_error(r.status, r.http_status)))
        if step % 25 == 0:
            now, restarted = 50.0, {"p1": rng.random() * 20, "p0": 100.0}
            assert_same(kept.tally(POOLS, now, restarted), _whole(records, now, restarted))
    assert len(kept) == len(records)
    for rid in list(records):
        kept.remove(rid)
    assert_same(kept.tally(POOLS, 9.0, None), ev.WindowTally(POOLS, 9.0))
    assert not kept.tally(POOLS, 9.0, None).instances  # nothing names an instance any more


def test_a_fresh_tally_each_time_so_a_ticks_own_charges_do_not_stay() -> None:
    kept = KeptTally()
    r = _record(random.Random(1), 1.0)._replace(status="ok", p_instance="p0", d_instance="d0")
    kept.add(7, charge_of(r, False))
    first = kept.tally(POOLS, 5.0, None)
    first.charge_failed_attempts([{"instance": "d0", "kind": "timeout"}])
    assert first.instances["d0"].failed == 1
    assert kept.tally(POOLS, 5.0, None).instances["d0"].failed == 0
