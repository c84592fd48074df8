"""The reserve line through the proxy's gate (tenants on, admission by prediction): a tenant served past
its share may fill P's queue only to (1 - reserve) of its target while its peers are busy; a peer within
its share has the whole budget."""

from __future__ import annotations

import asyncio

import pytest

from proxy.fairqueue import FairQueue, Work
from tests.proxy.memory import COMPLETION, MemoryProxy, MemVLLM, memory_flow, memory_settings

PER_TOKEN_S = 1e-4  # P computes 10,000 tokens a second in this test
FLOOD, CALM = {b"x-pdscope-tenant": b"flood"}, {b"x-pdscope-tenant": b"calm"}


def _proxy(ahead: int, queue_timeout_s: float = 0.05) -> tuple[MemoryProxy, FairQueue]:
    """One P with ``ahead`` tokens of this proxy's waiting on it; flood and calm both in flight, flood
    served far past its half."""
    p, d = MemVLLM("p0", "prefill"), MemVLLM("d0", "decode", serves_plain=True)
    settings = memory_settings(
        {"prefill": ("prefill", [p]), "decode": ("decode", [d])},
        proxy={"predict": {"min_samples": 5}, "admission": {"queue_timeout_s": queue_timeout_s}},
    )
    tenants = {"enabled": True, "tenants": {"flood": {}, "calm": {}}, "reserve": 0.3}
    settings = settings.model_copy(update={"tenants": type(settings.tenants).model_validate(tenants)})
    px = memory_flow(settings, [p, d])
    pred = px.flow.gate.predictor
    for x in (1000, 5000, 20_000) * 20:
        pred.observe_prefill("p0", x, 0.01 + x * PER_TOKEN_S)
    pred.backlog.add("p0", ahead)
    fair = px.parts.admission.fair
    assert fair is not None
    fair.admitted("flood", Work(50_000))
    fair.admitted("calm", Work(1000))
    return px, fair


async def test_past_its_share_the_flood_waits_at_its_line_and_its_peer_does_not() -> None:
    px, _ = _proxy(14_000)  # 1.41 s ahead: past the flood's line (0.7 x 2 s, less the 5 % margin)
    reply = await px.send(COMPLETION, headers=FLOOD)
    assert reply.status == 429 and reply.json()["error"]["code"] == "tenant_reserve"
    assert (await px.send(COMPLETION, headers=CALM)).status == 200  # within 1.9 s: its whole budget


@pytest.mark.parametrize(("headers", "code"), [(FLOOD, None), (CALM, "tenant_reserve")])
async def test_the_line_moves_to_whoever_is_served_past_its_share(
    headers: dict[bytes, bytes], code: str | None
) -> None:
    """One request on a fresh proxy each (an answer teaches P's line): calm served past the flood since,
    the flood has the whole budget and calm waits at its line."""
    px, fair = _proxy(14_000)
    fair.charge("calm", 100_000)
    reply = await px.send(COMPLETION, headers=headers)
    if code is None:
        assert reply.status == 200
    else:
        assert reply.status == 429 and reply.json()["error"]["code"] == code


async def test_a_waiter_held_at_its_line_does_not_hold_back_its_peer() -> None:
    """The flood's request waits at its line (kept out of P, its tenant's own obstacle) and ranks first: at
    the same counter as calm, it came first. Calm's request behind it is admitted while it still waits,
    not once it gives up (on the code before, calm waited behind it)."""
    px, fair = _proxy(14_000, queue_timeout_s=2.0)
    fair.tenants["calm"].p, fair.tenants["calm"].d = fair.tenants["flood"].p, fair.tenants["flood"].d
    flood = asyncio.create_task(px.send(COMPLETION, headers=FLOOD))
    for _ in range(1000):  # until the flood's request waits in the fair queue
        if fair.queued("flood"):
            break
        await asyncio.sleep(0)
    assert fair.queued("flood") == 1
    reply = await px.send(COMPLETION, headers=CALM)
    assert reply.status == 200 and fair.queued("flood") == 1  # admitted while the flood still waited
    await flood  # let go once calm's answer moved P's line, or refused at its line: either, after calm
