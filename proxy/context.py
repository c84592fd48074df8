"""Does the request fit the model's context? Checked before admission, so P never prefills a prompt
that D must refuse (vLLM refuses ``prompt tokens + max_tokens > max_model_len`` with a 400; P,
asked for one token, does not, and pins the prompt's KV blocks until their lease runs out).

The length (:class:`ContextCheck`): ``proxy.max_model_len`` when set, else the smallest
``max_model_len`` that the instances serving the request's model report on ``/v1/models``
(:class:`proxy.models.ModelCatalog`); nothing is checked while neither is known.

The prompt's tokens, in order of precision:

- exact, from the model's tokenizer (``model.tokenizer``, loaded by ``proxy.tokenize``: the one
  home of tokenization): the ids the precise KV-aware view already computed for this request, or,
  in the other modes, the same tokenizer run here (off the event loop for a long body);
- otherwise a floor that never exceeds the true count (:func:`token_floor`): a token is at most
  :data:`MAX_BYTES_PER_TOKEN` bytes of UTF-8, so a text of ``b`` bytes is at least
  ``ceil(b / MAX_BYTES_PER_TOKEN)`` tokens; token ids count one each. A chat counts the contents of
  its non-assistant messages only (a chat template may drop an earlier assistant turn's reasoning)
  and nothing for the template, whose overhead is unknown without the tokenizer. A floor rejects
  only grossly oversized prompts: configure ``model.tokenizer`` for the exact check.

The rule: a prompt of ``max_model_len`` tokens or more is refused (no room for one token); with
``proxy.max_tokens_overflow: refuse`` (the default: what the simulator, OpenAI and older vLLM do) so
is a prompt plus ``max_tokens`` over ``max_model_len`` -- ``max_tokens`` the smaller of
``max_tokens`` and ``max_completion_tokens`` when set; when neither is, vLLM's default is the room
left, so only the prompt is checked. vLLM 0.32 clamps ``max_tokens`` to the room left instead of
refusing (``get_max_tokens``); for such a fleet ``clamp`` refuses only the prompt that leaves no room.
``truncate_prompt_tokens`` (a positive integer) caps the count, as vLLM truncates.

Never raises but :class:`proxy.validate.InvalidRequest`; never blocks the loop for a long prompt.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from proxy.models import ModelCatalog
from proxy.prefixview import Prompt
from proxy.prompts import CHAT
from proxy.tokenize import Tokenizer
from proxy.validate import InvalidRequest

# The longest token of any vocabulary the check may meet, in UTF-8 bytes. SentencePiece's default
# caps a piece at 16 characters (at most 64 bytes); byte-level BPE vocabularies (GPT-2, cl100k,
# Llama 3, Qwen) hold runs of spaces, dashes or repeated CJK phrases, the longest of them well
# under 256 bytes. Larger is safer and weaker: the floor is only ever a floor.
MAX_BYTES_PER_TOKEN = 256
OFFLOAD_BYTES = 32 * 1024  # a body this large is tokenized on a worker thread
OFFLOAD_MAX = 8  # long prompts tokenized at once; past it the floor is used


@dataclass(frozen=True, slots=True)
class Count:
    tokens: int
    exact: bool  # from the tokenizer; else a floor


def _text_floor(text: str, per_token: float = MAX_BYTES_PER_TOKEN) -> int:
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / per_token)


def _prompt_floor(prompt: Any, per_token: float = MAX_BYTES_PER_TOKEN) -> int | None:
    if isinstance(prompt, str):
        return _text_floor(prompt, per_token)
    if not isinstance(prompt, list) or not prompt:
        return None
    if all(isinstance(p, str) for p in prompt):  # a batch: each prompt must fit on its own
        return max(_text_floor(p, per_token) for p in prompt)
    if all(isinstance(p, list) for p in prompt):
        return max(len(p) for p in prompt)
    return len(prompt)  # token ids


def _content_bytes(content: Any) -> int:
    if isinstance(content, str):
        return len(content.encode("utf-8", "surrogatepass"))
    if isinstance(content, list):  # text parts count; an image or audio part adds tokens, not counted
        return sum(
            _content_bytes(p.get("text")) for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return 0


def token_floor(endpoint: str, body: Mapping[str, Any], per_token: float = MAX_BYTES_PER_TOKEN) -> int | None:
    """A count the prompt's tokens are at least (see the module docstring), or None when unknown.
    With ``per_token`` (bytes of text per token) under the longest token's, an estimate instead:
    the TTFT predictor's (``proxy.predict.chars_per_token``)."""
    if endpoint == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        size = sum(
            _content_bytes(m.get("content"))
            for m in messages
            if isinstance(m, dict) and m.get("role") != "assistant"
        )
        floor: int | None = math.ceil(size / per_token)
    elif body.get("prompt_embeds") is not None:
        return None
    else:
        floor = _prompt_floor(body.get("prompt"), per_token)
    keep = body.get("truncate_prompt_tokens")
    if keep is None or floor is None:
        return floor
    return min(floor, keep) if type(keep) is int and keep > 0 else None


