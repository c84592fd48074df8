"""The client's body checked at the proxy boundary, before any prefill is spent.

P gets the body with ``max_tokens=1`` and ``stream=false`` (see ``proxy.protocol``), so P
accepts requests that D then refuses with a 400 -- after P has pinned the prompt's KV
blocks until their lease ends. This module rejects, up front, what vLLM's OpenAI server
(its request models and ``SamplingParams`` checks) would reject at D for the fields that
matter to the P/D flow, with the field named in the error. It is deliberately a subset:
what it lets through, D still validates (and a D 4xx is the client's error, not D's).

Rules (``None``/absent means vLLM's default for every field):
- ``prompt`` (completions): a string, a list of strings, a list of token ids or a list of
  lists of token ids, not empty; ``messages`` (chat): a non-empty list of objects each with
  a string ``role``.
- ``max_tokens`` / ``max_completion_tokens``: an integer >= 1 (a JSON boolean is not an
  integer); at most ``max_model_len - 1`` when that is configured. ``min_tokens``: an
  integer >= 0, not above ``max_tokens``.
- ``n``: an integer >= 1. ``temperature``: in [0, 2]. ``top_p``: in (0, 1]. ``top_k``: an
  integer >= -1. ``min_p``: in [0, 1]. ``presence_penalty`` / ``frequency_penalty``: in
  [-2, 2]. ``repetition_penalty``: > 0. Numbers are finite JSON numbers, never booleans.
- ``stream``: a JSON boolean (vLLM would read ``"false"`` as false; the proxy must not guess
  whether to stream); a non-empty ``stream_options`` only with ``stream: true`` (vLLM
  refuses it otherwise), and an object.
- ``model``: a string.

Pure: no I/O, no logging.
"""

from __future__ import annotations

import math
from typing import Any


class InvalidRequest(Exception):
    """The body breaks a rule; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _int_at_least(body: dict[str, Any], key: str, low: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not _is_int(value) or value < low:
        raise InvalidRequest(key, f"{key} must be an integer >= {low}, got {value!r:.40}")
    return int(value)


def _number_in(
    body: dict[str, Any], key: str, low: float, high: float, *, low_open: bool = False, what: str
) -> None:
    value = body.get(key)
    if value is None:
        return
    if not _is_number(value):
        raise InvalidRequest(key, f"{key} must be a finite number, got {value!r:.40}")
    if value < low or value > high or (low_open and value == low):
        raise InvalidRequest(key, f"{key} must be {what}, got {value!r}")


def _check_prompt(body: dict[str, Any]) -> None:
    prompt = body.get("prompt")
    if prompt is None:
        if body.get("prompt_embeds") is not None:
            return  # vLLM's alternative input; D checks it
        raise InvalidRequest("prompt", "prompt is required")
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequest("prompt", "prompt must be a string or a non-empty list of strings or token ids")
    if all(isinstance(p, str) for p in prompt) or all(_is_int(t) for t in prompt):
        return
    if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
        return
    raise InvalidRequest(
        "prompt",
        "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids",
    )


def _check_messages(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if messages is None:
        raise InvalidRequest("messages", "messages is required")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages", "messages must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{i}]", f"messages[{i}] must be an object with a string role")


def check_body(endpoint: str, body: dict[str, Any], max_model_len: int | None = None) -> None:
    """Raise :class:`InvalidRequest` for the first rule ``body`` breaks (see the module doc)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("model", "model must be a string")
    if endpoint == "/v1/chat/completions":
        _check_messages(body)
    else:
        _check_prompt(body)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest("stream", f"stream must be a JSON boolean (true or false), got {stream!r:.40}")
    options = body.get("stream_options")
    if options is not None:
        if options and stream is not True:
            raise InvalidRequest("stream_options", "stream_options can only be set when stream is true")
        if not isinstance(options, dict):
            raise InvalidRequest("stream_options", "stream_options must be an object")
    limit = None
    for key in ("max_tokens", "max_completion_tokens"):
        value = _int_at_least(body, key, 1)
        if value is None:
            continue
        if max_model_len is not None and value >= max_model_len:
            raise InvalidRequest(
                key,
                f"{key} ({value}) leaves no room for the prompt: the model's maximum "
                f"context length is {max_model_len} tokens",
            )
        limit = value if limit is None else min(limit, value)
    min_tokens = _int_at_least(body, "min_tokens", 0)
    if min_tokens is not None and limit is not None and min_tokens > limit:
        raise InvalidRequest("min_tokens", f"min_tokens ({min_tokens}) must not exceed max_tokens ({limit})")
    _int_at_least(body, "n", 1)
    _number_in(body, "temperature", 0.0, 2.0, what="in [0, 2]")
    _number_in(body, "top_p", 0.0, 1.0, low_open=True, what="in (0, 1]")
    _int_at_least(body, "top_k", -1)
    _number_in(body, "min_p", 0.0, 1.0, what="in [0, 1]")
    for key in ("presence_penalty", "frequency_penalty"):
        _number_in(body, key, -2.0, 2.0, what="in [-2, 2]")
    _number_in(body, "repetition_penalty", 0.0, math.inf, low_open=True, what="a number > 0")
