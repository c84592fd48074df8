"""simulator.fit: synthetic windows with known engines and degradations -> the fitted fleet (table tests)."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field, replace

import pytest

from simulator.faults import FaultSpec
from simulator.fit import FitError, FitParams, RequestObs, SnapshotObs, fit

T0 = 1_700_000_000.0
ROLES = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}
PROMPT, OUTPUT = 2048, 32
KV_BYTES = PROMPT * 327680
BW = 2.5e9
OVERHEAD = 0.010
RATE = 16000.0
PREFILL_S = OVERHEAD + PROMPT / RATE  # one step
WIRE_S = KV_BYTES / BW
HANDOFF_S = WIRE_S + 2 * OVERHEAD
TPOT_S = OVERHEAD


@dataclass(frozen=True)
class Deg:
    """A degradation from ``start`` to ``end`` seconds: ``factor`` on an instance or a (P, D) pair."""

    who: str | tuple[str, str]
    factor: float
    start: float = 0.0
    end: float = math.inf


@dataclass(frozen=True)
class World:
    degs: tuple[Deg, ...] = ()
    seconds: float = 40.0
    every_s: float = 0.125
    queue_jitter: bool = False  # some degraded samples also wait in a queue (only adds time)
    drop: frozenset[str] = field(default_factory=frozenset)  # instances no request reaches


def _factor(w: World, who: str | tuple[str, str], t: float) -> float:
    f = 1.0
    for d in w.degs:
        if d.who == who and d.start <= t < d.end:
            f *= d.factor
    return f


def records(w: World) -> list[RequestObs]:
    rng = random.Random(3)
    out = []
    ps = [p for p in ("p0", "p1") if p not in w.drop]
    ds = [d for d in ("d0", "d1") if d not in w.drop]
    pairs = itertools.cycle([(p, d) for p in ps for d in ds])
    n = int(w.seconds / w.every_s)
    for i in range(n):
        t = i * w.every_s
        p, d = next(pairs)
        wait = rng.choice([0.0, 0.0, 0.5, 1.5]) if w.queue_jitter else 0.0
        link = _factor(w, (p, d), t)
        handoff = WIRE_S * link + 2 * OVERHEAD + (wait if link > 1 else 0.0)
        prefill = PREFILL_S * _factor(w, p, t) + (wait if _factor(w, p, t) > 1 else 0.0)
        tpot = TPOT_S * _factor(w, d, t)
        ttft = prefill + handoff
        out.append(
            RequestObs(
                arrival=T0 + t,
                status="ok",
                prompt_tokens=PROMPT,
                output_tokens=OUTPUT,
                p=p,
                d=d,
                ttft_s=ttft,
                tpot_s=tpot,
                p_prefill_s=prefill,
                handoff_s=handoff,
                kv_bytes=KV_BYTES,
            )
        )
    return out


def snapshots(w: World) -> list[SnapshotObs]:
    """Each healthy D moves 10 GB in 4 s of transfer over the window; d1's link is 4x slower."""
    return [
        SnapshotObs("d0", T0, 0.0, 0.0),
        SnapshotObs("d0", T0 + w.seconds, 4.0, 4.0 * BW),
        SnapshotObs("d1", T0, 1.0, 1e9),
        SnapshotObs("d1", T0 + w.seconds, 5.0, 1e9 + BW),
    ]


def _kinds(faults: tuple[FaultSpec, ...]) -> list[tuple[str, tuple[str, ...]]]:
    return [(f.kind, tuple(sorted(f.instances()))) for f in faults]


CASES = [
    # name, world, expected faults [(kind, instances, factor, at, end)]
    ("healthy", World(), []),
    ("slow P from 10 s", World((Deg("p1", 5.0, 10.0),)), [("slow", ("p1",), 5.0, 10.0, 40.0)]),
    (
        "slow link 10..25 s",
        World((Deg(("p0", "d1"), 8.0, 10.0, 25.0),)),
        [("slow_link", ("d1", "p0"), 8.0, 10.0, 25.0)],
    ),
    ("slow D 20..30 s", World((Deg("d0", 3.0, 20.0, 30.0),)), [("slow", ("d0",), 3.0, 20.0, 30.0)]),
    (
        "slow link with queueing behind it",
        World((Deg(("p1", "d0"), 8.0, 15.0),), queue_jitter=True),
        [("slow_link", ("d0", "p1"), 8.0, 15.0, 40.0)],
    ),
    (
        "two at once",
        World((Deg("p0", 4.0, 5.0, 20.0), Deg(("p1", "d1"), 6.0, 25.0))),
        [("slow", ("p0",), 4.0, 5.0, 20.0), ("slow_link", ("d1", "p1"), 6.0, 25.0, 40.0)],
    ),
    ("under the ratio: no fault", World((Deg("p0", 1.3, 10.0),)), []),
]


