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


def _incompatible(*pairs: tuple[str, str]) -> list[dict[str, object]]:
    return [
        {"prefill": p, "decode": d, "reason": "IncompatiblePair", "since": 1.0, "text": "incompatible: x"}
        for p, d in pairs
    ]


async def test_a_mixed_fleet_sends_every_handoff_through_a_compatible_pair_and_never_probes_another() -> None:
    """A rollout: p0 and d0 run one revision, p1 and d1 another, d2 neither (compatible with nobody). With
    probes due at every pick, no handoff crosses revisions and d2 gets no request at all."""
    async with fake_fleet(2, 3) as fleet:
        p, d = fleet.prefill, fleet.decode
        served = table(
            [(f"p{i}", "prefill", "prefill", x.url, 1.0, False) for i, x in enumerate(p)]
            + [(f"d{i}", "decode", "decode", x.url, 1.0, False) for i, x in enumerate(d)]
        )
        served["avoid_pairs"] = _incompatible(("p0", "d1"), ("p1", "d0"), ("p0", "d2"), ("p1", "d2"))
        ctl = FakeController(served)
        async with serve(ctl.app()) as ctl_url:
            settings = make_settings(
                [x.url for x in p],
                [x.url for x in d],
                proxy={"controller_url": ctl_url, "pair_probe_s": 0.001},
            )
            async with running_proxy(settings) as (url, app), httpx.AsyncClient(timeout=10) as client:
                await async_wait_until("a fresh routing table", lambda: app.parts.routing.state == "fresh")
                view = app.parts.routing.view
                assert [t.name for t in view.decode] == ["d0", "d1"]  # d2: no partner, left out
                for i in range(80):
                    body = {"model": "fake", "prompt": f"request {i} a b c", "max_tokens": 2}
                    assert (await client.post(url + "/v1/completions", json=body)).status_code == 200
    pairs = Counter(
        (c["body"]["kv_transfer_params"]["remote_engine_id"].removeprefix("engine-"), dx.name)
        for dx in d
        for c in dx.calls
        if isinstance(c["body"], dict) and c["body"].get("kv_transfer_params")
    )
    assert set(pairs) == {("p0", "d0"), ("p1", "d1")}, pairs
    assert min(pairs.values()) > 10, pairs
    assert not d[2].calls


def test_a_p_that_may_be_paired_with_no_d_is_left_out_of_the_view() -> None:
    from pdscope.routing import RoutingTable
    from proxy.routing import table_view

    served = table(
        [
            ("p0", "prefill", "prefill", "http://p0", 1.0, False),
            ("p1", "prefill", "prefill", "http://p1", 1.0, False),
            ("d0", "decode", "decode", "http://d0", 1.0, False),
        ]
    )
    served["avoid_pairs"] = [
        *_incompatible(("p0", "d0")),
        {"prefill": "p1", "decode": "d0", "reason": "StalePeerAfterRestart", "since": 1.0},
    ]
    settings = make_settings(["http://p0", "http://p1"], ["http://d0"])
    view = table_view(RoutingTable.model_validate(served), settings)
    assert [t.name for t in view.prefill] == ["p1"] and [t.name for t in view.decode] == ["d0"]
    assert view.never == {"p0": frozenset({"d0"})} and view.avoid == {"p1": frozenset({"d0"})}
