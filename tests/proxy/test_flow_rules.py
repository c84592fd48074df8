"""The flow's failure rules and admission on an in-memory fleet (no sockets): which failure is
retried where, what the budget allows, and that every pick, retries included, goes through
admission. The wire itself is tested end to end in test_flow.py."""

from __future__ import annotations

import asyncio
import json

from tests.proxy.fakes import completion_text
from tests.proxy.memory import COMPLETION, MemoryProxy, MemVLLM, memory_flow, memory_settings, one_pool_each

STREAM = {**COMPLETION, "stream": True}


def _sse_text(raw: bytes) -> str:
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(out)


# -- prefill ------------------------------------------------------------------------------


async def test_prefill_down_retries_another_prefill() -> None:
    p0, p1, d0 = MemVLLM("p0", "prefill", mode="down"), MemVLLM("p1", "prefill"), MemVLLM("d0", "decode")
    proxy = one_pool_each([p0, p1], [d0], policy="round-robin")
    reply = await proxy.send()
    assert reply.status == 200, reply.data
    assert len(p1.calls) == 1 and len(d0.calls) == 1
    assert proxy.metric("pdscope_proxy_retries_total", stage="prefill") == 1
    assert (
        proxy.metric("pdscope_proxy_upstream_failures_total", instance="p0", kind="connect", stage="prefill")
        == 1
    )
    assert proxy.parts.selector.outliers.recent("p0", proxy.parts.clock()) == (1, 1)  # counted against p0


async def test_prefill_500_retries_within_budget_then_fails_cleanly() -> None:
    ps = [MemVLLM("p0", "prefill", mode="error500"), MemVLLM("p1", "prefill", mode="error500")]
    d0 = MemVLLM("d0", "decode")
    proxy = one_pool_each(ps, [d0], retry_budget=0.0)
    proxy.parts.budget.balance = 3.0  # exactly three retries allowed in total
    replies = [await proxy.send() for _ in range(6)]
    assert [r.status for r in replies] == [502] * 6
    assert replies[0].json()["error"]["code"] == "upstream_status_500"
    assert sum(len(p.calls) for p in ps) == 6 + 3  # one try each, plus the three retries the budget allowed
    assert proxy.metric("pdscope_proxy_retries_refused_total", stage="prefill") == 3
    assert d0.calls == []


async def test_prefill_4xx_is_passed_through_without_retry() -> None:
    ps = [MemVLLM("p0", "prefill", mode="error400"), MemVLLM("p1", "prefill", mode="error400")]
    d0 = MemVLLM("d0", "decode")
    proxy = one_pool_each(ps, [d0])
    reply = await proxy.send()
    assert reply.status == 400 and reply.json()["error"]["message"] == "bad prompt"
    assert sum(len(p.calls) for p in ps) == 1
    assert (
        proxy.metric(
            "pdscope_proxy_upstream_failures_total", instance=ps[0].name, kind="status_400", stage="prefill"
        )
        == 0
    )
    assert (
        proxy.metric("pdscope_proxy_requests_total", endpoint="/v1/completions", outcome="client_error") == 1
    )


# -- decode -------------------------------------------------------------------------------


async def test_decode_down_retries_another_decode_with_the_same_kv() -> None:
    p0, d0, d1 = MemVLLM("p0", "prefill"), MemVLLM("d0", "decode", mode="down"), MemVLLM("d1", "decode")
    proxy = one_pool_each([p0], [d0, d1], policy="round-robin")
    reply = await proxy.send(STREAM)
    assert reply.status == 200 and _sse_text(reply.data) == completion_text(STREAM)
    assert len(p0.calls) == 1  # no new prefill: D never saw the request
    assert len(d1.calls) == 1
    assert proxy.metric("pdscope_proxy_retries_total", stage="decode") == 1


async def test_decode_503_is_retried_on_another_decode_with_the_same_kv() -> None:
    p0, d0, d1 = MemVLLM("p0", "prefill"), MemVLLM("d0", "decode", mode="error503"), MemVLLM("d1", "decode")
    proxy = one_pool_each([p0], [d0, d1], policy="round-robin")
    reply = await proxy.send()
    assert reply.status == 200
    assert len(p0.calls) == 1  # no new prefill
    assert d1.calls[0]["body"]["kv_transfer_params"] == d0.calls[0]["body"]["kv_transfer_params"]
    assert proxy.metric("pdscope_proxy_retries_total", stage="decode") == 1
    assert (
        proxy.metric(
            "pdscope_proxy_upstream_failures_total", instance="d0", kind="status_503", stage="decode"
        )
        == 1
    )


