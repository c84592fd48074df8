"""A down or cut instance's peers keep their weight (issue 29, item 3).

When a member of a pool is down or cut, the others take its load. Their queues and hold times rise
from it, not from a fault: cut for it, they only pass the same load on again, and the pool is left
shorter still. Each case builds one tick by hand: three Ps, one of which is down, cut, or avoided
by the proxies (it got a tenth of its peers' requests), and a
healthy P that took more of its load than the third (a queue twice the others', the same speed per
request, finishing as much).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from controller.policy import InstanceSignals, Observation, PolicyConfig, WeightDecision
from controller.policy.weights import WeightState, decide_weights, shedding
from pdscope.reasons import Reason
from tests.controller.replay import T0, fleet

CFG = PolicyConfig.defaults()
LOADED = {"contribution_s": 0.6, "ttft_mean_s": 0.6, "queue_mean_s": 0.4, "ttft_recent_s": 0.6}


def _tick(
    changes: dict[str, dict[str, object]], prev: dict[str, WeightState] | None = None
) -> dict[str, WeightDecision]:
    """One tick over 3P+2D; every P finished 20 requests over the last three scrapes and spends 0.2 s
    per request working, unless ``changes`` say otherwise."""
    insts: list[InstanceSignals] = []
    for i in fleet(3, 2):
        if i.role == "prefill":
            i = replace(i, queue_mean_s=0.0, load_done=20.0)
        insts.append(replace(i, **changes.get(i.name, {})))  # type: ignore[arg-type]
    obs = Observation(now=T0, window_s=30.0, instances=tuple(insts), newest_data=T0)
    return {d.instance: d for d in decide_weights(obs, prev or {}, CFG)}


DOWN = {"up": False, "down_for_s": 60.0}


def _cutting(d: WeightDecision) -> bool:
    """Lowered, or on its way (a mild target is confirmed on the next tick first)."""
    return d.weight < 1.0 or (d.target is not None and d.target < 1.0 and "confirming" in d.message)


def test_without_a_shift_a_p_with_twice_its_peers_queue_is_cut() -> None:
    """The baseline the rule changes: the same queue with every peer up and at full weight cuts."""
    got = _tick({"prefill-0": LOADED})
    assert _cutting(got["prefill-0"]) and got["prefill-0"].reason == Reason.SLOW_PREFILL


@pytest.mark.parametrize(
    "shed",
    [
        pytest.param({"prefill-2": DOWN}, id="peer-down"),
        pytest.param({}, id="peer-cut"),
        pytest.param({"prefill-2": {"requests": 4}}, id="peer-avoided-by-the-proxies"),
    ],
)
def test_the_peer_that_took_the_load_of_a_down_or_cut_one_keeps_its_weight(
    shed: dict[str, dict[str, object]],
) -> None:
    prev = {} if shed else {"prefill-2": WeightState(weight=0.4, smoothed=0.4, reason=Reason.SLOW_PREFILL)}
    got = _tick({"prefill-0": LOADED, **shed}, prev)
    d = got["prefill-0"]
    assert not _cutting(d) and d.target == 1.0 and d.reason != Reason.SLOW_PREFILL
    shifts = {k: v for k, v in d.inputs.items() if k.endswith("_load_shift")}
    assert shifts and all("from the load prefill-2 shed (down, cut or avoided" in v for v in shifts.values())
    assert got["prefill-1"].weight == 1.0


def test_a_peer_that_finishes_far_less_than_the_others_is_still_cut_while_load_shifts() -> None:
    """Slow, not loaded: it finishes a fifth of what its peers do (a stuck one finishes nothing)."""
    got = _tick({"prefill-0": {**LOADED, "load_done": 4.0, "hold_time_now_s": 4.0}, "prefill-2": DOWN})
    assert _cutting(got["prefill-0"])


def test_a_peer_slower_per_request_is_cut_on_its_speed_while_load_shifts() -> None:
    """Its own work per request (TTFT less queue) is not load: three times its peers' is cut."""
    slow = {"contribution_s": 0.6, "ttft_mean_s": 0.6, "queue_mean_s": 0.0, "ttft_recent_s": 0.6}
    got = _tick({"prefill-0": slow, "prefill-2": DOWN})
    assert _cutting(got["prefill-0"]) and got["prefill-0"].scores["speed"] < 0.5


def test_a_peer_carrying_the_load_of_a_cut_one_is_not_cut_on_its_speed() -> None:
    """Seen on the bench: 2P+4D, one P cut for failing transfers sends a trickle, and the other,
    finishing five times what the cut one does, is slower per request from its larger batches."""
    carrying = {**LOADED, "queue_mean_s": 0.0, "load_done": 60.0}
    got = _tick({"prefill-0": carrying, "prefill-2": DOWN})
    d = got["prefill-0"]
    assert not _cutting(d) and "speed_load_shift" in d.inputs
    # the same per-request time while it finishes what its peers do: slow, not loaded (the case above)
    assert _cutting(_tick({"prefill-0": {**carrying, "load_done": 20.0}, "prefill-2": DOWN})["prefill-0"])


def test_the_ends_of_a_blamed_pair_shed_load_onto_their_peers() -> None:
    """The proxies route around a slow pair: its P sends less (and its D gets less), and the others take
    it. Seen on the bench, 4P+2D: two healthy Ps cut on `SlowPrefill` for the load one P's slow link to
    one D moved onto them."""
    insts = tuple(replace(i, requests=20) for i in fleet(3, 2))
    obs = Observation(now=T0, window_s=30.0, instances=insts, newest_data=T0)
    assert shedding(obs, {}, CFG) == {}
    ends = {"prefill-2": ["decode-1"], "decode-1": ["prefill-2"]}
    assert shedding(obs, {}, CFG, ends) == {"prefill": ["prefill-2"], "decode": ["decode-1"]}
