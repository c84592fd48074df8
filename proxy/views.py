"""The cache view ``proxy.kv_aware.mode`` names, built from plain settings (:func:`make_view`).

The app reads its settings once and calls this; the router gets a
:class:`proxy.prefixview.CacheView` (or None: routing on load alone) and never learns which.
The precise view needs the :class:`proxy.kvindex.PrefixIndex` and the lock that the KV-events
subscriber (``proxy.kvsubscriber``) writes under, so the caller builds those and passes them in.

Errors: :class:`proxy.tokenize.TokenizerError` when ``model.tokenizer`` cannot be loaded;
``ValueError`` for a combination the config layer should already have refused (precise without
a tokenizer or an index).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal

from proxy.approx import ApproxView
from proxy.kvindex import PrefixIndex
from proxy.precise import PreciseView
from proxy.prefixview import CacheView
from proxy.prompts import DEFAULT_MAX_CHARS
from proxy.tokenize import load_tokenizer

Mode = Literal["off", "approximate", "precise"]


def make_view(
    mode: Mode,
    *,
    tokenizer: str | None = None,
    base_model: str | None = None,
    index: PrefixIndex | None = None,
    lock: threading.Lock | None = None,
    approx_block_chars: int = 64,
    approx_chars_per_token: float = 4.0,
    approx_ttl_s: float = 300.0,
    approx_capacity_tokens: int = 500_000,
    max_index_blocks: int = 1_000_000,
    max_prompt_chars: int = DEFAULT_MAX_CHARS,
    clock: Callable[[], float] = time.monotonic,
) -> CacheView | None:
    """The view for ``mode``: None for ``off``; ``approximate`` takes the ``approx_*`` settings and
    ``max_index_blocks`` as its fleet-wide bound; ``precise`` loads ``tokenizer`` (``model.tokenizer``)
    and reads ``index`` under ``lock``. ``clock`` must be the clock the router passes to ``routed``."""
    if mode == "off":
        return None
    if mode == "approximate":
        return ApproxView(
            approx_block_chars,
            approx_chars_per_token,
            approx_ttl_s,
            approx_capacity_tokens,
            max_index_blocks,
            clock=clock,
            max_chars=max_prompt_chars,
        )
    if mode == "precise":
        if tokenizer is None:
            raise ValueError("model.tokenizer is required when proxy.kv_aware.mode is precise")
        if index is None or lock is None:
            raise ValueError("the precise view needs the KV-events prefix index and its lock")
        return PreciseView(
            load_tokenizer(tokenizer, max_chars=max_prompt_chars),
            index,
            lock,
            base_model=base_model,
            clock=clock,
        )
    raise ValueError(f"proxy.kv_aware.mode: {mode!r} is not one of off, approximate, precise")