async def test_decode_500_before_first_token_retries_with_a_new_prefill() -> None:
    p0, d0, d1 = MemVLLM("p0", "prefill"), MemVLLM("d0", "decode", mode="error500"), MemVLLM("d1", "decode")
    proxy = one_pool_each([p0], [d0, d1], policy="round-robin")
    reply = await proxy.send(STREAM)
    assert reply.status == 200 and _sse_text(reply.data) == completion_text(STREAM)
    assert len(p0.calls) == 2  # P's blocks may be gone: a new prefill (the same P: there is no other)
    assert len(d0.calls) == 1 and len(d1.calls) == 1
    assert proxy.metric("pdscope_proxy_retries_total", stage="full") == 1


async def test_decode_all_down_is_a_clean_502_and_gives_back_every_slot_and_byte() -> None:
    p0 = MemVLLM("p0", "prefill")
    ds = [MemVLLM("d0", "decode", mode="down"), MemVLLM("d1", "decode", mode="down")]
    proxy = one_pool_each([p0], ds)
    reply = await proxy.send(STREAM)
    assert reply.status == 502
    err = reply.json()["error"]
    assert err["code"] == "upstream_connect" and err["type"] == "upstream_error"
    adm = proxy.parts.admission
    assert sum(adm.requests.values()) == 0 and sum(adm.kv_bytes.values()) == 0


async def test_a_stream_cut_after_the_first_token_is_not_retried_and_ends_with_an_error_event() -> None:
    p0, d0 = MemVLLM("p0", "prefill"), MemVLLM("d0", "decode", no_done=True)
    d1 = MemVLLM("d1", "decode")
    proxy = one_pool_each([p0], [d0, d1], policy="round-robin")  # d0 first
    reply = await proxy.send(STREAM)
    assert reply.status == 200 and reply.ended and len(d0.calls) == 1
    last = reply.data.decode().strip().splitlines()[-1]
    assert json.loads(last[6:])["error"]["code"] == "upstream_no_done"
    assert (
        len(p0.calls) == 1
        and d1.calls == []
        and proxy.metric("pdscope_proxy_retries_total", stage="full") == 0
    )


# -- retries go through admission -----------------------------------------------------------


async def _hold(proxy: MemoryProxy, where: list[MemVLLM]) -> tuple[asyncio.Task[object], MemVLLM]:
    """Start a request that hangs on whichever of ``where`` it is sent to; returns it and that instance."""
    for inst in where:
        inst.mode = "hang"
    task: asyncio.Task[object] = asyncio.create_task(proxy.send(STREAM))
    done, _ = await asyncio.wait(
        [asyncio.ensure_future(i.entered.wait()) for i in where],
        timeout=5,
        return_when=asyncio.FIRST_COMPLETED,
    )
    assert done, "the holding request reached no instance"
    holder = next(i for i in where if i.entered.is_set())
    return task, holder


async def _cancel(task: asyncio.Task[object]) -> None:
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


async def test_a_prefill_retry_is_not_admitted_into_a_full_pool() -> None:
    # Two P pools and two D pools, one request each at most: A holds one P pool (its P hangs),
    # B gets the other P pool, whose P is down. B's only other P is in A's full pool: no retry.
    p0, p1 = MemVLLM("p0", "prefill"), MemVLLM("p1", "prefill")
    d0, d1 = MemVLLM("d0", "decode"), MemVLLM("d1", "decode")
    settings = memory_settings(
        {"pa": ("prefill", [p0]), "pb": ("prefill", [p1]), "da": ("decode", [d0]), "db": ("decode", [d1])},
        proxy={"admission": {"max_inflight_requests": 1}},
    )
    proxy = memory_flow(settings, [p0, p1, d0, d1])
    a, holder = await _hold(proxy, [p0, p1])
    other = p1 if holder is p0 else p0
    other.mode = "down"
    try:
        reply = await proxy.send(STREAM)
        assert reply.status == 502 and reply.json()["error"]["code"] == "upstream_connect"
        assert len(holder.calls) == 1  # only A's: B was not let into the full pool
        assert proxy.metric("pdscope_proxy_retries_total", stage="prefill") == 0
        assert proxy.parts.admission.requests[holder_pool(proxy, holder)] == 1
    finally:
        await _cancel(a)
    assert sum(proxy.parts.admission.requests.values()) == 0


