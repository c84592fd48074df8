"""The prefix benchmark's open-loop client: planned bodies, streamed, timed per request.

Every planned request goes out at its time whether or not earlier ones finished; each streams
(``stream_options.include_usage``) and is read as ``pdscope load`` reads it
(``simulator.loadgen.read_stream``: TTFT from send to first content chunk, e2e and output tokens) into
a :class:`simulator.workload.RequestResult`, so ``simulator.workload.summarize`` computes
goodput and percentiles as every other benchmark here does. Bounded: per-request timeout, at most
``max_inflight`` open (a request past it is recorded as dropped), and a finite schedule. Hooks at
given offsets (``at``) let the caller scrape metrics at the start and end of the measured phase.

Conversations (``live_chat``, :func:`run_conversations`): each is one task that sends a turn, reads
its stream to the end collecting the answer's text, waits its think time and sends the next turn
with that answer appended; a turn that fails ends its conversation (a user who gave up), and no
turn is sent at or after the run's ``duration_s``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from bench.prefix.workloads import CHAT_OVERHEAD, Conversation, Planned
from simulator.httpclient import HttpClientError, Pool
from simulator.loadgen import read_stream, settle
from simulator.workload import RequestResult


def request_body(p: Planned, model: str, max_tokens: int) -> dict[str, Any]:
    return {
        **p.body,
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


async def _one(
    client: Pool, url: str, body: dict[str, Any], res: RequestResult, timeout_s: float, t0: float
) -> None:
    try:
        async with (
            asyncio.timeout(timeout_s),
            client.post(url, body, {"X-Request-Id": res.request_id}) as resp,
        ):
            await read_stream(resp, res, t0)
    except TimeoutError:
        res.error = "timeout"
    except (HttpClientError, OSError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"


@dataclass
class _OpenLoop:
    """One open-loop run's sends: every planned request at its time, at most ``max_inflight`` open."""

    client: Pool
    start: float
    timeout_s: float
    max_inflight: int
    results: list[RequestResult] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    inflight: int = 0

    async def send_all(
        self, base_url: str, planned: list[Planned], model: str, max_tokens: int, tag: str
    ) -> None:
        loop = asyncio.get_running_loop()
        for i, p in enumerate(planned):
            delay = self.start + p.at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            res = RequestResult(
                i, f"{tag}-{i}", p.at, time.perf_counter() - self.start, p.prompt_tokens, max_tokens
            )
            self.results.append(res)
            if self.inflight >= self.max_inflight:
                res.error = "dropped: max in-flight"
                continue
            self.inflight += 1
            url = base_url.rstrip("/") + p.endpoint
            self.tasks.append(loop.create_task(self._send(res, url, request_body(p, model, max_tokens))))

    async def _send(self, res: RequestResult, url: str, body: dict[str, Any]) -> None:
        try:
            await _one(self.client, url, body, res, self.timeout_s, time.perf_counter())
        finally:
            self.inflight -= 1


async def run_open_loop(
    base_url: str,
    planned: list[Planned],
    *,
    model: str,
    max_tokens: int,
    timeout_s: float = 30.0,
    max_inflight: int = 2048,
    hooks: list[tuple[float, Callable[[], None]]] | None = None,
    tag: str = "prefix",
) -> list[RequestResult]:
    """Send ``planned`` open loop against ``base_url``; results in plan order. ``hooks`` run (in a
    thread, so a slow scrape delays no send) at their offsets from the start."""
    client = Pool(max_idle=max_inflight)
    start = time.perf_counter()
    run = _OpenLoop(client, start, timeout_s, max_inflight)

    async def work() -> None:
        await run.send_all(base_url, planned, model, max_tokens, tag)
        await settle(run.tasks, timeout_s + 5.0)

    await _hooked(client, start, hooks, work())
    return run.results


async def _hooked(
    client: Pool, start: float, hooks: list[tuple[float, Callable[[], None]]] | None, work: Awaitable[None]
) -> None:
    """Await ``work`` with ``hooks`` run at their offsets from ``start``; then close ``client``."""
    loop = asyncio.get_running_loop()
    hook_tasks = [
        loop.create_task(_hook(start + at, fn)) for at, fn in sorted(hooks or [], key=lambda h: h[0])
    ]
    try:
        await work
        await asyncio.gather(*hook_tasks, return_exceptions=True)
    finally:
        for t in hook_tasks:
            t.cancel()
        await client.aclose()