@pytest.mark.parametrize(("name", "world", "expected"), CASES, ids=[c[0] for c in CASES])
def test_fit_finds_the_degradations(name: str, world: World, expected: list[tuple]) -> None:
    got = fit(records(world), ROLES, T0, T0 + world.seconds, snapshots=snapshots(world))
    assert _kinds(got.faults) == [(k, i) for k, i, *_ in expected], got.faults
    for f, (_, _, factor, at, end) in zip(got.faults, expected, strict=True):
        assert f.factor == pytest.approx(factor, rel=0.05), f
        assert f.at == pytest.approx(at, abs=got.bucket_s)
        assert f.at + (f.duration or 0) == pytest.approx(end, abs=got.bucket_s)


def _hit(r: RequestObs, cached: int, factor: float) -> RequestObs:
    """``r`` as a prefix-cache hit on a P ``factor`` times slow: P computed only what was not cached."""
    computed = PROMPT - cached
    return replace(r, p_cached_tokens=cached, p_prefill_s=factor * (OVERHEAD + computed / RATE))


def test_a_prefix_cache_hit_inside_a_slow_spell_does_not_end_it() -> None:
    w = World((Deg("p1", 5.0, 10.0),))
    recs = records(w)
    # p1's samples from 10 s, every fourth one a hit of 2,032 cached tokens (the CI run of stop 46 had one)
    slow = [i for i, r in enumerate(recs) if r.p == "p1" and r.arrival - T0 >= 10.0]
    for i in slow[2::4]:
        recs[i] = _hit(recs[i], 2032, 5.0)
    got = fit(recs, ROLES, T0, T0 + w.seconds, snapshots=snapshots(w))
    assert [(f.kind, f.at) for f in got.faults] == [("slow", pytest.approx(10.0, abs=got.bucket_s))]
    assert got.faults[0].factor == pytest.approx(5.0, rel=0.05)
    # read per prompt token, the same hits look 13x faster than the slow P and cut its spell in pieces
    unknown = [replace(r, p_cached_tokens=None) for r in recs]
    cut = fit(unknown, ROLES, T0, T0 + w.seconds, snapshots=snapshots(w))
    assert [f.at for f in cut.faults] != [f.at for f in got.faults]


def test_a_partly_cached_prompt_is_read_per_token_computed() -> None:
    w = World()
    recs = [_hit(r, 512, 1.0) if i % 2 else r for i, r in enumerate(records(w))]  # a quarter cached
    got = fit(recs, ROLES, T0, T0 + w.seconds, snapshots=snapshots(w))
    assert got.faults == ()
    for p in ("p0", "p1"):  # the per-token time of what P computed: the engine's rate, within the overhead
        assert got.instances[p].prefill_tokens_per_s == pytest.approx(RATE, rel=0.05)


def test_fit_recovers_the_engines() -> None:
    w = World((Deg(("p0", "d1"), 8.0, 10.0),))
    got = fit(records(w), ROLES, T0, T0 + w.seconds, snapshots=snapshots(w))
    for p in ("p0", "p1"):
        assert got.instances[p].prefill_tokens_per_s == pytest.approx(RATE, rel=0.01)
    for d in ("d0", "d1"):
        assert got.instances[d].step_overhead_s == pytest.approx(OVERHEAD, rel=0.01)
    assert got.step_overhead_s == pytest.approx(OVERHEAD)
    assert got.link_bandwidth_bytes_per_s == pytest.approx(BW)  # the fastest D's, not d1's
    assert got.typical_handoff_s == pytest.approx(HANDOFF_S)
    sim = got.simulator_section()
    assert sim["link_bandwidth_bytes_per_s"] == pytest.approx(BW)
    assert set(sim["instances"]) == set(ROLES)
    assert got.notes == ()


def test_a_p_slow_for_the_whole_window_is_a_slower_engine_not_a_fault() -> None:
    w = World((Deg("p1", 2.0),))
    got = fit(records(w), ROLES, T0, T0 + w.seconds, snapshots=snapshots(w))
    assert got.faults == ()
    slow, fast = got.instances["p1"].prefill_tokens_per_s, got.instances["p0"].prefill_tokens_per_s
    assert slow is not None and fast is not None
    # the step: 2 * (overhead + tokens / rate) = overhead + tokens / fitted rate
    assert PROMPT / slow + OVERHEAD == pytest.approx(2 * PREFILL_S, rel=0.01)
    assert fast == pytest.approx(RATE, rel=0.01)


def test_without_snapshots_the_bandwidth_comes_from_the_handoff() -> None:
    w = World()
    got = fit(records(w), ROLES, T0, T0 + w.seconds)
    # handoff = wire + 2 overheads; the fit takes wire = handoff - 1.5 overheads
    assert got.link_bandwidth_bytes_per_s == pytest.approx(KV_BYTES / (HANDOFF_S - 1.5 * OVERHEAD))
    assert any("bandwidth from the handoff" in n for n in got.notes)


