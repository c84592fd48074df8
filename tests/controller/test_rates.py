"""The rates the controller fits and serves in the routing table (controller.rates, the loop, the API)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from controller.api import create_app
from controller.rates import RatesGate, moved, rounded
from pdscope.routing import InstanceRate, PairRate, Rates
from store.db import transaction
from store.models import RequestRecord
from tests.controller.conftest import World

_ids = itertools.count()


def _rates(slope: float = 0.0004, handoff: float = 0.05, samples: int = 50, at: float = 0.0) -> Rates:
    return Rates(
        fitted_at=at,
        window_s=10.0,
        instances=[
            InstanceRate(
                name="p0", prefill_base_s=0.03, prefill_s_per_token=slope, samples=samples, error=0.01
            ),
            InstanceRate(name="d0", handoff_s=handoff, samples=samples),
        ],
        pairs=[PairRate(prefill="p0", decode="d0", handoff_s=handoff, samples=samples)],
    )


# -- the gate (pure) -------------------------------------------------------------------------------


def test_rounds_to_three_significant_digits() -> None:
    r = rounded(_rates(slope=0.000412345, handoff=0.0512345))
    assert r.instances[0].prefill_s_per_token == 0.000412 and r.instances[1].handoff_s == 0.0512
    assert r.pairs[0].handoff_s == 0.0512


def test_noise_does_not_churn_the_served_rates() -> None:
    gate = RatesGate()
    first = gate.offer(_rates(at=0.0), now=0.0)
    assert first is not None and first.tag
    for i in range(1, 5):  # every 2 s, a few % of noise and a few more samples: the same served object
        assert (
            gate.offer(_rates(slope=0.0004 * (1 + 0.03 * i), samples=50 + i, at=2.0 * i), now=2.0 * i)
            is first
        )
    later = gate.offer(
        _rates(slope=0.00041, samples=60, at=10.0), now=10.0
    )  # refresh_s passed, content moved
    assert later is not None and later is not first and later.tag != first.tag
    assert gate.offer(_rates(slope=0.00041, samples=60, at=30.0), now=30.0) is later  # same content: kept


def test_a_move_past_the_threshold_is_served_at_once() -> None:
    gate = RatesGate()
    first = gate.offer(_rates(), now=0.0)
    slow = gate.offer(_rates(slope=0.0006), now=2.0)  # +50 %
    assert slow is not first and slow is not None and slow.rates.instances[0].prefill_s_per_token == 0.0006
    assert moved(_rates(handoff=0.001), _rates(handoff=0.0018)) is False  # under the floor: noise
    assert moved(_rates(), _rates().model_copy(update={"pairs": []})) is False
    assert moved(_rates().model_copy(update={"pairs": []}), _rates()) is True  # a pair appeared


def test_an_empty_fit_keeps_the_served_rates() -> None:
    gate = RatesGate()
    assert gate.offer(Rates(fitted_at=0.0, window_s=10.0), now=0.0) is None
    first = gate.offer(_rates(), now=1.0)
    assert gate.offer(Rates(fitted_at=20.0, window_s=10.0), now=20.0) is first


def test_the_cadence_fits_first_then_every_every_s() -> None:
    gate = RatesGate(every_s=5.0)
    assert gate.due(100.0), "nothing fitted yet: a restart or a new leader fits on its first tick"
    gate.offer(_rates(at=100.0), 100.0)
    assert not gate.due(102.0) and not gate.due(104.9)
    assert gate.due(105.0) and gate.due(99.0), "due after every_s, and when the clock went back"
    gate.clear()  # standing down
    assert gate.due(101.0)


def test_an_empty_fit_starts_no_cadence_while_nothing_is_served() -> None:
    gate = RatesGate(every_s=5.0)
    gate.offer(Rates(fitted_at=100.0, window_s=10.0), 100.0)
    assert gate.served is None and gate.due(102.0), "the first rates are served at the first tick with any"
    gate.offer(_rates(at=102.0), 102.0)
    gate.offer(Rates(fitted_at=107.0, window_s=10.0), 107.0)  # an idle window: kept, and it waits again
    assert gate.served is not None and not gate.due(109.0) and gate.due(112.0)


# -- served by the controller from a seeded store ------------------------------------------------------


def _seed(world: World, ts: float, slope: float, base: float = 0.02, n: int = 30) -> None:
    """``n`` served records per P (prefill-0, prefill-1), sent to decode-0, on the line ``base + slope x``."""
    rows = []
    for i in range(n):
        for p in ("prefill-0", "prefill-1"):
            x = 100 + 50 * (i % 30)  # TTFT within the SLO: the policy leaves the table be
            p_sent = ts + 0.01 * i
            p_done = p_sent + base + slope * x
            rows.append(
                RequestRecord(
                    request_id=f"rate{next(_ids)}",
                    status="ok",
                    p_instance=p,
                    d_instance="decode-0",
                    p_pool="prefill",
                    d_pool="decode",
                    proxy_in=ts,
                    p_sent=p_sent,
                    p_done=p_done,
                    d_sent=p_done,
                    first_token=p_done + 0.08,
                    done=p_done + 0.5,
                    ttft_s=p_done + 0.08 - ts,
                    prompt_tokens=x,
                    predict_tokens_ahead=x // 4,
                    predict_tokens=x - x // 4,
                )
            )
    with transaction(world.factory) as s:
        s.add_all(rows)


@pytest.fixture
def client(world: World) -> Iterator[TestClient]:
    app = create_app(world.reconciler, token="t0ken")
    with TestClient(app) as c:
        yield c


def test_the_served_table_carries_rates_fitted_from_the_store(client: TestClient, world: World) -> None:
    world.step(requests=False)
    assert client.get("/v1/routing").json()["rates"] is None  # nothing to fit yet
    _seed(world, world.clock() + 0.5, slope=0.0005)
    world.step(requests=False)
    r = client.get("/v1/routing")
    rates = Rates.model_validate(r.json()["rates"])
    by_name = {i.name: i for i in rates.instances}
    assert by_name["prefill-0"].prefill_s_per_token == pytest.approx(0.0005, rel=0.02)
    assert by_name["prefill-0"].prefill_base_s == pytest.approx(0.02, rel=0.05)
    assert by_name["prefill-0"].samples == 30 and by_name["decode-0"].handoff_s == pytest.approx(0.08)
    assert {(p.prefill, p.decode) for p in rates.pairs} == {
        ("prefill-0", "decode-0"),
        ("prefill-1", "decode-0"),
    }
    assert rates.fitted_at == world.clock() and rates.window_s == world.settings.controller.window_s
    assert world.reconciler.table.rates is None, "the rates are not in what the policy carries"


def test_the_etag_changes_with_the_rates_and_only_then(client: TestClient, world: World) -> None:
    for _ in range(4):  # past the first ticks, whose tables are new (the start-up)
        _seed(world, world.clock() + 0.5, slope=0.0005)
        world.step(requests=False)
    first = client.get("/v1/routing")
    slope0 = next(i for i in first.json()["rates"]["instances"] if i["name"] == "prefill-0")[
        "prefill_s_per_token"
    ]
    etag = first.headers["etag"]
    _seed(world, world.clock() + 0.5, slope=0.0005)  # the same line: no change worth serving
    world.step(requests=False)
    assert world.reconciler.table.version == first.json()["version"]
    assert client.get("/v1/routing", headers={"If-None-Match": etag}).status_code == 304
    _seed(world, world.clock() + 0.5, slope=0.001, n=300)  # P got 2x slower: most of the window says so
    for _ in range(3):  # the next fit on the cadence (every 5 s, ticks 2 s apart) serves it
        world.step(requests=False)
    again = client.get("/v1/routing", headers={"If-None-Match": etag})
    assert again.status_code == 200 and again.headers["etag"] != etag
    assert again.headers["etag"].rsplit("-r", 1)[1] != etag.rsplit("-r", 1)[1], "the rates' part moved"
    p0 = next(i for i in again.json()["rates"]["instances"] if i["name"] == "prefill-0")
    assert p0["prefill_s_per_token"] > 1.5 * slope0


def test_a_standby_serves_no_rates(client: TestClient, world: World) -> None:
    _seed(world, world.clock() + 0.5, slope=0.0005)
    world.step(requests=False)
    assert client.get("/v1/routing").json()["rates"] is not None
    with world.reconciler._lock:
        world.reconciler._stand_down_locked("test", None)
    assert client.get("/v1/routing").json()["rates"] is None


def test_new_rates_alone_change_the_etag(client: TestClient, world: World) -> None:
    world.step(requests=False)
    r0 = client.get("/v1/routing")
    gate = world.reconciler._rates
    with world.reconciler._lock:  # as a tick's fit would, without a new table
        gate.offer(_rates(), world.clock())
    r1 = client.get("/v1/routing", headers={"If-None-Match": r0.headers["etag"]})
    assert r1.status_code == 200 and r1.json()["version"] == r0.json()["version"]
    assert r1.json()["rates"]["instances"][0]["name"] == "p0"
    with world.reconciler._lock:  # the same rates again: the same ETag
        gate.offer(_rates(at=1.0), world.clock() + 2.0)
    assert client.get("/v1/routing", headers={"If-None-Match": r1.headers["etag"]}).status_code == 304


def test_between_fits_the_last_rates_are_served_and_not_refitted(client: TestClient, world: World) -> None:
    _seed(world, world.clock() + 0.5, slope=0.0005)
    world.step(requests=False)
    fitted = client.get("/v1/routing").json()["rates"]["fitted_at"]
    assert fitted == world.clock()
    seen = []
    for _ in range(4):
        world.step(requests=False)
        seen.append(world.reconciler._rates.last_fit)
        assert client.get("/v1/routing").json()["rates"] is not None, "served between fits"
    every = world.settings.controller.rates_every_s
    assert seen == [fitted, fitted, fitted + 6.0, fitted + 6.0] and every == 5.0, "ticks 2 s apart: every 3rd"


def test_a_new_leader_fits_on_its_first_tick(client: TestClient, world: World) -> None:
    _seed(world, world.clock() + 0.5, slope=0.0005)
    world.step(requests=False)
    with world.reconciler._lock:
        world.reconciler._stand_down_locked("test", None)
        world.reconciler._leading = True  # the lock taken again
    world.step(requests=False)
    assert world.reconciler._rates.last_fit == world.clock()
    assert client.get("/v1/routing").json()["rates"]["fitted_at"] == world.clock()