async def _read_answer(resp: Any, res: RequestResult, t_send: float) -> str:
    """A streamed chat answer into ``res`` (TTFT at the first content, e2e, output tokens, ok) and
    its content text, every chunk parsed (the conversation needs the words)."""
    res.status = resp.status_code
    if resp.status_code != 200:
        await resp.aread()
        res.error = f"HTTP {resp.status_code}"
        return ""
    parts: list[str] = []
    finished = False
    async for line in resp.aiter_lines():
        payload = line[6:] if line.startswith("data: ") else None
        if payload is None or payload == "[DONE]":
            finished = finished or payload == "[DONE]"
            continue
        chunk = json.loads(payload)
        if "error" in chunk:
            res.error = "stream error"
        res.output_tokens = int((chunk.get("usage") or {}).get("completion_tokens") or res.output_tokens)
        for choice in chunk.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                res.ttft_s = res.ttft_s if res.ttft_s is not None else time.perf_counter() - t_send
                parts.append(piece)
    res.e2e_s = time.perf_counter() - t_send
    res.ok = finished and res.error is None and res.ttft_s is not None
    if not finished and res.error is None:
        res.error = "stream ended early"
    return "".join(parts)


@dataclass
class _Talks:
    """One run's conversations: each a task, its turns' results appended as they are sent."""

    client: Pool
    url: str
    start: float
    duration_s: float
    timeout_s: float
    model: str
    tag: str
    results: list[RequestResult] = field(default_factory=list)

    async def talk(self, conv: Conversation) -> None:
        messages = conv.messages()
        due = self.start + conv.at
        for turn, user in enumerate(conv.users):
            if turn:
                due = time.perf_counter() + conv.thinks[turn - 1]
            if due - self.start >= self.duration_s:
                return
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            messages.append({"role": "user", "content": user})
            body = {
                "messages": [dict(m) for m in messages],
                "model": self.model,
                "max_tokens": conv.answers[turn],
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
            }
            sent = time.perf_counter()
            tokens = sum(len(m["content"].split()) + CHAT_OVERHEAD for m in messages)  # the simulator's count
            res = RequestResult(
                len(self.results),
                f"{self.tag}-{len(self.results)}",
                sent - self.start,
                sent - self.start,
                tokens,
                conv.answers[turn],
            )
            self.results.append(res)
            answer = await self._turn(body, res, sent)
            if not res.ok:
                return
            messages.append({"role": "assistant", "content": answer})

    async def _turn(self, body: dict[str, Any], res: RequestResult, sent: float) -> str:
        try:
            async with (
                asyncio.timeout(self.timeout_s),
                self.client.post(self.url, body, {"X-Request-Id": res.request_id}) as resp,
            ):
                return await _read_answer(resp, res, sent)
        except TimeoutError:
            res.error = "timeout"
        except (HttpClientError, OSError, ValueError) as exc:
            res.error = f"{type(exc).__name__}: {exc}"
        return ""


async def run_conversations(
    base_url: str,
    convs: list[Conversation],
    *,
    model: str,
    duration_s: float,
    timeout_s: float = 30.0,
    hooks: list[tuple[float, Callable[[], None]]] | None = None,
    tag: str = "chat",
) -> list[RequestResult]:
    """Hold ``convs`` against ``base_url`` (each turn after the answer to the one before and its think
    time; each answer as long as its turn plans); the results of every turn sent, in sending order.
    ``hooks`` as :func:`run_open_loop`'s."""
    client = Pool(max_idle=max(64, len(convs)))
    start = time.perf_counter()
    url = base_url.rstrip("/") + "/v1/chat/completions"
    talks = _Talks(client, url, start, duration_s, timeout_s, model, tag)

    async def work() -> None:
        loop = asyncio.get_running_loop()
        await settle([loop.create_task(talks.talk(c)) for c in convs], duration_s + timeout_s + 5.0)

    await _hooked(client, start, hooks, work())
    return talks.results


async def _hook(at: float, fn: Callable[[], None]) -> None:
    delay = at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    await asyncio.to_thread(fn)
