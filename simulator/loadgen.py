"""The open-loop client of ``pdscope load``: sends a planned schedule, streams, measures.

Requests go out at their planned times whether or not earlier ones finished (open
loop); ``max_inflight`` bounds memory, and a request that would exceed it is recorded
as dropped, never delayed. Each request streams and records client-side TTFT (send to
first content chunk), e2e and output tokens (from the usage chunk). Two targets: one
OpenAI-compatible URL (the proxy), or ``direct`` P/D mode that speaks the two-step NIXL
protocol itself (round-robin, like vLLM's toy proxy) for fleets without a proxy.
Bounded: every request has a timeout, and the schedule is finite. Prompts share no prefix
(each starts with its request id and a per-run salt), so the simulator's prefix cache never hits:
this load measures uncached prefills.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from pdscope.vllmapi import PREFILL_KV_PARAMS
from simulator.httpclient import HttpClientError, Pool, Response
from simulator.workload import Planned, RequestResult


@dataclass(frozen=True)
class LoadTarget:
    """Where the load goes: one OpenAI-compatible URL (the proxy), or, with no ``url``, the P and D
    URLs the client drives itself (``direct``). It names no instance, unlike the proxy's ``Target``
    (where to send work) and the collector's ``ScrapeTarget`` (what to scrape)."""

    chat: bool = False
    model: str = "sim-llama-70b"
    url: str | None = None
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    # request i carries tenants[i % len(tenants)] in the tenant_header (the proxy's tenants.header)
    tenants: tuple[str, ...] = ()
    tenant_header: str = "x-pdscope-tenant"

    def tenant_of(self, index: int) -> str | None:
        return self.tenants[index % len(self.tenants)] if self.tenants else None

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    @property
    def direct(self) -> bool:
        return self.url is None


class Progress:
    """A one-line progress bar on a TTY; on a pipe, a line at every 10 %."""

    def __init__(self, total: int, out: TextIO | None = None, width: int = 30) -> None:
        self.total = max(1, total)
        self.out = out or sys.stderr
        self.width = width
        self.tty = self.out.isatty()
        self.sent = self.done = self.failed = 0
        self._last_decile = -1
        self._start = time.perf_counter()

    def render(self) -> str:
        frac = self.done / self.total
        bar = "#" * int(frac * self.width)
        return (
            f"[{bar:<{self.width}s}] {self.done}/{self.total} done  {self.sent} sent  "
            f"{self.failed} failed  {time.perf_counter() - self._start:6.1f}s"
        )

    def update(self, final: bool = False) -> None:
        if self.tty:
            self.out.write("\r" + self.render() + ("\n" if final else ""))
            self.out.flush()
            return
        decile = int(10 * self.done / self.total)
        if decile != self._last_decile or final:
            self._last_decile = decile
            self.out.write(self.render() + "\n")
            self.out.flush()


@dataclass
class _Run:
    target: LoadTarget
    client: Pool
    start: float
    seed: int
    progress: Progress | None
    timeout_s: float = 60.0
    # starts every prompt: unique per run, so a second run against the same fleet hits no cache
    salt: str = field(default_factory=lambda: secrets.token_hex(4))
    inflight: int = 0
    results: list[RequestResult] = field(default_factory=list)


def _body(target: LoadTarget, p: Planned, tag: str) -> dict[str, Any]:
    # the first word is the request's own tag, so no two prompts share a prefix block: the load's
    # timings stay those of uncached prefills (prefix caching is measured by workloads that share)
    n = max(1, p.prompt_tokens - (4 if target.chat else 0))
    words = " ".join([tag, *["hi"] * (n - 1)])
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": p.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if target.chat:
        body["messages"] = [{"role": "user", "content": words}]
    else:
        body["prompt"] = words
    return body


async def _one(run: _Run, index: int, p: Planned) -> None:
    target = run.target
    rid = f"load-{run.seed}-{index}"
    now = time.perf_counter
    t_send = now()
    res = RequestResult(index, rid, p.at, t_send - run.start, p.prompt_tokens, p.output_tokens)
    headers = {"X-Request-Id": rid}
    tenant = target.tenant_of(index)
    if tenant is not None:
        headers[target.tenant_header] = tenant
    body = _body(target, p, f"{rid}-{run.salt}")
    try:
        async with asyncio.timeout(run.timeout_s):
            await _exchange(run, target, index, res, body, headers, t_send)
    except TimeoutError:
        res.error = "timeout"
    except asyncio.CancelledError:
        res.error = "cancelled at the run deadline"
        raise
    except HttpClientError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        run.inflight -= 1
        run.results.append(res)
        if run.progress is not None:
            run.progress.done += 1
            run.progress.failed += 0 if res.ok else 1


