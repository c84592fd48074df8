"""The simulator's tokenizer: deterministic token ids for a prompt, the same in every process.

The simulated instances count and cache prompts in these ids, and the proxy's precise KV-aware
mode uses the same function when ``model.tokenizer`` is :data:`NAME`, so prefix matching runs
end to end without a real model. One token per whitespace-separated word (the count the
simulator has always reported); a word's id is a digest of the word, never Python's ``hash``
(salted per process). A chat prompt is rendered by a fixed template of four tokens per
message (start, role, end, newline) around the message's words, the overhead vLLM's chat
templates add, so a conversation that resends its history shares its token prefix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

NAME = "pdscope-sim"
VOCAB = 32000
_SPECIAL = {"<|start|>": 1, "<|end|>": 2, "\n": 3}
_ROLES = {"system": 4, "user": 5, "assistant": 6, "tool": 7, "developer": 8}
_FIRST_WORD_ID = 16
_MAX_CACHE = 65536
_cache: dict[str, int] = {}


def word_id(word: str) -> int:
    got = _cache.get(word)
    if got is None:
        digest = hashlib.blake2b(word.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        got = _FIRST_WORD_ID + int.from_bytes(digest, "big") % (VOCAB - _FIRST_WORD_ID)
        if len(_cache) < _MAX_CACHE:
            _cache[word] = got
    return got


def text_ids(text: str) -> list[int]:
    """The ids of a completion prompt: one per word, at least one (an empty prompt is one token)."""
    words = text.split()
    if not words:
        return [_SPECIAL["\n"]]
    return [word_id(w) for w in words]


def message_text(content: Any) -> str:
    """A chat message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def chat_ids(messages: Sequence[Any]) -> list[int]:
    """The ids of a chat prompt under the simulator's template: per message, start, role, the
    content's words, end, newline (unknown roles share one id; non-dict messages count as empty)."""
    out: list[int] = []
    for m in messages:
        role = m.get("role") if isinstance(m, dict) else None
        content = m.get("content") if isinstance(m, dict) else None
        out.append(_SPECIAL["<|start|>"])
        out.append(_ROLES.get(role, 9) if isinstance(role, str) else 9)
        out.extend(word_id(w) for w in message_text(content).split())
        out.append(_SPECIAL["<|end|>"])
        out.append(_SPECIAL["\n"])
    return out