async def test_a_decode_retry_is_not_admitted_into_a_full_pool() -> None:
    # One P pool; two D pools of one request each: A holds one (its D hangs before the first token),
    # B's D in the other pool refuses the connection; the only other D is in A's full pool: no retry.
    p0 = MemVLLM("p0", "prefill")
    d0, d1 = MemVLLM("d0", "decode"), MemVLLM("d1", "decode")
    settings = memory_settings(
        {"pa": ("prefill", [p0]), "da": ("decode", [d0]), "db": ("decode", [d1])},
        proxy={"admission": {"max_inflight_requests": 1}},
    )
    proxy = memory_flow(settings, [p0, d0, d1])
    a, holder = await _hold(proxy, [d0, d1])  # A's prefill is done: its P slot is free again
    other = d1 if holder is d0 else d0
    other.mode = "down"
    try:
        reply = await proxy.send(STREAM)
        assert reply.status == 502 and reply.json()["error"]["code"] == "upstream_connect"
        assert len(holder.calls) == 1  # only A's
        assert proxy.metric("pdscope_proxy_retries_total", stage="decode") == 0
    finally:
        await _cancel(a)
    assert (
        sum(proxy.parts.admission.requests.values()) == 0
        and sum(proxy.parts.admission.kv_bytes.values()) == 0
    )


async def test_a_retry_within_the_pool_it_holds_is_admitted() -> None:
    # The pool is at its limit only because of this request: moving to another D in it takes nothing more.
    p0, d0, d1 = MemVLLM("p0", "prefill"), MemVLLM("d0", "decode", mode="down"), MemVLLM("d1", "decode")
    proxy = one_pool_each([p0], [d0, d1], policy="round-robin", admission={"max_inflight_requests": 1})
    reply = await proxy.send(STREAM)
    assert reply.status == 200
    assert proxy.metric("pdscope_proxy_retries_total", stage="decode") == 1


def holder_pool(proxy: MemoryProxy, inst: MemVLLM) -> str:
    return next(
        name
        for name, pool in proxy.parts.settings.pools.items()
        if inst.name in [i.name for i in pool.instances]
    )


# -- rejections name pools ------------------------------------------------------------------


async def test_a_no_instances_rejection_counts_against_the_pools_not_the_role() -> None:
    p0, d0, d1 = MemVLLM("p0", "prefill"), MemVLLM("d0", "decode"), MemVLLM("d1", "decode")
    settings = memory_settings(
        {"pa": ("prefill", [p0]), "da": ("decode", [d0]), "db": ("decode", [d1])},
        pool_weights={"da": 0.0, "db": 0.0},
    )  # no routable decode instance
    proxy = memory_flow(settings, [p0, d0, d1])
    reply = await proxy.send()
    assert reply.status == 503 and "no routable decode instance" in reply.json()["error"]["message"]
    for pool in ("da", "db"):
        assert proxy.metric("pdscope_proxy_rejections_total", pool=pool, reason="no_instances") == 1
    assert proxy.metric("pdscope_proxy_rejections_total", pool="decode", reason="no_instances") == 0
    assert p0.calls == []


async def test_a_full_pool_rejection_names_that_pool() -> None:
    p0, d0 = MemVLLM("p0", "prefill"), MemVLLM("d0", "decode")
    settings = memory_settings(
        {"pa": ("prefill", [p0]), "da": ("decode", [d0])},
        proxy={"admission": {"max_inflight_requests": 1, "queue_timeout_s": 0.0}},
    )
    proxy = memory_flow(settings, [p0, d0])
    a, _ = await _hold(proxy, [d0])
    try:
        reply = await proxy.send()
        assert reply.status == 429 and "'da'" in reply.json()["error"]["message"]
        assert proxy.metric("pdscope_proxy_rejections_total", pool="da", reason="inflight_requests") == 1
    finally:
        await _cancel(a)
