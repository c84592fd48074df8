"""vLLM's render endpoints: a request's prompt as the token ids the engine would run, without running it.

``POST /v1/completions/render`` takes a completion request and answers a JSON **list** with one
``GenerateRequest`` per prompt; ``POST /v1/chat/completions/render`` takes a chat request and
answers one ``GenerateRequest`` object. A ``GenerateRequest`` is vLLM's tokens-in request
(``vllm/entrypoints/serve/disagg/protocol.py``): ``request_id`` (``cmpl-<uuid>`` /
``chatcmpl-<uuid>``), ``token_ids``, ``features`` (multimodal; always null here),
``sampling_params``, ``model``, ``stream``, ``stream_options`` (only when streaming),
``cache_salt``, ``priority``, ``kv_transfer_params`` (null: render never sets it).

Routers key their prefix-cache view with these ids (vllm-router's ``kv_aware`` policy asks a
worker's render endpoint before it picks the prefill instance), so they must be the ids the
instance caches and publishes in its KV events: :func:`simulator.server.prompt_ids_of`, the
simulated tokenizer (``pdscope.simtokenizer``). ``sampling_params`` carries the fields the
request sets, over vLLM's ``SamplingParams`` defaults; ``max_tokens`` defaults to, and is cut to, the
room the prompt leaves in ``max_model_len``, as vLLM's ``get_max_tokens`` does. A bad request is the
same 400 the generating endpoints give, naming the field; fields the simulator does not model
(``echo``, ``skip_special_tokens`` and the like, which vllm-router sends) are ignored, as vLLM
accepts them.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

# vLLM's SamplingParams defaults for the fields a request can set (vllm/sampling_params.py)
SAMPLING_DEFAULTS: dict[str, Any] = {
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "seed": None,
    "stop": [],
    "stop_token_ids": [],
    "ignore_eos": False,
    "min_tokens": 0,
    "logprobs": None,
    "prompt_logprobs": None,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False,
}
_NUMBERS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p")
_INTS = ("top_k", "min_tokens", "seed")
_BOOLS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output")


class RenderError(ValueError):
    """A request the render endpoint refuses: a 400 (or ``status``) naming ``param``."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, kind: str = "BadRequestError"
    ):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _typed(data: dict[str, Any], key: str) -> Any:
    """``data[key]`` checked against the type its default has (None: absent)."""
    v = data.get(key)
    if v is None:
        return None
    if key in _NUMBERS:
        if not isinstance(v, int | float) or isinstance(v, bool):
            raise RenderError(f"{key} must be a number", key)
        return float(v)
    if key in _INTS:
        if not _is_int(v):
            raise RenderError(f"{key} must be an integer", key)
        return v
    if not isinstance(v, bool):
        raise RenderError(f"{key} must be a boolean", key)
    return v


