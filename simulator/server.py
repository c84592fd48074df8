"""The HTTP face of one simulated instance: a small pure-ASGI app with vLLM's routes.

``/v1/completions`` and ``/v1/chat/completions`` (streaming and not, vLLM's JSON and SSE
chunk shapes, ``X-Request-Id`` as vLLM uses it: ``cmpl-<id>-0`` / ``chatcmpl-<id>``),
``/health``, ``/v1/models``, ``/version`` and ``/metrics``, and the render endpoints
(``/v1/completions/render``, ``/v1/chat/completions/render``: the prompt's token ids,
``render.py``). A prefill instance honours ``kv_transfer_params.do_remote_decode`` and answers
with the keys real P returns; a decode instance honours ``do_remote_prefill`` and pulls the KV
before its first token.
The app does per-request work only in proportion to the tokens it sends; all modelling
is the engine's. It must not block the loop or keep state beyond the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

from pdscope import simtokenizer
from pdscope.vllmapi import model_card
from simulator.instance import SimInstance
from simulator.metrics import CONTENT_TYPE
from simulator.model import RemoteKV, SimRequest
from simulator.render import RenderError, render

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
_VOCAB = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "had",
    "they",
    "you",
    "were",
    "their",
    "one",
    "all",
    "we",
    "can",
    "her",
    "has",
    "there",
)
_TRACE_HEADERS = (b"traceparent", b"tracestate")
_KEPT_HEADERS = frozenset((b"x-request-id", *_TRACE_HEADERS))  # read from each request
# prometheus-fastapi-instrumentator as vLLM configures it: these handlers are not metered,
# and a path that matches no route is grouped under handler "none"
_UNMETERED = ("/metrics", "/health", "/ping", "/version", "/load")
_RENDER = ("/v1/completions/render", "/v1/chat/completions/render")
_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", *_RENDER)


class ClientDisconnected(Exception):
    """The client went away before its request was read."""


class BadRequest(Exception):
    def __init__(
        self, message: str, status: int = 400, kind: str = "BadRequestError", param: str | None = None
    ):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


def _error_body(message: str, status: int, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


MAX_TOKEN_ID = 2**31 - 1  # what the KV events may carry (pdscope.kvevents)


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # vLLM's bounds of a request's priority


def request_priority(data: dict[str, Any]) -> int:
    """The body's ``priority`` as vLLM's request model takes it (pydantic's lax int, within int64; absent:
    0): an int, a bool, a float or a string of an integral value; anything else is a 400 naming it. Any
    value is taken whatever the instance's policy: vLLM 0.32.0's fcfs ignores it."""
    value = data.get("priority", 0)
    n: int | None = None
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        n = int(value)
    elif isinstance(value, str):
        n = _int_text(value.strip())
    if n is None:
        raise BadRequest("priority: Input should be a valid integer", param="priority")
    if not INT64_MIN <= n <= INT64_MAX:
        raise BadRequest(f"priority: Input should be between {INT64_MIN} and {INT64_MAX}", param="priority")
    return n


def _int_text(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        f = float(text)
    except ValueError:
        return None
    return int(f) if f.is_integer() else None


def count_text_tokens(text: str) -> int:
    """The simulator's tokenizer: one token per whitespace-separated word."""
    return len(simtokenizer.text_ids(text))


def _token_list(ids: list[Any]) -> list[int]:
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise BadRequest(f"token ids must be integers in [0, {MAX_TOKEN_ID}]", param="prompt")
    return ids


