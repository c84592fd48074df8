"""vLLM's ``--scheduling-policy priority`` in the simulated engine: the waiting order, the preemption
victim under a KV shortage, and the request's ``priority`` as vLLM's request model takes it."""

from __future__ import annotations

from typing import Any

import pytest

from pdscope.simconfig import SimulatorConfig
from simulator.engine import Engine, drive
from simulator.model import SimRequest
from simulator.server import BadRequest, request_priority

KV = 327680


def _engine(policy: str, **knobs: Any) -> Engine:
    cfg = SimulatorConfig(scheduling_policy=policy, **knobs)
    return Engine("p", "prefill", cfg, engine_id="P", kv_bytes_per_token=KV)


def _req(name: str, prompt: int, out: int, arrival: float, priority: int) -> SimRequest:
    return SimRequest(name, f"{name}-x", prompt, out, arrival, priority=priority)


@pytest.mark.parametrize(
    ("policy", "order"), [("fcfs", ["a", "b", "c", "d"]), ("priority", ["b", "c", "a", "d"])]
)
def test_waiting_requests_go_in_order_of_priority_then_arrival(policy: str, order: list[str]) -> None:
    eng = _engine(policy, max_num_seqs=1)  # one at a time: the finish order is the waiting order
    done: list[str] = []
    for name, arrival, prio in (("a", 0.0, 5), ("b", 1.0, 0), ("c", 2.0, 0), ("d", 3.0, 5)):
        r = _req(name, 64, 1, arrival, prio)
        r.notify = lambda r: done.append(r.request_id) if r.finished else None
        eng.submit(r, arrival)
    drive(eng, until=10.0, now=3.0)
    assert done == order


@pytest.mark.parametrize(("policy", "victim"), [("fcfs", "c"), ("priority", "a")])
def test_a_kv_shortage_preempts_the_largest_priority_under_priority(policy: str, victim: str) -> None:
    """Running [a, b, c] on 12 blocks, all taken: b needs a block first. fcfs preempts the newest other
    running request (c); priority the one of the largest (priority, arrival) (a: 9, though oldest)."""
    eng = _engine(policy, kv_capacity_blocks=12, block_size=16)
    a = _req("a", 100, 40, 0.0, 9)  # 7 blocks, grows at its 113th token
    eng.submit(a, 0.0)
    now = drive(eng, until=0.001, now=0.0)  # a alone is prefilled and runs first
    b, c = _req("b", 32, 40, 1.0, 0), _req("c", 48, 40, 2.0, 0)  # 2 and 3 blocks; both grow at once
    eng.submit(b, now)
    eng.submit(c, now)
    for _ in range(10):
        duration = eng.begin_step(now)
        assert duration is not None
        now += duration
        eng.end_step(now)
        preempted = [r.request_id for r in (a, b, c) if r.num_preemptions]
        if preempted:
            break
    assert preempted == [victim]


def test_the_policy_is_a_per_instance_knob() -> None:
    cfg = SimulatorConfig(instances={"prefill-1": {"scheduling_policy": "priority"}})
    assert cfg.scheduling_policy == "fcfs"
    assert cfg.for_instance("prefill-1").scheduling_policy == "priority"
    with pytest.raises(ValueError, match="scheduling_policy"):
        SimulatorConfig(scheduling_policy="lottery")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "taken"), [(None, 0), (3, 3), (-7, -7), (True, 1), (2.0, 2), ("4", 4), (" 5 ", 5), ("6.0", 6)]
)
def test_priority_is_read_as_vllm_reads_it(value: object, taken: int) -> None:
    body = {} if value is None else {"priority": value}
    assert request_priority(body) == taken


@pytest.mark.parametrize("value", [None, 1.5, "high", [1], {"p": 1}, 2**63, -(2**63) - 1, float("inf")])
def test_a_priority_vllm_refuses_is_a_400_naming_it(value: object) -> None:
    with pytest.raises(BadRequest) as err:
        request_priority({"priority": value})
    assert err.value.status == 400 and err.value.param == "priority"