def _stops(data: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    stop = data.get("stop")
    if isinstance(stop, str):
        out["stop"] = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        out["stop"] = list(stop)
    elif stop is not None:
        raise RenderError("stop must be a string or a list of strings", "stop")
    ids = data.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
            raise RenderError("stop_token_ids must be a list of integers", "stop_token_ids")
        out["stop_token_ids"] = list(ids)
    return out


def _logprobs(data: dict[str, Any], chat: bool) -> int | None:
    """chat: ``logprobs`` is a flag and ``top_logprobs`` the count; completion: ``logprobs`` is the count."""
    if chat:
        flag, count, name = data.get("logprobs"), data.get("top_logprobs"), "top_logprobs"
        if flag is not None and not isinstance(flag, bool):
            raise RenderError("logprobs must be a boolean", "logprobs")
        count = (0 if count is None else count) if flag else None
    else:
        count, name = data.get("logprobs"), "logprobs"
    if count is not None and (not _is_int(count) or count < 0):
        raise RenderError(f"{name} must be a non-negative integer", name)
    return count if count is None else int(count)


def sampling_params(data: dict[str, Any], max_tokens: int, chat: bool) -> dict[str, Any]:
    """The request's sampling fields over vLLM's defaults; a field of the wrong type is refused."""
    out = dict(SAMPLING_DEFAULTS)
    for key in (*_NUMBERS, *_INTS, *_BOOLS):
        v = _typed(data, key)
        if v is not None:
            out[key] = v
    out.update(_stops(data))
    n = data.get("n")
    if n is not None:
        if not _is_int(n) or n < 1:
            raise RenderError("n must be a positive integer", "n")
        out["n"] = n
    logprobs = _logprobs(data, chat)
    if logprobs is not None:
        out["logprobs"] = logprobs
    out["max_tokens"] = max_tokens
    return out


def _max_tokens(data: dict[str, Any], chat: bool, prompt_tokens: int, max_model_len: int) -> int:
    """The request's ``max_tokens`` (``max_completion_tokens`` first for chat) as vLLM 0.32 takes it:
    more than ``max_model_len`` on its own, or a prompt longer than the context, is a 400; otherwise it
    is cut to the room the prompt leaves (``get_max_tokens``), which is also the default."""
    asked = data.get("max_completion_tokens") if chat else None
    param = "max_completion_tokens" if asked is not None else "max_tokens"
    if asked is None:
        asked = data.get("max_tokens")
    if asked is not None and (not _is_int(asked) or asked < 1):
        raise RenderError("max_tokens must be a positive integer", "max_tokens")
    if asked is not None and asked > max_model_len:
        raise RenderError(
            f"{param}={asked} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            param,
        )
    room = max_model_len - prompt_tokens
    if room < 1:
        raise RenderError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"contains {prompt_tokens} input tokens, which exceeds this limit even without any output "
            "tokens. Please reduce the length of the input prompt.",
            "input_tokens",
        )
    return min(int(asked), room) if asked is not None else room


def _generate_request(
    data: dict[str, Any],
    token_ids: list[int],
    prefix: str,
    chat: bool,
    max_model_len: int,
    new_id: Callable[[], str],
) -> dict[str, Any]:
    stream = data.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RenderError("stream must be a boolean", "stream")
    salt = data.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise RenderError("cache_salt must be a non-empty string", "cache_salt")
    priority = data.get("priority", 0)
    if not _is_int(priority):
        raise RenderError("priority must be an integer", "priority")
    max_tokens = _max_tokens(data, chat, len(token_ids), max_model_len)
    return {
        "request_id": f"{prefix}-{new_id()}",
        "token_ids": token_ids,
        "features": None,
        "sampling_params": sampling_params(data, max_tokens, chat),
        "model": data.get("model"),
        "stream": bool(stream),
        "stream_options": data.get("stream_options") if stream else None,
        "cache_salt": salt,
        "priority": priority,
        "kv_transfer_params": None,
    }


def completion_prompts(
    data: dict[str, Any], prompt_ids_of: Callable[[dict[str, Any], bool], list[int]]
) -> list[list[int]]:
    """Each prompt of a completion request as token ids: one string or token list, or a batch of them
    (vLLM renders every prompt of a batch; the generating endpoint serves one)."""
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        return [prompt_ids_of({"prompt": [p]}, False) for p in prompt]
    return [prompt_ids_of(data, False)]


def render(
    data: Any,
    chat: bool,
    model_name: str,
    max_model_len: int,
    prompt_ids_of: Callable[[dict[str, Any], bool], list[int]],
    new_id: Callable[[], str] = lambda: uuid.uuid4().hex,
) -> dict[str, Any] | list[dict[str, Any]]:
    """The render endpoints' answer for a parsed JSON body: one GenerateRequest (chat) or a list
    (completion). ``prompt_ids_of`` raises for a malformed prompt; this raises :class:`RenderError`."""
    if not isinstance(data, dict):
        raise RenderError("the body must be a JSON object")
    model = data.get("model", model_name)
    if model != model_name:
        raise RenderError(f"The model `{model}` does not exist.", "model", 404, "NotFoundError")
    body = {**data, "model": model}
    if data.get("use_beam_search"):
        raise RenderError("Beam search is not supported by the render endpoint", "use_beam_search")
    if chat:
        return _generate_request(body, prompt_ids_of(body, True), "chatcmpl", True, max_model_len, new_id)
    return [
        _generate_request(body, ids, "cmpl", False, max_model_len, new_id)
        for ids in completion_prompts(body, prompt_ids_of)
    ]