def requested_tokens(endpoint: str, body: Mapping[str, Any]) -> tuple[str, int] | None:
    """(the field, its value): the smaller of ``max_tokens`` and ``max_completion_tokens`` when set
    (``proxy.validate`` already checked each is an integer >= 1)."""
    keys = ("max_completion_tokens", "max_tokens") if endpoint == CHAT else ("max_tokens",)
    set_ = [(k, body[k]) for k in keys if type(body.get(k)) is int]
    return min(set_, key=lambda kv: kv[1]) if set_ else None


def verdict(
    endpoint: str, body: Mapping[str, Any], limit: int, count: Count, clamp: bool = False
) -> InvalidRequest | None:
    """vLLM's refusal, worded as vLLM words it, when the prompt and ``max_tokens`` cannot fit ``limit``;
    ``clamp`` (``proxy.max_tokens_overflow: clamp``): only a prompt that leaves no room is refused."""
    n = count.tokens
    has = f"{n}" if count.exact else f"at least {n}"
    field = "messages" if endpoint == CHAT else "prompt"
    if n >= limit:
        return InvalidRequest(
            field,
            f"This model's maximum context length is {limit} tokens. However, your request has {has} "
            f"input tokens. Please reduce the length of the {field}.",
        )
    asked = None if clamp else requested_tokens(endpoint, body)
    if asked is not None and n + asked[1] > limit:
        key, m = asked
        return InvalidRequest(
            key,
            f"'{key}' is too large: {m}. This model's maximum context length is {limit} tokens and "
            f"your request has {has} input tokens ({m} > {limit} - {n}).",
        )
    return None


class ContextCheck:
    """The check the flow runs once per request, between keying the prompt and admission."""

    def __init__(
        self,
        catalog: ModelCatalog,
        override: int | None = None,
        tokenizer: Tokenizer | None = None,
        on_reject: Callable[[str], None] | None = None,
        clamp: bool = False,
    ) -> None:
        self.catalog, self.override, self.tokenizer, self.clamp = catalog, override, tokenizer, clamp
        self.on_reject = on_reject  # (how the prompt was counted: "tokenizer" or "floor")
        self.offloaded = 0

    def limit(self, body: Mapping[str, Any]) -> int | None:
        if self.override is not None:
            return self.override
        model = body.get("model")
        return self.catalog.max_model_len(model if isinstance(model, str) else None)

    async def check(
        self, endpoint: str, body: Mapping[str, Any], size: int, keyed: Prompt | None
    ) -> int | None:
        """Raise :class:`InvalidRequest` when the request cannot fit; ``keyed``: the prompt as the
        precise view tokenized it (its ``token_ids`` set), if it was. Returns the prompt's exact token
        count where it was counted (the TTFT predictor's best count), else None."""
        limit = self.limit(body)
        if limit is None:
            return None
        floor = token_floor(endpoint, body)
        if floor is not None:
            self._raise(verdict(endpoint, body, limit, Count(floor, False), self.clamp), "floor")
        exact = await self._exact(endpoint, body, size, keyed)
        if exact is not None:
            self._raise(verdict(endpoint, body, limit, Count(exact, True), self.clamp), "tokenizer")
        return exact

    def _raise(self, refusal: InvalidRequest | None, how: str) -> None:
        if refusal is None:
            return
        if self.on_reject is not None:
            self.on_reject(how)
        raise refusal

    async def _exact(
        self, endpoint: str, body: Mapping[str, Any], size: int, keyed: Prompt | None
    ) -> int | None:
        if keyed is not None and keyed.token_ids is not None:
            return keyed.tokens
        tok = self.tokenizer
        if tok is None:
            return None
        if size < OFFLOAD_BYTES:
            ids = tok.ids(endpoint, body)
        elif self.offloaded >= OFFLOAD_MAX:
            return None
        else:
            self.offloaded += 1
            try:
                ids = await asyncio.to_thread(tok.ids, endpoint, body)
            finally:
                self.offloaded -= 1
        return None if ids is None else len(ids)
