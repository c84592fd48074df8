"""Load for the proxy benchmark: closed loop (fixed concurrency) or open loop (Poisson rate).

Bounded in count and time. Uses pdscope's lean upstream client so the load generator
is cheap. Prints one JSON line: ok, errors, wall_s and e2e/TTFT percentiles in ms.

Run: ``python -m bench.proxy.loadgen --url URL --mode closed --concurrency 32 --duration 5``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

from pdscope.stats import percentile as _pct
from proxy.upstream import Upstream, UpstreamError


def _body(a: argparse.Namespace) -> bytes:
    """The request every send repeats: ``--prompt-words`` words, ``--tokens`` to generate."""
    return json.dumps(
        {
            "model": "bench",
            "prompt": "lorem ipsum dolor sit amet " * (a.prompt_words // 5),
            "max_tokens": a.tokens,
            "stream": a.stream,
            "temperature": 0,
        }
    ).encode()


class _Client:
    """Sends the run's requests and keeps each answered one's e2e and TTFT (ms) and the errors."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.up = Upstream(connect_timeout=5)
        self.body = _body(a)
        self.e2e: list[float] = []
        self.ttft: list[float] = []
        self.errors = 0
        self.sent = 0

    async def one(self) -> None:
        a = self.a
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(a.request_timeout):
                resp = await self.up.post(a.url, a.path, self.body, within_s=a.request_timeout)
                async with resp:
                    first = await resp.next_chunk()
                    t1 = time.perf_counter()
                    while await resp.next_chunk() is not None:
                        pass
                    if resp.status != 200 or first is None:
                        self.errors += 1
                        return
        except (UpstreamError, TimeoutError):
            self.errors += 1
            return
        t2 = time.perf_counter()
        self.ttft.append((t1 - t0) * 1000)
        self.e2e.append((t2 - t0) * 1000)

    async def closed_loop(self, end: float) -> None:
        """``--concurrency`` workers, each sending its next request when the last is answered."""

        async def worker() -> None:
            while time.perf_counter() < end and self.sent < self.a.max_requests:
                self.sent += 1
                await self.one()

        await asyncio.gather(*(worker() for _ in range(self.a.concurrency)))

    async def open_loop(self, start: float, end: float) -> None:
        """Requests at Poisson arrivals of ``--rate`` per second (seeded), whatever is still in flight."""
        rng = random.Random(self.a.seed)
        tasks = []
        next_at = start
        while self.sent < self.a.max_requests and next_at < end:
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.one()))
            self.sent += 1
            next_at += rng.expovariate(self.a.rate)
        await asyncio.gather(*tasks)

    def result(self, wall: float) -> dict[str, object]:
        e2e, ttft = self.e2e, self.ttft
        return {
            "ok": len(e2e),
            "errors": self.errors,
            "wall_s": wall,
            "e2e_ms": {"p50": _pct(e2e, 50), "p90": _pct(e2e, 90), "p99": _pct(e2e, 99)},
            "ttft_ms": {"p50": _pct(ttft, 50), "p90": _pct(ttft, 90), "p99": _pct(ttft, 99)},
        }


async def main(a: argparse.Namespace) -> dict[str, object]:
    client = _Client(a)
    start = time.perf_counter()
    end = start + a.duration
    if a.mode == "closed":
        await client.closed_loop(end)
    else:
        await client.open_loop(start, end)
    wall = time.perf_counter() - start
    await client.up.aclose()
    return client.result(wall)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--path", default="/v1/completions")
    ap.add_argument("--mode", choices=["closed", "open"], default="closed")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--duration", type=float, default=5.0, help="upper bound on the run, seconds")
    ap.add_argument("--max-requests", type=int, default=100_000)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompt-words", type=int, default=120, help="prompt length in words (rounded to 5)")
    ap.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--request-timeout", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    try:
        import uvloop

        result = uvloop.run(main(args))
    except ImportError:
        result = asyncio.run(main(args))
    print(json.dumps(result), flush=True)
