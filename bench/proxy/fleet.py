"""A zero-latency P/D fleet for the proxy benchmark, plus an OTLP sink and a routing table.

Why not ``simulator/``: at ``latency_scale: 0`` it tops out near 100 P/D pairs/s on this
2-core machine (measured), below the toy proxy's ceiling, so it would measure itself.
This fleet answers the same wire protocol with canned bodies from raw asyncio protocols
(uvloop + httptools): P returns vLLM's ``kv_transfer_params`` keys and ``usage``; D
answers JSON or an SSE stream of ``--chunks`` events (one write per event, each on its
own loop turn) ending in ``data: [DONE]``. Same process, more ports: ``POST /v1/traces``
(accepts OTLP/HTTP and counts bytes) and ``GET /v1/routing`` (an equal-weight table with
an ETag). Prints one JSON line with the URLs, then serves until stdin closes.

Run: ``python -m bench.proxy.fleet --prefill 2 --decode 2 --chunks 16``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
from typing import Any, cast

import httptools


class _Conn(asyncio.Protocol):
    def __init__(self, node: Node) -> None:
        self.node = node
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.headers: dict[bytes, bytes] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body, url, headers = b"".join(self.body), self.url, self.headers
        self.body, self.url, self.headers = [], b"", {}
        assert self.transport is not None
        self.node.answer(self.transport, self.parser.get_method(), url, headers, body)


def _json(status: int, obj: Any, extra: bytes = b"") -> bytes:
    body = json.dumps(obj).encode()
    return (
        b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n"
        % (status, len(body), extra)
    ) + body


def _completion(rid: str, req: dict[str, Any], text: str, prompt: int, completion: int) -> dict[str, Any]:
    """A whole (non-streamed) completion of ``text`` for ``req``, as vLLM answers it."""
    return {
        "id": f"cmpl-{rid}-0",
        "object": "text_completion",
        "model": req.get("model"),
        "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


class Node:
    def __init__(self, role: str, name: str, chunks: int) -> None:
        self.role, self.name, self.chunks = role, name, chunks
        self.requests = 0
        self.otlp_bytes = 0

    def answer(
        self, tr: asyncio.Transport, method: bytes, url: bytes, headers: dict[bytes, bytes], body: bytes
    ) -> None:
        self.requests += 1
        if self.role == "otlp":
            self.otlp_bytes += len(body)
            tr.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n")
            return
        if self.role == "controller":
            self._routing(tr, headers)
            return
        if method != b"POST":
            tr.write(_json(200, {"status": "ok", "name": self.name}))
            return
        req = json.loads(body)
        rid = headers.get(b"x-request-id", b"none").decode()
        if self.role == "prefill":
            n = len(str(req.get("prompt", ""))) // 4
            kv = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [[1, 2, 3]],
                "remote_engine_id": f"engine-{self.name}",
                "remote_request_id": f"cmpl-{rid}-0-0a1b2c3d",
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
                "tp_size": 1,
                "dcp_size": 1,
                "pp_size": 1,
                "remote_num_tokens": n,
                "remote_blocks_expiry_time": None,
                "remote_registration_generation": 0,
                "transfer_mode": "pull",
            }
            tr.write(_json(200, _completion(rid, req, " the", n, 1) | {"kv_transfer_params": kv}))
            return
        if not req.get("stream"):
            tr.write(_json(200, _completion(rid, req, " the" * self.chunks, 10, self.chunks)))
            return
        tr.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        event = (
            b'data: {"id": "cmpl-%s-0", "object": "text_completion", "model": "bench", "choices": '
            b'[{"index": 0, "text": " the", "logprobs": null, "finish_reason": null}]}\n\n' % rid.encode()
        )
        frame = b"%x\r\n%s\r\n" % (len(event), event)
        done = b"data: [DONE]\n\n"
        tail = b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done)
        loop = asyncio.get_running_loop()

        def write(i: int) -> None:
            if tr.is_closing():
                return
            if i < self.chunks:
                tr.write(frame)
                loop.call_soon(write, i + 1)
            else:
                tr.write(tail)

        write(0)

    def _routing(self, tr: asyncio.Transport, headers: dict[bytes, bytes]) -> None:
        etag = b'"1"'
        if headers.get(b"if-none-match") == etag:
            tr.write(b'HTTP/1.1 304 Not Modified\r\netag: "1"\r\ncontent-length: 0\r\n\r\n')
            return
        tr.write(_json(200, self.table, b'etag: "1"\r\n'))

    table: dict[str, Any] = {}


async def _listen(node: Node) -> tuple[asyncio.Server, str]:
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = await loop.create_server(lambda: _Conn(node), sock=sock, backlog=1024)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}"


async def main(n_prefill: int, n_decode: int, chunks: int) -> None:
    nodes = [Node("prefill", f"prefill-{i}", chunks) for i in range(n_prefill)]
    nodes += [Node("decode", f"decode-{i}", chunks) for i in range(n_decode)]
    otlp, ctl = Node("otlp", "otlp", 0), Node("controller", "controller", 0)
    urls: dict[str, Any] = {"prefill": [], "decode": []}
    servers = []
    for node in nodes:
        server, url = await _listen(node)
        servers.append(server)
        urls[node.role].append(url)
    for node, key in ((otlp, "otlp"), (ctl, "controller")):
        server, url = await _listen(node)
        servers.append(server)
        urls[key] = url
    ctl.table = {
        "version": 1,
        "generated_at": 0.0,
        "mode": "enforce",
        "enforce": True,
        "pools": [],
        "instances": [
            {"name": n.name, "pool": n.role, "role": n.role, "url": u, "weight": 1.0}
            for n, u in zip(nodes, urls["prefill"] + urls["decode"], strict=True)
        ],
    }
    print(json.dumps(urls), flush=True)
    loop = asyncio.get_running_loop()
    stdin_closed = loop.create_future()

    def on_stdin() -> None:
        if not sys.stdin.readline() and not stdin_closed.done():
            stdin_closed.set_result(None)

    loop.add_reader(sys.stdin.fileno(), on_stdin)
    await stdin_closed
    print(
        json.dumps(
            {"otlp_bytes": otlp.otlp_bytes, "otlp_posts": otlp.requests, "routing_polls": ctl.requests}
        ),
        flush=True,
    )
    for server in servers:
        server.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=16)
    a = ap.parse_args()
    try:
        import uvloop

        uvloop.run(main(a.prefill, a.decode, a.chunks))
    except ImportError:
        asyncio.run(main(a.prefill, a.decode, a.chunks))
