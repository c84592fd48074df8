"""Avoided P x D pairs: the table's avoid_pairs are left out of picks, with a probe now and then."""

from __future__ import annotations

from collections import Counter

import httpx

from proxy.pairs import PairProbes
from tests.proxy.conftest import fake_fleet, make_settings, running_proxy
from tests.support.controllers import FakeController, table
from tests.support.serving import serve
from tests.support.waiting import async_wait_until

AVOID = {"p0": frozenset({"d0"})}


def test_an_avoided_pair_is_left_out_until_its_probe_is_due_and_never_leaves_nothing() -> None:
    probes = PairProbes(probe_s=10.0)
    assert probes.left_out(AVOID, "p0", ["d0", "d1"], 100.0) == {"d0"}  # first seen: the clock starts
    assert probes.left_out(AVOID, "p1", ["d0", "d1"], 100.0) == frozenset()  # another P's pairs are fine
    assert probes.left_out(AVOID, "p0", ["d0", "d1"], 109.9) == {"d0"}
    assert probes.left_out(AVOID, "p0", ["d0", "d1"], 110.0) == frozenset()  # due a probe
    assert not probes.picked(AVOID, "p0", "d1", 110.0)  # the pick went elsewhere: still due
    assert probes.left_out(AVOID, "p0", ["d0", "d1"], 111.0) == frozenset()
    assert probes.picked(AVOID, "p0", "d0", 111.0)  # the probe
    assert probes.left_out(AVOID, "p0", ["d0", "d1"], 112.0) == {"d0"}
    assert probes.left_out(AVOID, "p0", ["d0"], 112.0) == frozenset()  # the only D: never stop serving
    assert probes.left_out({}, "p0", ["d0", "d1"], 112.0) == frozenset()


async def test_the_proxy_sends_no_handoff_through_an_avoided_pair() -> None:
    async with fake_fleet(2, 2) as fleet:
        p, d = fleet.prefill, fleet.decode
        served = table(
            [
                ("p0", "prefill", "prefill", p[0].url, 1.0, False),
                ("p1", "prefill", "prefill", p[1].url, 1.0, False),
                ("d0", "decode", "decode", d[0].url, 1.0, False),
                ("d1", "decode", "decode", d[1].url, 1.0, False),
            ]
        )
        served["avoid_pairs"] = [
            {
                "prefill": "p0",
                "decode": "d0",
                "reason": "StalePeerAfterRestart",
                "since": 1.0,
                "text": "stale",
            }
        ]
        ctl = FakeController(served)
        async with serve(ctl.app()) as ctl_url:
            settings = make_settings(
                [x.url for x in p],
                [x.url for x in d],
                proxy={"controller_url": ctl_url, "pair_probe_s": 3600},
            )
            async with running_proxy(settings) as (url, app), httpx.AsyncClient(timeout=10) as client:
                await async_wait_until("a fresh routing table", lambda: app.parts.routing.state == "fresh")
                for i in range(120):
                    body = {"model": "fake", "prompt": f"request {i} a b c", "max_tokens": 2}
                    assert (await client.post(url + "/v1/completions", json=body)).status_code == 200
    pairs = Counter(
        (c["body"]["kv_transfer_params"]["remote_engine_id"].removeprefix("engine-"), dx.name)
        for dx in d
        for c in dx.calls
        if isinstance(c["body"], dict) and c["body"].get("kv_transfer_params")
    )
    assert pairs[("p0", "d0")] == 0, pairs
    assert pairs[("p0", "d1")] > 20 and pairs[("p1", "d0")] > 10, pairs