def test_an_instance_no_request_reached_keeps_the_defaults_and_says_so() -> None:
    w = World(drop=frozenset({"p1"}))
    got = fit(records(w), ROLES, T0, T0 + w.seconds, snapshots=snapshots(w))
    assert got.instances["p1"].prefill_tokens_per_s is None
    assert "p1" not in got.simulator_section()["instances"]
    assert any(n.startswith("p1:") for n in got.notes)


def test_the_workload() -> None:
    w = World(seconds=20.0, every_s=0.5)
    got = fit(records(w), ROLES, T0, T0 + w.seconds, params=FitParams(bucket_s=5.0))
    assert len(got.arrivals) == 40
    assert got.rate_per_bucket == (2.0, 2.0, 2.0, 2.0)
    assert got.interarrival_cv == pytest.approx(0.0)  # evenly spaced
    assert got.prompt_quantiles["p50"] == PROMPT and got.output_quantiles["p99"] == OUTPUT
    assert got.arrivals[3].at == pytest.approx(1.5)


def test_missing_lengths_take_the_median() -> None:
    recs = records(World(seconds=5.0))
    recs[0] = RequestObs(arrival=recs[0].arrival, status="rejected")
    got = fit(recs, ROLES, T0, T0 + 5.0)
    assert (got.arrivals[0].prompt_tokens, got.arrivals[0].output_tokens) == (PROMPT, OUTPUT)


@pytest.mark.parametrize(
    ("duration", "max_s", "k"), [(40.0, 120.0, 1), (120.0, 120.0, 1), (121.0, 120.0, 2), (600.0, 120.0, 5)]
)
def test_compression(duration: float, max_s: float, k: int) -> None:
    w = World(seconds=duration, every_s=1.0, degs=(Deg("p0", 5.0, duration / 2),))
    got = fit(records(w), ROLES, T0, T0 + duration, params=FitParams(bucket_s=duration / 8))
    assert got.compression(max_s) == k
    trace = got.replay_trace(k)
    assert len(trace) == math.ceil(len(got.arrivals) / k)
    assert max(a.at for a in trace) <= max_s
    [f] = got.scenario(k)
    assert f.at == pytest.approx(got.faults[0].at / k)
    assert f.duration == pytest.approx((got.faults[0].duration or 0) / k)


def test_compression_needs_a_positive_bound() -> None:
    got = fit(records(World(seconds=5.0)), ROLES, T0, T0 + 5.0)
    with pytest.raises(ValueError, match="positive"):
        got.compression(0)


@pytest.mark.parametrize(
    ("recs", "roles", "lo", "hi", "message"),
    [
        (records(World(seconds=5.0)), ROLES, T0, T0, "window is empty"),
        ([], ROLES, T0, T0 + 5, "no request record"),
        (records(World(seconds=5.0)), ROLES, T0 + 100, T0 + 200, "no request record"),
        (records(World(seconds=5.0)), {"p0": "prefill"}, T0, T0 + 5, "no prefill or no decode"),
    ],
)
def test_nothing_to_fit(
    recs: list[RequestObs], roles: dict[str, str], lo: float, hi: float, message: str
) -> None:
    with pytest.raises(FitError, match=message):
        fit(recs, roles, lo, hi)


def test_a_drained_instance_s_trickle_still_shows_its_degradation() -> None:
    """After the controller cuts a slow P, it gets one request in eight: too few for any bucket, a
    spell of consecutive slow samples all the same."""
    w = World((Deg("p1", 5.0, 10.0),))
    recs = [
        r
        for i, r in enumerate(records(w))
        if not (r.p == "p1" and r.arrival >= T0 + 10.0 and i % 16 not in (1, 3))
    ]
    sparse = [r for r in recs if r.p == "p1" and r.arrival >= T0 + 10.0]
    assert 0 < len(sparse) / 6 < FitParams().min_samples  # per 5 s bucket
    got = fit(recs, ROLES, T0, T0 + w.seconds, snapshots=snapshots(w))
    assert _kinds(got.faults) == [("slow", ("p1",))]
    assert got.faults[0].factor == pytest.approx(5.0, rel=0.05)
    assert got.faults[0].at == pytest.approx(10.0, abs=1.0)


def test_a_blip_shorter_than_the_spell_is_no_fault() -> None:
    w = World((Deg(("p0", "d0"), 8.0, 10.0, 13.0),))
    assert fit(records(w), ROLES, T0, T0 + w.seconds, snapshots=snapshots(w)).faults == ()
    got = fit(
        records(w), ROLES, T0, T0 + w.seconds, snapshots=snapshots(w), params=FitParams(min_spell_s=2.0)
    )
    assert _kinds(got.faults) == [("slow_link", ("d0", "p0"))]