def prompt_ids_of(data: dict[str, Any], chat: bool) -> list[int]:
    """The prompt's token ids under the simulated tokenizer (pdscope.simtokenizer): a chat's
    messages through its template, a completion's text, or the token ids it sent."""
    if chat:
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list", param="messages")
        return simtokenizer.chat_ids(messages)
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return simtokenizer.text_ids(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return _token_list(prompt)
        if len(prompt) == 1:
            first = prompt[0]
            if isinstance(first, str):
                return simtokenizer.text_ids(first)
            if isinstance(first, list) and first:
                return _token_list(first)
        raise BadRequest("the simulator serves one prompt per request", param="prompt")
    raise BadRequest("prompt must be a string or a list of token ids", param="prompt")


def prompt_tokens_of(data: dict[str, Any], chat: bool) -> int:
    return len(prompt_ids_of(data, chat))


class InstanceApp:
    """ASGI app for one ``SimInstance``."""

    def __init__(self, instance: SimInstance) -> None:
        self.inst = instance

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        method: str = scope["method"]
        started = time.perf_counter()
        req_bytes = 0
        sent = {"status": 200, "bytes": 0}

        async def metered_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                sent["status"] = message["status"]
            elif message["type"] == "http.response.body":
                sent["bytes"] += len(message.get("body", b""))
            await send(message)

        try:
            if path in ("/v1/completions", "/v1/chat/completions") and method == "POST":
                body = await _read_body(receive)
                req_bytes = len(body)
                await self._generate(
                    scope, body, receive, metered_send, chat=path.endswith("chat/completions")
                )
            elif path in _RENDER and method == "POST":
                body = await _read_body(receive)
                req_bytes = len(body)
                await _json(metered_send, 200, self._render(body, chat=path.startswith("/v1/chat/")))
            elif path in ("/health", "/ping") and method == "GET":
                await _respond(metered_send, 200, b"", [])
            elif path == "/metrics" and method == "GET":
                await _respond(
                    metered_send,
                    200,
                    self.inst.metrics.render(self.inst.engine.gauges()),
                    [(b"content-type", CONTENT_TYPE.encode())],
                )
            elif path == "/v1/models" and method == "GET":
                await _json(metered_send, 200, self._models())
            elif path == "/version" and method == "GET":
                await _json(metered_send, 200, {"version": self.inst.cfg.vllm_version})
            else:
                await _json(metered_send, 404, {"detail": "Not Found"})
        except BadRequest as exc:
            await _json(metered_send, exc.status, _error_body(str(exc), exc.status, exc.kind, exc.param))
        except ClientDisconnected:
            return
        if path not in _UNMETERED:
            self.inst.metrics.http_request(
                path if path in _ROUTES else "none",
                method,
                sent["status"],
                req_bytes,
                sent["bytes"],
                time.perf_counter() - started,
            )

    def _models(self) -> dict[str, Any]:
        inst = self.inst
        card = model_card(
            inst.model_name,
            created=inst.created,
            max_model_len=inst.cfg.max_model_len,
            permission_id=uuid.UUID(int=inst.rng.getrandbits(128)).hex,
        )
        return {"object": "list", "data": [card]}

    def _render(self, body: bytes, chat: bool) -> dict[str, Any] | list[dict[str, Any]]:
        try:
            data = json.loads(body)
        except ValueError as exc:
            raise BadRequest(f"invalid JSON body: {exc}") from exc
        try:
            return render(
                data,
                chat,
                self.inst.model_name,
                self.inst.cfg.max_model_len,
                prompt_ids_of,
                lambda: uuid.UUID(int=self.inst.rng.getrandbits(128)).hex,
            )
        except RenderError as exc:
            raise BadRequest(str(exc), exc.status, exc.kind, exc.param) from exc

    # -- generation ----------------------------------------------------------------

    async def _generate(self, scope: Scope, body: bytes, receive: Receive, send: Send, chat: bool) -> None:
        inst = self.inst
        cfg = inst.cfg
        try:
            data = json.loads(body)
        except ValueError as exc:
            raise BadRequest(f"invalid JSON body: {exc}") from exc
        if not isinstance(data, dict):
            raise BadRequest("the body must be a JSON object")
        model = data.get("model", inst.model_name)
        if model != inst.model_name:
            raise BadRequest(f"The model `{model}` does not exist.", 404, "NotFoundError", "model")
        headers = {k: v for k, v in scope["headers"] if k in _KEPT_HEADERS}
        raw_id = headers.get(b"x-request-id")
        base_id = raw_id.decode("latin-1") if raw_id else uuid.UUID(int=inst.rng.getrandbits(128)).hex
        if chat:
            response_id = request_id = f"chatcmpl-{base_id}"
        else:
            response_id, request_id = f"cmpl-{base_id}", f"cmpl-{base_id}-0"
        prompt_ids = prompt_ids_of(data, chat)
        prompt_tokens = len(prompt_ids)
        max_tokens = data.get("max_completion_tokens") if chat else None
        if max_tokens is None:
            max_tokens = data.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise BadRequest("max_tokens must be a positive integer", param="max_tokens")
        room = cfg.max_model_len - prompt_tokens
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise BadRequest(
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, you requested "
                f"{prompt_tokens + (max_tokens or 0)} tokens ({prompt_tokens} in the messages, "
                f"{max_tokens or 0} in the completion).",
                param="max_tokens",
            )
        if inst.engine.blocks_for(prompt_tokens + (max_tokens or 1)) > cfg.kv_capacity_blocks:
            raise BadRequest(
                f"The request needs {prompt_tokens + (max_tokens or 1)} tokens of KV cache but this instance "
                f"holds {cfg.kv_capacity_blocks * cfg.block_size}.",
                param="max_tokens",
            )
        kv = data.get("kv_transfer_params")
        kv = kv if isinstance(kv, dict) else None
        do_remote_decode = bool(kv and kv.get("do_remote_decode")) and inst.role == "prefill"
        remote = RemoteKV.from_params(kv, cfg.transfer_mode) if inst.role == "decode" else None
        if (data.get("n") or 1) != 1:
            raise BadRequest("the simulator serves n=1 only", param="n")
        priority = request_priority(data)
        self._admit(prompt_tokens)
        req = SimRequest(
            request_id=request_id,
            internal_id=f"{request_id}-{inst.next_hex()}",
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens if max_tokens is not None else min(cfg.default_output_tokens, room),
            params_max_tokens=max_tokens,
            n=1,
            stop_at_max=max_tokens is None,
            do_remote_decode=do_remote_decode,
            remote=remote,
            token_ids=tuple(prompt_ids),
            arrival=inst.runner.clock(),
            priority=priority,
        )
        stream = bool(data.get("stream"))
        event = asyncio.Event()
        if stream:
            req.notify = lambda r: event.set()
        else:
            req.notify = lambda r: event.set() if r.finish_reason is not None else None
        inst.runner.submit(req)
        created = int(time.time())
        watcher = asyncio.get_running_loop().create_task(self._watch_disconnect(receive, req))
        try:
            if stream:
                opts = data.get("stream_options")
                usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
                await self._stream(req, event, send, chat, response_id, created, usage)
            else:
                while not req.finished:
                    await event.wait()
                    event.clear()
                await self._complete(req, send, chat, response_id, created)
        except (OSError, asyncio.CancelledError):
            inst.runner.abort(req)
            raise
        finally:
            watcher.cancel()
            if inst.emitter is not None and req.finished:
                carrier = {k.decode(): v.decode("latin-1") for k, v in headers.items() if k in _TRACE_HEADERS}
                inst.emitter.emit(req, inst.wall_offset, carrier, data)

    def _admit(self, prompt_tokens: int) -> None:
        """vLLM's frontend queue limits: reject with 503 and count the reason."""
        cfg = self.inst.cfg
        if cfg.max_num_queued_reqs is None and cfg.max_num_queued_tokens is None:
            return
        queued, tokens = self.inst.engine.queued()
        reason = None
        if cfg.max_num_queued_reqs is not None and queued >= cfg.max_num_queued_reqs:
            reason = "max_num_queued_reqs"
        elif cfg.max_num_queued_tokens is not None and tokens + prompt_tokens > cfg.max_num_queued_tokens:
            reason = "max_num_queued_tokens"
        if reason is not None:
            self.inst.metrics.rejections[reason].inc()
            raise BadRequest(
                f"The server is overloaded ({reason} reached); retry later.", 503, "ServiceUnavailableError"
            )

    async def _watch_disconnect(self, receive: Receive, req: SimRequest) -> None:
        """Abort the request when the client goes away, as vLLM does."""
        while not req.finished:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not req.finished:
                    self.inst.runner.abort(req)
                return

    def _text(self, req: SimRequest, start: int, end: int) -> str:
        h = zlib.crc32(req.internal_id.encode())
        return "".join(" " + _VOCAB[(h + i * 7) % len(_VOCAB)] for i in range(start, end))

    def _kv_out(self, req: SimRequest) -> dict[str, Any] | None:
        if (
            not req.do_remote_decode
            or req.finish_reason not in ("length", "stop")
            or not req.leased_block_ids
        ):
            return None
        return self.inst.kv_transfer_params(req.internal_id, list(req.leased_block_ids), req.prompt_tokens)

    def _id_header(self, response_id: str) -> list[tuple[bytes, bytes]]:
        if not self.inst.cfg.request_id_headers:
            return []
        base = response_id.split("-", 1)[1] if "-" in response_id else response_id
        return [(b"x-request-id", base.encode("latin-1"))]

    def _usage(self, req: SimRequest) -> dict[str, Any]:
        return {
            "completion_tokens": req.generated,
            "completion_tokens_details": None,
            "prompt_tokens": req.prompt_tokens,
            # vLLM with --enable-prompt-tokens-details (always on here): num_cached_tokens, which on D
            # is the local hit plus the tokens pulled from P (vLLM counts every token computed before
            # the request's first step; the facts file does not spell D out)
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
            "total_tokens": req.prompt_tokens + req.generated,
        }

    async def _complete(self, req: SimRequest, send: Send, chat: bool, rid: str, created: int) -> None:
        if req.finish_reason in ("error", "abort"):
            status = 500
            await _json(
                send,
                status,
                _error_body(
                    f"Request {req.request_id} failed: finish_reason={req.finish_reason}",
                    status,
                    "InternalServerError",
                ),
            )
            return
        text = self._text(req, 0, req.generated)
        inst = self.inst
        common: dict[str, Any] = {
            "finish_reason": req.finish_reason,
            "index": 0,
            "logprobs": None,
            "routed_experts": None,
            "stop_reason": None,
            "token_ids": None,
        }
        if chat:
            choice = {
                **common,
                "message": {
                    "annotations": None,
                    "audio": None,
                    "content": text,
                    "function_call": None,
                    "reasoning": None,
                    "refusal": None,
                    "role": "assistant",
                },
            }
        else:
            choice = {**common, "prompt_logprobs": None, "prompt_token_ids": None, "text": text}
        body: dict[str, Any] = {
            "choices": [choice],
            "created": created,
            "ec_transfer_params": None,
            "id": rid,
            "kv_transfer_params": self._kv_out(req),
            "metrics": None,
            "model": inst.model_name,
            "object": "chat.completion" if chat else "text_completion",
            "service_tier": None,
            "system_fingerprint": inst.system_fingerprint,
            "usage": self._usage(req),
        }
        if chat:
            body.update(prompt_logprobs=None, prompt_text=None, prompt_token_ids=None)
        await _respond(send, 200, _dumps(body).encode(), _JSON + self._id_header(rid))

    async def _stream(
        self,
        req: SimRequest,
        event: asyncio.Event,
        send: Send,
        chat: bool,
        rid: str,
        created: int,
        include_usage: bool,
    ) -> None:
        model = self.inst.model_name
        obj = "chat.completion.chunk" if chat else "text_completion"
        await send({"type": "http.response.start", "status": 200, "headers": _SSE + self._id_header(rid)})
        # the part every chunk shares, serialised once; chunks only add their choice
        head = (
            'data: {"id":'
            + _dumps(rid)
            + ',"object":"'
            + obj
            + '","created":'
            + str(created)
            + ',"model":'
            + _dumps(model)
            + ',"choices":['
        ).encode()
        sent = 0

        async def chunk(body: bytes) -> None:
            await send({"type": "http.response.body", "body": body, "more_body": True})

        if chat:
            await event.wait()  # vLLM sends the role with the first output
            if not req.finish_reason or req.generated:
                await chunk(
                    head + b'{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
                    b'"finish_reason":null}]}\n\n'
                )
        while True:
            await event.wait()
            event.clear()
            done = req.finished
            if req.finish_reason in ("error", "abort"):
                error = _error_body(
                    f"Request {req.request_id} failed: finish_reason={req.finish_reason}",
                    500,
                    "InternalServerError",
                )
                await chunk(b"data: " + _dumps(error).encode() + b"\n\n")
                break
            new = req.generated
            if new > sent or done:
                text = _dumps(self._text(req, sent, new))
                sent = new
                finish = _dumps(req.finish_reason) if done else "null"
                if chat:
                    choice = (
                        f'{{"index":0,"delta":{{"content":{text}}},"logprobs":null,"finish_reason":{finish}}}'
                    )
                else:
                    choice = (
                        f'{{"index":0,"text":{text},"logprobs":null,"finish_reason":{finish},'
                        f'"stop_reason":null}}'
                    )
                tail = f',"kv_transfer_params":{_dumps(self._kv_out(req))}' if done else ""
                await chunk(head + choice.encode() + b"]" + tail.encode() + b"}\n\n")
            if done:
                if include_usage:
                    await chunk(head + b"]," + _dumps({"usage": self._usage(req)})[1:].encode() + b"\n\n")
                break
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def _dumps(value: Any) -> str:
    """Compact JSON, as vLLM's responses are."""
    return json.dumps(value, separators=(",", ":"))


async def _read_body(receive: Receive, limit: int | None = None) -> bytes:
    """The request's body; over ``limit`` bytes raises BadRequest (413) without reading the rest."""
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            raise BadRequest(f"the body is over {limit} bytes", 413, "RequestEntityTooLarge")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def _respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _json(send: Send, status: int, payload: dict[str, Any] | list[dict[str, Any]]) -> None:
    await _respond(send, status, _dumps(payload).encode(), _JSON)
