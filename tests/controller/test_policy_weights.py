"""Policy weight behaviour as a table of cases replayed on a virtual clock."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from controller.policy import PolicyConfig
from tests.controller.replay import Changes, Replay, Timeline, replay

CFG = PolicyConfig.defaults()


def slow_d(factor: float, start: int = 1, end: int | None = None, name: str = "decode-2") -> Timeline:
    def tl(tick: int) -> Changes:
        if tick >= start and (end is None or tick < end):
            return {
                name: {
                    "handoff_p50_s": 0.05 * factor,
                    "contribution_s": 0.06 * factor,
                    "nixl_xfer_mean_s": 0.01 * factor,
                }
            }
        return {}

    return tl


def noisy(seed: int, spread: float, recent_spread: float = 0.3) -> Timeline:
    """Window means within ±spread; the 3-scrape means (fewer samples) within ±recent_spread."""
    rng = random.Random(seed)

    def tl(tick: int) -> Changes:
        out: dict[str, dict[str, float]] = {}
        for i in range(4):
            f = 1.0 + rng.uniform(-spread, spread)
            g = 1.0 + rng.uniform(-recent_spread, recent_spread)
            out[f"decode-{i}"] = {
                "handoff_p50_s": 0.05 * f,
                "nixl_xfer_mean_s": 0.01 * f,
                "nixl_recent_s": 0.01 * g,
            }
        for i in range(2):
            f = 1.0 + rng.uniform(-spread, spread)
            g = 1.0 + rng.uniform(-recent_spread, recent_spread)
            out[f"prefill-{i}"] = {"contribution_s": 0.2 * f, "ttft_recent_s": 0.2 * g}
        return out

    return tl


def combine(*tls: Timeline) -> Timeline:
    def tl(tick: int) -> Changes:
        out: dict[str, dict[str, object]] = {}
        for t in tls:
            for k, v in t(tick).items():
                out.setdefault(k, {}).update(v)
        return out

    return tl


def at(ticks: range, name: str, **changes: object) -> Timeline:
    return lambda tick: {name: changes} if tick in ticks else {}


def steps_within_max(r: Replay) -> bool:
    for o in r.outputs:
        for d in o.weights:
            if d.reason != "InstanceDown" and abs(d.weight - d.old_weight) > CFG.max_weight_step + 1e-9:
                return False
    return True


def changes(ws: list[float]) -> int:
    return sum(1 for a, b in itertools.pairwise(ws) if abs(a - b) > 1e-9)


@dataclass(frozen=True)
class Case:
    name: str
    timeline: Timeline
    ticks: int
    check: Callable[[Replay], None]


def _degraded(r: Replay) -> None:
    w = r.weights("decode-2")
    assert w[0] < 1.0, "the first tick that sees the slow handoff lowers the weight"
    assert w[2] <= 0.5, f"within 3 ticks the weight is at most half: {w[:3]}"
    assert min(w) >= CFG.min_weight
    assert r.reasons("decode-2")[0] in ("SlowHandoff", "SlowKVTransfer")
    for other in ("decode-0", "decode-1", "decode-3", "prefill-0", "prefill-1"):
        assert set(r.weights(other)) == {1.0}, other
    assert steps_within_max(r)
    d = r.decision(1, "decode-2")
    assert "target = max(" in d.arithmetic and "smoothed =" in d.arithmetic and "weight =" in d.arithmetic
    assert d.scores["handoff"] < 0.2 and d.inputs["handoff_observed"] == pytest.approx(0.5)


def _recovers(r: Replay) -> None:
    w = r.weights("decode-2")
    low = w[9]  # degraded for ticks 1..10
    assert low <= 0.2
    # healthy from tick 11: no raise before recover_ticks healthy ticks in a row
    assert w[10] == low and w[11] == low, w[9:14]
    assert "HoldingForHysteresis" in r.reasons("decode-2")[10:13]
    assert w[-1] == 1.0
    rises = [b - a for a, b in itertools.pairwise(w[10:]) if b > a]
    assert rises and max(rises) <= CFG.max_weight_step + 1e-9
    assert steps_within_max(r)
    # Back quickly to where it was last cut (0.25, cut from there to the floor); past it, one step per
    # 30 s window (15 ticks), so the window sees it at each new share before the next
    ceiling = 0.25
    at_ceiling = next(i for i, x in enumerate(w) if i > 10 and x >= ceiling - 1e-9)
    assert at_ceiling <= 17, w[10:20]
    raises_above = [i for i in range(at_ceiling + 1, len(w)) if w[i] > w[i - 1] + 1e-9]
    assert len(raises_above) == 3 and all(
        b - a >= 15 for a, b in itertools.pairwise([at_ceiling, *raises_above])
    )
    assert "HoldingAfterRaise" in r.reasons("decode-2")[at_ceiling:]


def _no_flap(r: Replay) -> None:
    for n in ("decode-0", "decode-1", "decode-2", "decode-3", "prefill-0", "prefill-1"):
        assert changes(r.weights(n)) == 0, (n, r.weights(n))


def _floor(r: Replay) -> None:
    w = r.weights("decode-2")
    assert min(w) == pytest.approx(CFG.min_weight)
    assert w[-1] == pytest.approx(CFG.min_weight)
    assert all(x >= CFG.min_weight - 1e-9 for x in w)


def _down(r: Replay) -> None:
    w = r.weights("decode-1")
    assert w[2] == 0.0 and r.reasons("decode-1")[2] == "InstanceDown", "down -> 0 at once, not by max step"
    assert w[3] == 0.0
    assert w[5] == pytest.approx(CFG.min_weight) and r.reasons("decode-1")[5] == "InstanceUp"
    assert w[-1] == 1.0, w
    assert all(b - a <= CFG.max_weight_step + 1e-9 for a, b in itertools.pairwise(w[5:]))


def _scrape_blip(r: Replay) -> None:
    assert set(r.weights("decode-1")) == {1.0}
    assert r.reasons("decode-1")[2:4] == ["ScrapeFailing", "ScrapeFailing"]


def _refused(r: Replay) -> None:
    w = r.weights("decode-1")
    assert w[2] == 1.0 and r.reasons("decode-1")[2] == "ScrapeFailing", "one refused scrape is a blip"
    assert w[3] == 0.0 and r.reasons("decode-1")[3] == "InstanceDown", w
    assert "could not connect" in r.decision(4, "decode-1").message


def _too_few(r: Replay) -> None:
    assert set(r.weights("decode-2")) == {1.0}


def _slow_p(r: Replay) -> None:
    w = r.weights("prefill-1")
    assert w[-1] < 0.6 and w[-1] >= CFG.min_weight, w
    assert r.reasons("prefill-1")[0] == "SlowPrefill"
    assert set(r.weights("prefill-0")) == {1.0}


def _slow_p_stays_at_its_speed(r: Replay) -> None:
    w = r.weights("prefill-1")
    # 3x slower per request: its share goes to about a third, and stays there once the cut has emptied its
    # queue and its latency reads within tolerance again (it used to be raised back into its queue)
    assert 0.3 <= w[-1] <= 0.4, w
    assert "Recovering" not in r.reasons("prefill-1")[6:], r.reasons("prefill-1")
    assert max(w[8:]) - min(w[8:]) < 0.05, w
    d = r.decision(len(w) - 1, "prefill-1")
    assert d.scores["speed"] == pytest.approx(0.2 / 0.6, abs=1e-3) and d.scores["ttft"] == 1.0
    assert set(r.weights("prefill-0")) == {1.0}


def _uniform(r: Replay) -> None:
    for n in ("decode-0", "decode-1", "decode-2", "decode-3"):
        assert set(r.weights(n)) == {1.0}, "a uniformly slow pool keeps equal weights"


def _kv(r: Replay) -> None:
    w = r.weights("decode-0")
    assert w[-1] < 0.5 and r.reasons("decode-0")[0] == "KVCachePressure"


def _leases(r: Replay) -> None:
    assert r.reasons("decode-3")[0] == "LeaseExpiries"
    assert r.weights("decode-3")[-1] < 0.6


def _failures(r: Replay) -> None:
    assert r.reasons("decode-0")[0] == "TransferFailures"
    assert r.weights("decode-0")[-1] < 0.6


def _backlog_first(r: Replay) -> None:
    w = r.weights("decode-2")
    assert r.reasons("decode-2")[0] == "Backlog", r.reasons("decode-2")[:3]
    assert w[0] == 1.0 and w[1] < 1.0, "a fast signal alone: confirmed on the second tick, then lowered"
    assert w[2] <= 0.5, w[:4]
    d = r.decision(1, "decode-2")
    assert (
        d.scores["load"] == pytest.approx(0.4) and d.scores["handoff"] == 1.0
    )  # before any slow request finished
    assert "spends 15.00s there now" in d.message
    for other in ("decode-0", "decode-1", "decode-3"):
        assert set(r.weights(other)) == {1.0}, other


def _cut_at_once(r: Replay, name: str, reason: str = "Backlog") -> None:
    w, why = r.weights(name), r.reasons(name)
    assert w[0] < 1.0 and why[0] == reason, (w, why)


def _cut_on_second_tick(r: Replay, name: str, reason: str = "Backlog") -> None:
    """A fast (last three scrapes) signal alone: the first tick confirms, the second cuts."""
    w, why = r.weights(name), r.reasons(name)
    assert w[0] == 1.0 and why[0] == reason and "confirming" in r.decision(1, name).message, (w, why)
    assert w[1] < 1.0 and why[1] == reason, (w, why)


def _load_noise(r: Replay) -> None:
    for n in ("decode-0", "decode-1", "decode-2", "decode-3", "prefill-0", "prefill-1"):
        assert changes(r.weights(n)) == 0, (n, r.weights(n))


def _breaks_slo(r: Replay) -> None:
    w = r.weights("decode-2")
    assert w[-1] == pytest.approx(CFG.min_weight), w
    d = r.decision(1, "decode-2")
    assert d.scores["handoff"] == 0.0 and "over the TTFT target" in d.message


def _awaits_evidence(r: Replay) -> None:
    # slow ticks 1..5 floor it; from tick 6 it looks healthy, but with 2 requests a window that is
    # no evidence: it stays at the floor until probe_after_s (30 s = 15 ticks) after the last cut.
    w, why = r.weights("decode-2"), r.reasons("decode-2")
    last_cut = max(i for i in range(1, len(w)) if w[i] < w[i - 1])
    assert w[last_cut] == pytest.approx(CFG.min_weight)
    probe = last_cut + int(CFG.probe_after_s / CFG.interval_s)
    assert set(w[last_cut:probe]) == {CFG.min_weight}, w
    assert "AwaitingEvidence" in why[last_cut + 1 : probe]
    assert w[-1] > CFG.min_weight, "after the probe time it may rise again"


def _all_down(r: Replay) -> None:
    for i in range(4):
        assert set(r.weights(f"decode-{i}")) == {1.0}
        assert set(r.reasons(f"decode-{i}")[1:8]) == {"RoleUnobservable"}


def _no_data(r: Replay) -> None:
    assert set(r.weights("decode-2")) == {1.0}
    assert set(r.reasons("decode-2")) == {"NoData"}


def poisson(rng: random.Random, mean: float) -> float:
    """A Poisson draw (Knuth): how many requests an instance holds at a random instant."""
    limit, k, p = math.exp(-mean), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return float(k)


def load_noise(
    seed: int, d_mean: float, p_mean: float, d_done: float = 10.0, p_done: float = 15.0
) -> Timeline:
    """Poisson requests held now and Poisson completions over 3 s, as ``controller.observe`` turns them
    into a hold time (held ÷ finished per second)."""
    rng = random.Random(seed)

    def hold(mean_held: float, mean_done: float) -> dict[str, float]:
        held = poisson(rng, mean_held)
        return {"load_now": held, "hold_time_now_s": held / (max(poisson(rng, mean_done), 0.5) / 3.0)}

    def tl(tick: int) -> Changes:
        out: dict[str, dict[str, float]] = {f"decode-{i}": hold(d_mean, d_done) for i in range(4)}
        out.update({f"prefill-{i}": hold(p_mean, p_done) for i in range(2)})
        return out

    return tl


CASES = [
    Case("degraded D loses weight within 3 ticks", slow_d(10.0), 8, _degraded),
    Case("recovers only after healthy ticks (hysteresis)", slow_d(10.0, 1, 11), 70, _recovers),
    Case("±25% noise never changes a weight", noisy(7, 0.25), 150, _no_flap),
    Case("±25% noise, another seed", noisy(11, 0.25), 150, _no_flap),
    Case("one 2.5x spike in one window moves nothing", slow_d(2.5, 5, 6), 20, _no_flap),
    Case(
        "a hopeless D stays at the floor",
        combine(slow_d(1000.0), at(range(1, 99), "decode-2", failed_transfers_per_min=50.0)),
        20,
        _floor,
    ),
    Case(
        "down -> 0 at once; back -> floor, then ramps",
        at(range(3, 6), "decode-1", up=False, down_for_s=60.0),
        30,
        _down,
    ),
    Case(
        "a scrape failing for less than down_after_s holds the weight",
        at(range(3, 5), "decode-1", up=False, down_for_s=4.0),
        8,
        _scrape_blip,
    ),
    Case(
        "one scrape that cannot connect holds the weight too",
        at(range(3, 5), "decode-1", up=False, down_for_s=1.0, unreachable_scrapes=1),
        8,
        _scrape_blip,
    ),
    Case(
        "two scrapes in a row that cannot connect: down before down_after_s",
        combine(
            at([3], "decode-1", up=False, down_for_s=1.0, unreachable_scrapes=1),
            at([4, 5], "decode-1", up=False, down_for_s=2.0, unreachable_scrapes=2),
        ),
        12,
        _refused,
    ),
    Case(
        "too few requests to compare: handoff is ignored",
        at(range(1, 99), "decode-2", handoff_p50_s=5.0, requests=3, queue_mean_s=None),
        8,
        _too_few,
    ),
    Case("a 3x slower P loses weight", at(range(1, 99), "prefill-1", contribution_s=0.6), 15, _slow_p),
    Case(
        "a 3x slower P keeps a share that follows its speed when its queue empties",
        combine(
            at(range(0, 99), "prefill-0", queue_mean_s=0.0),
            at(range(1, 6), "prefill-1", contribution_s=0.6, ttft_mean_s=0.6, queue_mean_s=0.0),
            at(
                range(6, 99),
                "prefill-1",
                contribution_s=0.24,
                ttft_recent_s=0.24,
                ttft_mean_s=0.6,
                queue_mean_s=0.0,
            ),
        ),
        25,
        _slow_p_stays_at_its_speed,
    ),
    Case(
        "a uniformly slow D pool keeps equal weights",
        combine(*(slow_d(5.0, name=f"decode-{i}") for i in range(4))),
        10,
        _uniform,
    ),
    Case("KV usage near 100% costs weight", at(range(1, 99), "decode-0", kv_usage=0.99), 10, _kv),
    Case(
        "expired leases attributed to a D",
        at(range(1, 99), "decode-3", lease_expiry_suspects=10),
        10,
        _leases,
    ),
    # 10/min is 5 in the 30 s window: past min_error_events (3); one or two failures alone are not evidence
    Case(
        "failed NIXL transfers cost weight",
        at(range(1, 99), "decode-0", failed_transfers_per_min=10.0),
        10,
        _failures,
    ),
    Case(
        "two failed NIXL transfers in a window are not evidence",
        at(range(1, 99), "decode-0", failed_transfers_per_min=4.0),
        10,
        _load_noise,
    ),
    Case("an instance never scraped keeps its weight", at(range(1, 99), "decode-2", up=None), 5, _no_data),
    # 5 held, 1 transfer finished in 3 s: 15 s per request against 2 x its peers' (floor: 1 s) x the noise
    # margin of one completion (1 + 2/sqrt(1) = 3): a limit of 6 s
    Case(
        "a D holding KV fetches it does not finish loses weight before any slow request finishes",
        at(range(1, 99), "decode-2", load_now=5.0, hold_time_now_s=15.0, load_done=1.0),
        6,
        _backlog_first,
    ),
    # the same 5 s a request over 3 completions is inside the noise margin (2 x (1 + 2/sqrt(3)) = 4.3... 5 s
    # only just over it): it costs at most a mild cut, never the floor
    Case(
        "5 s a request over only three completions is no evidence for a deep cut",
        at(range(1, 99), "decode-2", load_now=5.0, hold_time_now_s=5.0, load_done=3.0),
        6,
        lambda r: min(r.weights("decode-2")) >= 0.75 or pytest.fail(str(r.weights("decode-2"))),
    ),
    Case(
        (
            "a P 4.5x slower in vLLM's last-3-scrapes TTFT loses weight before the window's mean moves "
            "(2nd tick)"
        ),
        at(range(1, 99), "prefill-1", ttft_recent_s=0.9),
        3,
        lambda r: _cut_on_second_tick(r, "prefill-1", "SlowPrefill"),
    ),
    Case(
        "a D's NIXL transfers 5x slower over the last 3 scrapes cost weight before the window's mean moves",
        at(range(1, 99), "decode-1", nixl_recent_s=0.05),
        3,
        lambda r: _cut_on_second_tick(r, "decode-1", "SlowKVTransfer"),
    ),
    # 4 held, 2 finished in 3 s: 6 s a request against its peer's 0.8 s (floor 1 s) x 2 x (1 + 2/sqrt(2))
    Case(
        "a P the proxy balances (as many requests held as its peer) but finishing fewer loses weight",
        at(range(1, 99), "prefill-1", hold_time_now_s=6.0, load_done=2.0),
        3,
        lambda r: _cut_on_second_tick(r, "prefill-1"),
    ),
    Case(
        "a stuck P (holding requests, finishing none: 18 s a request) loses weight at once",
        at(range(1, 99), "prefill-1", hold_time_now_s=18.0),
        3,
        lambda r: _cut_at_once(r, "prefill-1"),
    ),
    Case(
        "a D holding 1.5x its peers' time per request (under the 2x tolerance) keeps its weight",
        combine(
            *(at(range(1, 99), f"decode-{i}", hold_time_now_s=1.4) for i in range(4)),
            at(range(1, 99), "decode-2", hold_time_now_s=2.1),
        ),
        10,
        _load_noise,
    ),
    Case(
        "Poisson in-flight counts (mean 1 at D, 2.5 at P) never change a weight",
        load_noise(3, 1.0, 2.5),
        300,
        _load_noise,
    ),
    Case("the same, another seed", load_noise(5, 1.0, 2.5), 300, _load_noise),
    Case("a D whose handoff alone is over the TTFT target goes to the floor", slow_d(60.0), 12, _breaks_slo),
    Case(
        "a floored D with too few requests to judge waits for the probe time",
        combine(slow_d(60.0, 1, 6), at(range(6, 99), "decode-2", requests=2, nixl_transfers=1.0)),
        30,
        _awaits_evidence,
    ),
    Case(
        "every D failing its scrapes at once holds the weights",
        combine(*(at(range(2, 9), f"decode-{i}", up=False, down_for_s=60.0) for i in range(4))),
        10,
        _all_down,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_weight_policy(case: Case) -> None:
    case.check(replay(case.timeline, case.ticks, cfg=CFG))


def test_stale_data_holds_every_weight() -> None:
    r = replay(slow_d(10.0), 6, stale=lambda tick: tick >= 3)
    w = r.weights("decode-2")
    assert w[1] < 1.0
    assert w[2:] == [w[1]] * 4
    assert set(r.reasons("decode-2")[2:]) == {"StaleData"}


def test_replay_is_deterministic() -> None:
    a = replay(noisy(3, 0.8), 40)
    b = replay(noisy(3, 0.8), 40)
    assert [o.table for o in a.outputs] == [o.table for o in b.outputs]


def test_routing_version_moves_only_when_the_table_changes() -> None:
    r = replay(slow_d(10.0, 3), 12)
    versions = [o.table.version for o in r.outputs]
    assert versions[0] == 1 and versions[1] == 1, "no change, no new version"
    assert versions[2] == 2
    for o in r.outputs:
        assert o.table_changed == (
            o is r.outputs[0] or o.table.version != r.outputs[r.outputs.index(o) - 1].table.version
        )
