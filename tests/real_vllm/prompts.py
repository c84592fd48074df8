"""Unique prompts for tests that share one real vLLM pair.

D keeps a prefix cache, so a prompt it has seen would be served from its own cache and skip
the NIXL pull; every prompt here starts with a fresh nonce. Words come from the tiny model's
tokenizer training text so token counts stay small (about 1.4 tokens per word).
"""

from __future__ import annotations

import uuid

_WORDS = [
    "prefill",
    "decode",
    "cache",
    "tokens",
    "blocks",
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "hello",
    "world",
    "requests",
    "leases",
    "transfers",
    "simple",
    "readability",
    "counts",
]


def unique_prompt(words: int, tag: str = "") -> str:
    """About ``words`` words after a unique nonce; keep ``words`` <= 200 (max_model_len is 512)."""
    nonce = uuid.uuid4().hex[:12]
    body = " ".join(_WORDS[(i * 5 + len(tag)) % len(_WORDS)] for i in range(words))
    return f"{nonce} {tag} {body}".strip()
