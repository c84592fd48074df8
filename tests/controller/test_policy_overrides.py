"""Manual overrides and drains on top of the policy, replayed on a virtual clock."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from controller.policy import Override
from tests.controller.replay import T0, replay


def ov(
    id: int,
    subject: str,
    *,
    weight: float | None = None,
    drained: bool = False,
    created: float = T0,
    ttl: float | None = None,
    kind: str = "instance",
) -> Override:
    return Override(
        id,
        kind,
        subject,
        weight,
        drained,
        "test",
        "sre@test",
        created,  # type: ignore[arg-type]
        None if ttl is None else created + ttl,
    )


@dataclass(frozen=True)
class Case:
    name: str
    overrides: tuple[Override, ...]
    # (tick, instance) -> (served weight, drained, reason)
    expect: dict[tuple[int, str], tuple[float, bool, str]]


INTERVAL = 2.0  # ticks happen at T0 + 2, T0 + 4, ...

CASES = [
    Case(
        "a weight override wins until its TTL",
        (ov(1, "decode-1", weight=0.3, ttl=9.0),),
        {
            (1, "decode-1"): (0.3, False, "ManualOverride"),
            (4, "decode-1"): (0.3, False, "ManualOverride"),
            (5, "decode-1"): (1.0, False, "Healthy"),
            (1, "decode-0"): (1.0, False, "Healthy"),
        },
    ),
    Case(
        "a drain is weight 0 and drained, until it ends",
        (ov(1, "decode-2", drained=True, ttl=5.0),),
        {
            (1, "decode-2"): (0.0, True, "Drained"),
            (2, "decode-2"): (0.0, True, "Drained"),
            (3, "decode-2"): (1.0, False, "Healthy"),
        },
    ),
    Case(
        "a drain without TTL lasts",
        (ov(1, "prefill-0", drained=True),),
        {(1, "prefill-0"): (0.0, True, "Drained"), (30, "prefill-0"): (0.0, True, "Drained")},
    ),
    Case(
        "a drain wins over a newer weight override",
        (
            ov(1, "decode-3", drained=True, ttl=100.0),
            ov(2, "decode-3", weight=0.7, created=T0 + 1, ttl=100.0),
        ),
        {(1, "decode-3"): (0.0, True, "Drained")},
    ),
    Case(
        "the newest weight override of an instance wins",
        (ov(1, "decode-0", weight=0.2, ttl=100.0), ov(2, "decode-0", weight=0.9, created=T0 + 1, ttl=100.0)),
        {(1, "decode-0"): (0.9, False, "ManualOverride")},
    ),
    Case(
        "an override that expired before the tick is ignored",
        (ov(1, "decode-0", weight=0.2, ttl=1.0),),
        {(1, "decode-0"): (1.0, False, "Healthy")},
    ),
    Case(
        "an override can raise a weight above the policy's",
        (ov(1, "decode-2", weight=2.0, ttl=100.0),),
        {(1, "decode-2"): (2.0, False, "ManualOverride")},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_overrides(case: Case) -> None:
    last = max(t for t, _ in case.expect)
    r = replay(lambda tick: {}, last, overrides=lambda now: case.overrides)
    for (tick, name), (weight, drained, reason) in case.expect.items():
        table = r.outputs[tick - 1].table
        route = next(i for i in table.instances if i.name == name)
        assert (route.weight, route.drained, route.reason) == (weight, drained, reason), (tick, name)


def test_policy_keeps_computing_under_an_override() -> None:
    """An override hides the policy's weight but does not freeze it: when it ends, the current policy
    applies."""
    slow = {"decode-2": {"handoff_p50_s": 0.5, "nixl_xfer_mean_s": 0.1}}
    r = replay(lambda tick: slow, 10, overrides=lambda now: (ov(1, "decode-2", weight=1.0, ttl=11.0),))
    assert r.served("decode-2")[:5] == [1.0] * 5
    assert r.weights("decode-2")[4] < 0.5
    assert r.served("decode-2")[5] == r.weights("decode-2")[5] < 0.5


def test_pool_weight_override() -> None:
    o = ov(1, "decode", weight=0.5, ttl=5.0, kind="pool")
    r = replay(lambda tick: {}, 4, overrides=lambda now: (o,))
    pools = [{p.name: (p.weight, p.reason) for p in out.table.pools} for out in r.outputs]
    assert pools[0]["decode"] == (0.5, "ManualOverride")
    assert pools[0]["prefill"][0] == 1.0
    assert pools[2]["decode"][0] == 1.0


def test_advisory_table_says_so() -> None:
    from controller.policy import Observation, PolicyConfig, PolicyState, TickInput, decide, default_rules
    from controller.policy.alerts import AlertConfig
    from tests.controller.replay import fleet, pool_specs, specs

    insts = fleet()
    obs = Observation(now=T0, window_s=30, instances=insts, newest_data=T0)
    out = decide(
        TickInput(obs, PolicyState(), (), specs(insts), pool_specs(), "advisory"),
        PolicyConfig.defaults(),
        default_rules(AlertConfig()),
        AlertConfig(),
    )
    assert out.table.mode == "advisory" and out.table.enforce is False


# -- one override shape, a converter at each boundary ------------------------------------------


def test_a_change_becomes_one_override_shape_through_the_store_and_the_api() -> None:
    from controller.overrides import Change
    from controller.persist import to_override, to_row
    from controller.schemas import PoolOut

    weight = Change(
        "instance", "decode-1", "weight", "weight.set", "hot", "api", sets=True, weight=0.4, ttl_s=60.0
    )
    drain = Change("instance", "decode-2", "drain", "drain", "maintenance", "api", sets=True)
    o = weight.override(100.0)
    assert (o.weight, o.drained, o.created, o.expires) == (0.4, False, 100.0, 160.0)
    d = drain.override(100.0)
    assert (d.weight, d.drained, d.expires) == (0.0, True, None)  # a drain without ttl lasts until undrained
    row = to_row(o)
    row.id = 7  # what the store assigns
    back = to_override(row)
    assert back == Override(7, "instance", "decode-1", 0.4, False, "hot", "api", 100.0, 160.0)
    pool = {"name": "p", "role": "decode", "configured_weight": 1.0, "weight": 1.0, "reason": "x"}
    pool |= {"max_inflight_requests": None, "max_inflight_kv_bytes": None, "instances": []}
    out = PoolOut(**pool, override=back).model_dump(mode="json")["override"]
    assert out == {
        "id": 7,
        "subject_kind": "instance",
        "subject": "decode-1",
        "weight": 0.4,
        "drained": False,
        "reason": "hot",
        "actor": "api",
        "created": 100.0,
        "expires": 160.0,
    }
    assert PoolOut(**pool).model_dump(mode="json")["override"] is None
