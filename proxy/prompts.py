"""A request's prompt as the cache views read it: completion text, token ids, or chat messages.

The precise view tokenizes it (``proxy.tokenize``), the approximate one cuts its text into
blocks (``proxy.approx``); both key only what they can key exactly, and refuse the rest with a
reason (:class:`Refused`), so that routing is load-only for that request:

- ``/v1/completions``: ``prompt`` a string, a list of token ids (ints in ``[0, 2**32)``), or a
  list holding one of either. A batch of several prompts is refused (``batch``: one request,
  several prompts, no one prefix), so is ``prompt_embeds`` (``embeds``).
- ``/v1/chat/completions``: ``messages`` a non-empty list of objects whose ``content`` is a
  string, null, or a list of text parts; the text parts are joined with ``"\\n"`` into one
  string, as vLLM does for templates that take a message's content as a string. Any other
  part (an image, audio, a file) is refused (``multimodal``): its blocks carry hashes of the
  media that pdscope cannot compute. ``continue_final_message`` is refused (vLLM cuts the
  rendered template after the last message, which pdscope does not mimic).
- ``cache_salt`` (either endpoint) is refused: vLLM folds the salt into the first block's hash,
  so a salted prompt shares nothing with the same tokens unsalted, and the KV events do not
  say which salt a block was stored under.
- ``truncate_prompt_tokens``: vLLM keeps only the last that many tokens of a longer prompt;
  :func:`kept` does the same to the ids. Any value but a positive integer is refused.
- Bounded: a prompt over ``max_chars`` characters (text, or the chat's contents plus
  :data:`MESSAGE_OVERHEAD` per message; ids count one each) is refused (``too_long``) before
  any work proportional to it, so one hostile body cannot cost the proxy seconds.

Pure: no I/O, never raises.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
DEFAULT_MAX_CHARS = 1_000_000
MESSAGE_OVERHEAD = 32  # characters charged per chat message: a template's markers, a role
_MAX_ID = 2**32  # token ids are keyed as unsigned 32-bit (proxy.kvindex)


@dataclass(frozen=True, slots=True)
class Text:
    text: str


@dataclass(frozen=True, slots=True)
class Ids:
    ids: list[int]


@dataclass(frozen=True, slots=True)
class Chat:
    messages: list[dict[str, Any]]  # copies, every content a string (or None)


@dataclass(frozen=True, slots=True)
class Refused:
    reason: str  # a short label for a counter: batch, embeds, multimodal, too_long, shape, ...


def prompt_of(
    endpoint: str, body: Mapping[str, Any], max_chars: int = DEFAULT_MAX_CHARS
) -> Text | Ids | Chat | Refused:
    """What ``body`` (the JSON of a request to ``endpoint``) asks the model to continue."""
    if body.get("cache_salt") is not None:
        return Refused("cache_salt")
    keep = body.get("truncate_prompt_tokens")
    if keep is not None and not (type(keep) is int and keep > 0):
        return Refused("truncate")  # -1 is vLLM's "to max_model_len", which the proxy does not know
    if endpoint == COMPLETIONS:
        return _completion(body, max_chars)
    if endpoint == CHAT:
        return _chat(body, max_chars)
    return Refused("endpoint")


def _is_ids(value: list[Any]) -> bool:
    return bool(value) and all(type(t) is int and 0 <= t < _MAX_ID for t in value)


def _completion(body: Mapping[str, Any], max_chars: int) -> Text | Ids | Refused:
    if body.get("prompt_embeds") is not None:
        return Refused("embeds")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return Text(prompt) if len(prompt) <= max_chars else Refused("too_long")
    if not isinstance(prompt, list):
        return Refused("shape")
    if len(prompt) > max_chars:
        return Refused("too_long")
    if _is_ids(prompt):
        return Ids(list(prompt))
    if len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        return Refused("batch")
    return Refused("shape")


def _content(content: Any) -> str | Refused | None:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        return Refused("shape")
    texts: list[str] = []
    for part in content:
        if not isinstance(part, dict):
            return Refused("shape")
        kind = part.get("type")
        if kind != "text":
            return Refused("multimodal" if isinstance(kind, str) else "shape")
        text = part.get("text")
        if not isinstance(text, str):
            return Refused("shape")
        texts.append(text)
    return "\n".join(texts)


def _chat(body: Mapping[str, Any], max_chars: int) -> Chat | Refused:
    if body.get("continue_final_message") is True:
        return Refused("continue_final_message")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return Refused("shape")
    if len(messages) * MESSAGE_OVERHEAD > max_chars:
        return Refused("too_long")
    out: list[dict[str, Any]] = []
    chars = 0
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return Refused("shape")
        content = _content(m.get("content"))
        if isinstance(content, Refused):
            return content
        chars += MESSAGE_OVERHEAD + (len(content) if content is not None else 0)
        if chars > max_chars:
            return Refused("too_long")
        out.append({**m, "content": content})
    return Chat(out)


def kept(ids: list[int], body: Mapping[str, Any]) -> list[int]:
    """The ids vLLM keeps of a prompt: the last ``truncate_prompt_tokens`` (``prompt_of`` refused any
    value but a positive integer)."""
    keep = body.get("truncate_prompt_tokens")
    return ids[-keep:] if type(keep) is int and 0 < keep < len(ids) else ids
