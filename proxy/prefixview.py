"""What the KV-aware router asks of a cache view: a request's prompt as block chain keys, and how
many of its tokens each instance already holds.

Three views answer it: precise (the model's tokenizer, matched against vLLM's KV events in
:class:`proxy.kvindex.PrefixIndex`), approximate (no tokenizer, no events: a tree of the
prompts this proxy routed itself, with a TTL and the instances' capacity as bounds), and, in
the benchmark only, an oracle that reads the simulator's true cache. The router
(``proxy.kvaware``) depends on this protocol alone. A view never raises into a request and
never blocks it: a prompt it cannot key is ``None`` and routing is load-only for that request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's prompt as the view keys it."""

    keys: tuple[bytes, ...]  # one chain key per full block, first block first
    tokens: int  # the prompt's length in tokens (an estimate in approximate mode)
    block_tokens: int  # tokens per key
    token_ids: tuple[int, ...] | None = None  # precise mode only


class CacheView(Protocol):
    def prompt(self, endpoint: str, body: Mapping[str, Any]) -> Prompt | None:
        """The prompt of a request to ``endpoint`` (``/v1/completions`` or ``/v1/chat/completions``)
        with JSON ``body``, or None when this view cannot key it."""
        ...

    def cached(self, prompt: Prompt, instances: Sequence[str]) -> dict[str, int]:
        """Prompt tokens each of ``instances`` holds (a prefix, in whole blocks); every one is a key."""
        ...

    def routed(self, prompt: Prompt, instances: Sequence[str], now: float) -> None:
        """The request went to ``instances`` (its P and D, or D alone): they will hold its blocks.
        The approximate view learns from this; the others ignore it."""
        ...