async def _exchange(
    run: _Run,
    target: LoadTarget,
    index: int,
    res: RequestResult,
    body: dict[str, Any],
    headers: dict[str, str],
    t_send: float,
) -> None:
    if target.direct:
        url = target.decode_urls[index % len(target.decode_urls)] + target.path
        prefill_url = target.prefill_urls[index % len(target.prefill_urls)] + target.path
        pbody = {k: v for k, v in body.items() if k != "stream_options"}
        pbody.update(
            stream=False,
            max_tokens=1,
            kv_transfer_params=dict(PREFILL_KV_PARAMS),
        )
        async with run.client.post(prefill_url, pbody, headers) as presp:
            pdata = await presp.json()
        if presp.status_code != 200:
            res.status, res.error = presp.status_code, f"prefill HTTP {presp.status_code}"
            return
        body["kv_transfer_params"] = pdata.get("kv_transfer_params")
    else:
        url = str(target.url).rstrip("/") + target.path
    async with run.client.post(url, body, headers) as resp:
        await read_stream(resp, res, t_send)


async def read_stream(resp: Response, res: RequestResult, t_send: float) -> None:
    """Read one streamed completion (OpenAI SSE) into ``res``: the status, TTFT (``t_send``, a
    ``time.perf_counter()`` reading, to the first content chunk), e2e, the output tokens (the usage
    chunk's, else the content chunks counted), and ``ok`` or the error. Reads the body to its end,
    so the connection can be reused; raises what the client raises (``HttpClientError``)."""
    res.status = resp.status_code
    if resp.status_code != 200:
        await resp.aread()
        res.error = f"HTTP {resp.status_code}"
        return
    counted = 0
    done = False
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done = True  # read on to the end of the body so the connection can be reused
        elif data.startswith('{"error"'):
            res.error = "stream error"
        else:
            counted += _chunk(data, res, t_send)
    res.e2e_s = time.perf_counter() - t_send
    if not res.output_tokens:
        res.output_tokens = counted
    res.ok = done and res.error is None and res.ttft_s is not None
    if not done and res.error is None:
        res.error = "stream ended early"


def _chunk(data: str, res: RequestResult, t_send: float) -> int:
    """One chunk into ``res`` (its usage's output tokens; TTFT at the first text); 1 if it carries
    text. Past the first token only usage chunks are parsed (JSON costs the client CPU it measures
    with): any other chunk is counted as one token."""
    if res.ttft_s is not None and '"usage"' not in data:
        return 1
    obj = json.loads(data)
    usage = obj.get("usage")
    if usage:
        res.output_tokens = int(usage.get("completion_tokens") or 0)
    choices = obj.get("choices") or []
    if not choices:
        return 0
    c = choices[0]
    text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
    if not text:
        return 0
    if res.ttft_s is None:
        res.ttft_s = time.perf_counter() - t_send
    return 1


async def run_load(
    target: LoadTarget,
    planned: list[Planned],
    *,
    timeout_s: float = 60.0,
    max_inflight: int = 1024,
    seed: int = 0,
    progress: Progress | None = None,
    on_start: Callable[[], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send ``planned`` open-loop; return per-request results (in index order) and wall time."""
    client = Pool(max_idle=max_inflight)
    try:
        run = _Run(target, client, time.perf_counter(), seed, progress, timeout_s)
        ticker = asyncio.get_running_loop().create_task(_tick(progress)) if progress else None
        if on_start is not None:
            on_start()
        tasks = [task async for task in _send(run, planned, max_inflight)]
        await settle(tasks, timeout_s + 5.0)
        wall = time.perf_counter() - run.start
        if ticker is not None:
            ticker.cancel()
        if progress:
            progress.update(final=True)
    finally:
        await client.aclose()
    return sorted(run.results, key=lambda r: r.index), wall


async def settle(tasks: list[asyncio.Task[None]], timeout_s: float) -> None:
    """Wait at most ``timeout_s`` for ``tasks``, then cancel those still running and wait them out (the
    requests' own timeouts should have ended them: this only keeps a run from hanging)."""
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def _send(run: _Run, planned: list[Planned], max_inflight: int) -> AsyncIterator[asyncio.Task[None]]:
    """Start each planned request at its time (one task each); drop those over ``max_inflight``."""
    for i, p in enumerate(planned):
        delay = run.start + p.at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if run.inflight >= max_inflight:
            _drop(run, i, p)
            continue
        run.inflight += 1
        if run.progress:
            run.progress.sent += 1
        yield asyncio.create_task(_one(run, i, p))


def _drop(run: _Run, i: int, p: Planned) -> None:
    run.results.append(
        RequestResult(
            i,
            f"load-{run.seed}-{i}",
            p.at,
            time.perf_counter() - run.start,
            p.prompt_tokens,
            p.output_tokens,
            error="dropped: max in-flight",
        )
    )
    if run.progress:
        run.progress.done += 1
        run.progress.failed += 1


async def _tick(progress: Progress | None) -> None:
    while progress is not None:
        progress.update()
        await asyncio.sleep(0.25)
