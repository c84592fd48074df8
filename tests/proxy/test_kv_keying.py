"""Keying a long prompt off the event loop: a precise view's tokenizer runs on a worker thread for a
large body, so one long prompt does not stall every other request; bounded, and load-only past it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from typing import Any

from proxy.gate import OFFLOAD_BYTES, OFFLOAD_MAX, KvRouting
from proxy.kvaware import REASON_KEYING_BUSY, CostModel
from proxy.metrics import ProxyMetrics
from proxy.prefixview import Prompt
from tests.proxy.fakes import FakeView


class ThreadNoting(FakeView):
    """Notes the thread each prompt() ran on; ``gate`` (when set) holds prompt() until released."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        super().__init__({})
        self.threads: list[str] = []
        self.gate = gate

    def prompt(self, endpoint: str, body: Mapping[str, Any]) -> Prompt | None:
        self.threads.append(threading.current_thread().name)
        if self.gate is not None:
            assert self.gate.wait(10)
        return super().prompt(endpoint, body)


def kv(view: FakeView, offload: bool) -> KvRouting:
    return KvRouting(view, CostModel(), ProxyMetrics(), offload=offload)


def test_a_long_body_is_keyed_on_a_worker_thread_a_short_one_on_the_loop() -> None:
    view = ThreadNoting()
    k = kv(view, offload=True)

    async def main() -> None:
        short, _ = await k.prompt_of("/v1/completions", {"prompt": "x"}, 100)
        long, _ = await k.prompt_of("/v1/completions", {"prompt": "x"}, OFFLOAD_BYTES)
        assert short is not None and long is not None
        assert k.offloaded == 0

    try:
        asyncio.run(main())
    finally:
        k.close()
    loop_thread = threading.current_thread().name
    assert view.threads[0] == loop_thread
    assert view.threads[1] != loop_thread and view.threads[1].startswith("kv-keying")


def test_without_offload_every_body_is_keyed_on_the_loop() -> None:
    view = ThreadNoting()
    k = kv(view, offload=False)
    asyncio.run(k.prompt_of("/v1/completions", {"prompt": "x"}, 10 * OFFLOAD_BYTES))
    assert view.threads == [threading.current_thread().name]


def test_the_loop_stays_free_while_a_long_prompt_is_keyed_and_the_keyings_are_bounded() -> None:
    gate = threading.Event()
    view = ThreadNoting(gate)
    k = kv(view, offload=True)

    async def main() -> None:
        held = [
            asyncio.create_task(k.prompt_of("/v1/completions", {"prompt": "x"}, OFFLOAD_BYTES))
            for _ in range(OFFLOAD_MAX)
        ]
        for _ in range(100):  # the loop runs on while they are held on the worker threads
            if k.offloaded == OFFLOAD_MAX:
                break
            await asyncio.sleep(0)
        assert k.offloaded == OFFLOAD_MAX
        prompt, why = await k.prompt_of("/v1/completions", {"prompt": "x"}, OFFLOAD_BYTES)
        assert prompt is None and why == REASON_KEYING_BUSY
        gate.set()
        done = await asyncio.gather(*held)
        assert all(p is not None for p, _ in done) and k.offloaded == 0

    try:
        asyncio.run(main())
    finally:
        gate.set()
        k.close()
