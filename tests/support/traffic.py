"""Closed-loop client load for end-to-end tests (a simulated fleet, or a real pair with its ``model``).

Every prompt starts with its own number, so no two share a cached prefix: the simulator caches
prefixes like vLLM, and a repeated prompt would make P's prefill and D's KV pull nearly free, hiding
the slow prefills and slow links these tests inject.
"""

from __future__ import annotations

import asyncio
import itertools

import httpx

MODEL = "sim-llama-70b"


async def traffic(
    url: str, stop: asyncio.Event, workers: int = 4, max_tokens: int = 6, model: str = MODEL, words: int = 300
) -> dict[str, int]:
    """Send completions to ``url`` from ``workers`` loops until ``stop``, each prompt ``2 x words`` words
    of ``model``'s; counts by status (or error)."""
    counts: dict[str, int] = {}
    seq = itertools.count()

    async def worker(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            body = {
                "model": model,
                "prompt": f"request {next(seq)} " + "hello world " * words,
                "max_tokens": max_tokens,
            }
            try:
                key = str((await client.post(f"{url}/v1/completions", json=body)).status_code)
            except httpx.HTTPError as exc:
                key = type(exc).__name__
                await asyncio.sleep(
                    0.1
                )  # a load generator's back-off after an error, not a wait for anything
            counts[key] = counts.get(key, 0) + 1

    async with httpx.AsyncClient(timeout=10.0) as client:
        await asyncio.gather(*(worker(client) for _ in range(workers)))
    return counts
