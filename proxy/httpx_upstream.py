"""The same upstream seam as ``proxy.upstream``, on ``httpx.AsyncClient`` (for comparison).

``pdscope proxy --upstream-client httpx`` uses it; the benchmark runs it beside the lean
client to show what httpx's connection pool costs on the hot path. Errors are translated
to the ``proxy.upstream`` tree; closing an unfinished answer closes its connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import TracebackType

import httpx

from proxy.upstream import (
    ConnectFailed,
    HeaderPairs,
    UpstreamClosed,
    UpstreamError,
    UpstreamTimeout,
    read_all,
)


def _translate(exc: httpx.HTTPError, where: str) -> UpstreamError:
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return ConnectFailed(f"connect to {where} failed: {exc}")
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"{where}: {exc}")
    return UpstreamClosed(f"{where}: {exc}")


class HttpxResponse:
    def __init__(self, resp: httpx.Response, where: str, closing: set[asyncio.Task[None]]) -> None:
        self._resp = resp
        self._closing = closing
        self._where = where
        self.status = resp.status_code
        self._iter: AsyncIterator[bytes] = resp.aiter_raw()

    def header(self, name: bytes) -> bytes | None:
        value = self._resp.headers.get(name.decode("latin-1"))
        return value.encode("latin-1") if value is not None else None

    async def next_chunk(self) -> bytes | None:
        try:
            return await self._iter.__anext__()
        except StopAsyncIteration:
            return None
        except httpx.HTTPError as exc:
            raise _translate(exc, self._where) from exc

    async def read(self) -> bytes:
        return await read_all(self)

    def close(self) -> None:
        # httpx closes asynchronously: schedule it (an unfinished answer drops its connection).
        if not self._resp.is_closed:
            task = asyncio.get_running_loop().create_task(self._resp.aclose())
            self._closing.add(task)  # keep a reference until it is done
            task.add_done_callback(self._closing.discard)

    async def __aenter__(self) -> HttpxResponse:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._resp.aclose()


class HttpxUpstream:
    def __init__(self, *, connect_timeout: float, max_connections: int = 1024) -> None:
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=connect_timeout),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )
        self._closing: set[asyncio.Task[None]] = set()

    async def post(
        self, base_url: str, path: str, body: bytes, headers: HeaderPairs = (), *, within_s: float
    ) -> HttpxResponse:
        where = base_url + path
        req = self._client.build_request(
            "POST",
            where,
            content=body,
            headers=[("content-type", "application/json"), *headers],
            timeout=httpx.Timeout(within_s, connect=self._client.timeout.connect),
        )
        try:
            resp = await self._client.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise _translate(exc, where) from exc
        return HttpxResponse(resp, where, self._closing)

    async def aclose(self) -> None:
        await self._client.aclose()
