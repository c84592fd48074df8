"""Attribute by evidence (issue 14, finding 2): a stuck D's expired leases are charged to it and only
to it; expiries no waiting handoff explains are shown and charge no one."""

from __future__ import annotations

from typing import Any

import pytest

from collector import forensics
from controller.loop import Reconciler
from controller.policy import AlertConfig
from controller.wiring import default_effects
from store.db import transaction
from tests.controller.conftest import World
from tests.controller.seed import Seeder, all_pairs, settings_yaml

LEASE_S = 6.0
HEALTHY = ("decode-0", "decode-1", "decode-2")


def _world(store_url: str, world: World) -> World:
    settings = settings_yaml(store_url)
    settings = settings.model_copy(
        update={"controller": settings.controller.model_copy(update={"kv_lease_s": LEASE_S})}
    )
    rec = Reconciler(
        settings,
        world.factory,
        effects=default_effects(settings, world.factory, clock=world.clock),
        clock=world.clock,
        alert_config=AlertConfig(for_s={}),
    )
    return World(settings, world.factory, world.clock, Seeder(world.factory, settings), rec, world.notifier)


def _run(w: World, steps: int, stuck_from: int | None, expired_per_step: float = 0.0) -> list[Any]:
    """Every 2 s: a scrape, one request per P x D pair, forensics, one tick. From ``stuck_from`` on,
    decode-3 stops pulling: its requests time out at the proxy (no first token) and each P's lease for them
    expires LEASE_S after P finished -- in the scrape steps where the healthy handoffs finish too."""
    stuck_p_done: list[tuple[str, float]] = []
    outs = []
    for k in range(steps):
        now = w.clock.advance(2.0)
        scrape_ts = now - 0.5
        expired = {p: expired_per_step for p in ("prefill-0", "prefill-1")}
        for p, p_done in list(stuck_p_done):
            if p_done + LEASE_S <= scrape_ts:
                expired[p] += 1.0
                stuck_p_done.remove((p, p_done))
        w.seeder.scrape(
            scrape_ts,
            prefill_0={"expired": expired["prefill-0"]},
            prefill_1={"expired": expired["prefill-1"]},
        )
        healthy_pairs = [
            (p, d) for p, d in all_pairs() if stuck_from is None or k < stuck_from or d != "decode-3"
        ]
        w.seeder.requests(now - 1.9, healthy_pairs)
        if stuck_from is not None and k >= stuck_from:
            pairs = [("prefill-0", "decode-3"), ("prefill-1", "decode-3")]
            w.seeder.requests(now - 1.9, pairs, status="timeout", handoff_s={"decode-3": 4.0})
            stuck_p_done += [(p, now - 1.9 + 0.001 + 0.2) for p, _ in pairs]
        with transaction(w.factory) as s:
            forensics.run_pass(s, now - 300, now, lease_s=LEASE_S)
        outs.append(w.reconciler.tick())
    return outs


def test_a_stuck_ds_expired_leases_are_charged_to_it_and_healthy_ds_are_never_cut(
    store_url: str, world: World
) -> None:
    w = _world(store_url, world)
    outs = _run(w, 20, stuck_from=3)
    obs = w.reconciler.view().obs
    assert obs is not None
    d3 = obs.instance("decode-3")
    assert d3 is not None and d3.lease_expiry_suspects > 0 and d3.failed_requests > 0
    for name in HEALTHY:
        inst = obs.instance(name)
        assert inst is not None and inst.lease_expiry_suspects == 0 and inst.failed_requests == 0, name
    for out in outs:  # never charged, never cut, on any tick
        for d in out.weights:
            if d.instance in HEALTHY:
                assert d.weight == 1.0 and d.reason not in ("LeaseExpiries", "TransferFailures"), d.message
    d3_decisions = [next(d for d in o.weights if d.instance == "decode-3") for o in outs]
    assert min(d.weight for d in d3_decisions) <= 0.1
    assert {"LeaseExpiries", "RequestFailures"} & {d.reason for d in d3_decisions}
    last = d3_decisions[-1]
    assert last.inputs["lease_expiry_suspects"] > 0 and last.scores["errors"] < 1.0
    assert obs.unattributed_lease_expiries == 0


def test_expiries_no_waiting_request_explains_cut_nobody_and_say_so(store_url: str, world: World) -> None:
    w = _world(store_url, world)
    outs = _run(w, 10, stuck_from=None, expired_per_step=1.0)  # leases expire; every handoff finished in time
    for out in outs:
        for d in out.weights:
            assert d.weight == 1.0, d.message
    last = outs[-1]
    p0 = next(d for d in last.weights if d.instance == "prefill-0")
    assert p0.reason == "UnattributedLeaseExpiries" and p0.inputs["unattributed_lease_expiries"] > 0
    assert "no instance is charged" in p0.message
    assert all(d.inputs["unattributed_lease_expiries"] > 0 for d in last.weights if d.target is not None)
    obs = w.reconciler.view().obs
    assert obs is not None and all(i.lease_expiry_suspects == 0 for i in obs.instances)


@pytest.mark.parametrize("kind", ["stream_error", "no_done", "timeout"])
def test_a_ds_own_failed_requests_count_against_it_not_its_p(store_url: str, world: World, kind: str) -> None:
    """A decode failure (the proxy's in-band ``stream_error``, a stream without [DONE], a timeout) is D's:
    charged to the record's D once decode began, never to the P that prefilled it."""
    w = _world(store_url, world)
    for _ in range(6):
        now = w.clock.advance(2.0)
        w.seeder.scrape(now - 0.5)
        w.seeder.requests(now - 1.9, all_pairs())
        w.seeder.requests(
            now - 1.8,
            [("prefill-0", "decode-1"), ("prefill-1", "decode-1")] * 2,
            status="timeout" if kind == "timeout" else "error",
        )
        out = w.reconciler.tick()
    obs = w.reconciler.view().obs
    assert obs is not None
    d1, p0 = obs.instance("decode-1"), obs.instance("prefill-0")
    assert d1 is not None and p0 is not None and d1.failed_requests > 0 and p0.failed_requests == 0
    d = next(x for x in out.weights if x.instance == "decode-1")
    assert d.weight < 1.0 and d.reason == "RequestFailures"
    assert all(x.weight == 1.0 for x in out.weights if x.instance != "decode-1")
