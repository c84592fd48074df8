"""The tenants bench's open-loop client: every tenant's planned requests at their times, each with its
tenant's header, streamed and timed as ``pdscope load`` does (``simulator.loadgen.read_stream``), and a
rejection's reason read from the proxy's error body (``{"error": {"code": REASON}}``, the reason its
``pdscope_proxy_rejections_total`` counts it under).

Bounded: a finite schedule, a per-request timeout, at most ``max_inflight`` open (a request past it
is recorded as dropped, never delayed), and the stragglers cancelled ``timeout_s + 5`` s after the
last send (``simulator.loadgen.settle``). Prompts share no prefix (each starts with its own tag).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from bench.tenants.figures import Sent
from bench.tenants.scenarios import HEADER
from simulator.httpclient import HttpClientError, Pool
from simulator.loadgen import read_stream, settle
from simulator.workload import Planned, RequestResult


def completion_body(model: str, p: Planned, tag: str) -> dict[str, Any]:
    """A streamed completion of ``p.prompt_tokens`` words (the first its own ``tag``) and
    ``p.output_tokens`` tokens out."""
    return {
        "model": model,
        "prompt": " ".join([tag, *["hi"] * (max(1, p.prompt_tokens) - 1)]),
        "max_tokens": p.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


def rejection_reason(status: int, body: bytes) -> str:
    """The proxy's reason for a rejection: its error body's ``code``, else ``HTTP <status>``."""
    try:
        code = json.loads(body).get("error", {}).get("code")
    except (ValueError, AttributeError):
        code = None
    return str(code) if code else f"HTTP {status}"


@dataclass
class _Client:
    pool: Pool
    url: str
    model: str
    timeout_s: float
    max_inflight: int
    salt: str = field(default_factory=lambda: secrets.token_hex(4))
    start: float = field(default_factory=time.perf_counter)
    sent: list[Sent] = field(default_factory=list)
    inflight: int = 0

    async def _exchange(self, s: Sent, body: dict[str, Any], t0: float) -> None:
        headers = {"X-Request-Id": s.result.request_id, HEADER: s.tenant}
        async with self.pool.post(self.url, body, headers) as resp:
            if resp.status_code == 200:
                await read_stream(resp, s.result, t0)
                return
            s.result.status = resp.status_code
            s.result.error = f"HTTP {resp.status_code}"
            s.reason = rejection_reason(resp.status_code, await resp.aread())

    async def one(self, s: Sent, p: Planned) -> None:
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                body = completion_body(self.model, p, f"{s.result.request_id}-{self.salt}")
                await self._exchange(s, body, t0)
        except TimeoutError:
            s.result.error = "timeout"
        except (HttpClientError, OSError, ValueError) as exc:
            s.result.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.inflight -= 1

    async def send(self, planned: list[tuple[str, Planned]]) -> list[asyncio.Task[None]]:
        tasks = []
        for i, (tenant, p) in enumerate(planned):
            delay = self.start + p.at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            res = RequestResult(
                i, f"{tenant}-{i}", p.at, time.perf_counter() - self.start, p.prompt_tokens, p.output_tokens
            )
            s = Sent(tenant, res)
            self.sent.append(s)
            if self.inflight >= self.max_inflight:
                res.error = "dropped: max in-flight"
                continue
            self.inflight += 1
            tasks.append(asyncio.create_task(self.one(s, p)))
        return tasks


async def run_tenants(
    base_url: str,
    planned: list[tuple[str, Planned]],
    *,
    model: str,
    timeout_s: float,
    max_inflight: int = 4096,
) -> list[Sent]:
    """Send ``planned`` (tenant, request) open loop to ``base_url``'s completions; every request's
    outcome, in plan order."""
    pool = Pool(max_idle=max_inflight)
    client = _Client(pool, base_url.rstrip("/") + "/v1/completions", model, timeout_s, max_inflight)
    try:
        await settle(await client.send(planned), timeout_s + 5.0)
    finally:
        await pool.aclose()
    return client.sent
