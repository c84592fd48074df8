"""The reserve line keeps room for its claimants' next request (``proxy.gate`` with tenants on): a tenant
served past its share may fill P only so far that the largest prompt one of its busy peers sent lately
still fits their target behind it."""

from __future__ import annotations

from proxy.fairqueue import FairQueue
from tests.proxy.memory import COMPLETION, MemoryProxy, MemVLLM, memory_flow, memory_settings

PER_TOKEN_S = 1e-4  # P computes 10,000 tokens a second in this test
FLOOD = {b"x-pdscope-tenant": b"flood"}


def _proxy() -> tuple[MemoryProxy, FairQueue]:
    p, d = MemVLLM("p0", "prefill"), MemVLLM("d0", "decode", serves_plain=True)
    settings = memory_settings(
        {"prefill": ("prefill", [p]), "decode": ("decode", [d])},
        proxy={"predict": {"min_samples": 5}, "admission": {"queue_timeout_s": 0.05}},
    )
    tenants = {"enabled": True, "tenants": {"flood": {}, "calm": {}}, "reserve": 0.3}
    settings = settings.model_copy(update={"tenants": type(settings.tenants).model_validate(tenants)})
    px = memory_flow(settings, [p, d])
    pred = px.flow.gate.predictor
    for x in (1000, 5000, 20_000) * 20:
        pred.observe_prefill("p0", x, 0.01 + x * PER_TOKEN_S)
    fair = px.parts.admission.fair
    assert fair is not None
    fair.admitted("flood", 50_000)  # in flight, and served far past its half: its line applies
    fair.admitted("calm", 1000)  # in flight: a claimant
    return px, fair


def _calm_sent(fair: FairQueue, tokens: int) -> None:
    fair.add_backlog("calm", tokens)
    fair.drop_backlog("calm", tokens)  # answered since: only the room remembers it


async def test_the_flood_may_not_take_the_room_a_claimants_largest_prompt_needs() -> None:
    px, fair = _proxy()
    px.flow.gate.predictor.backlog.add("p0", 12_000)  # 1.2 s ahead: within the flood's line (1.4 s)
    _calm_sent(fair, 8000)
    _calm_sent(fair, 300)
    reply = await px.send(COMPLETION, headers=FLOOD)
    assert reply.status == 429 and reply.json()["error"]["code"] == "tenant_reserve"  # 1.2 + 0.8 > 1.9
    calm = await px.send(COMPLETION, headers={b"x-pdscope-tenant": b"calm"})
    assert calm.status == 200  # the claimant itself is never held to the line


async def test_room_for_a_small_prompt_leaves_the_flood_its_line() -> None:
    px, fair = _proxy()
    px.flow.gate.predictor.backlog.add("p0", 12_000)
    _calm_sent(fair, 300)
    assert (await px.send(COMPLETION, headers=FLOOD)).status == 200  # 1.2 + 0.03 <= 1.9, 1.2 <= 1.33


async def test_without_a_line_there_is_no_room_to_keep() -> None:
    px, fair = _proxy()
    px.flow.gate.predictor.backlog.add("p0", 12_000)
    _calm_sent(fair, 8000)
    fair.charge("calm", 100_000)  # calm served past flood now: the flood is within its share
    assert (await px.send(COMPLETION, headers=FLOOD)).status == 200
