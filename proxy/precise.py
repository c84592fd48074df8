"""The precise cache view: the model's tokenizer against vLLM's own KV events.

A request's prompt is tokenized as vLLM will tokenize it (``proxy.tokenize``), cut into the
fleet's blocks and keyed as :mod:`proxy.kvindex` keys the blocks the instances report having
stored, so :meth:`PreciseView.cached` is what each instance held at its last event: no guess,
only lag. Tokenization runs outside the index's lock; the lock (shared with the subscriber
thread, ``proxy.kvsubscriber``) is held only for the match, a few dictionary look-ups per block.

LoRA: vLLM keys an adapter's blocks apart from the base model's (``BlockStored.lora_name``).
A request names its adapter in ``model``; a ``model`` that is neither absent nor
``base_model`` is taken to be an adapter's name (:func:`adapter_of`), which is how vLLM serves
adapters (``--lora-modules name=path``, requested as ``"model": "name"``).

Trust but verify (:mod:`proxy.kvtrust`): :meth:`PreciseView.verify` checks each credited
prediction against the cached tokens vLLM reported for the request; an instance whose predicted
hits keep failing to come true (forged events, a cache lost without an event) is distrusted,
credited nothing for a backoff (logged as a warning; ``pdscope_proxy_kv_index_stale`` is 1 for
it), then on probation until a prediction comes true.

Never raises into a request: a prompt it cannot key is ``None`` (counted in ``refused``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from proxy.kvindex import PrefixIndex, chain_keys
from proxy.kvtrust import HitCheck, Verdict
from proxy.prefixview import Prompt
from proxy.tokenize import Tokenizer

log = logging.getLogger(__name__)


def adapter_of(body: Mapping[str, Any], base_model: str | None) -> str | None:
    """The LoRA adapter ``body`` asks for: its ``model`` when that is a name other than the base model's."""
    model = body.get("model")
    if not isinstance(model, str) or not model or base_model is None or model == base_model:
        return None
    return model


class PreciseView:
    """A :class:`proxy.prefixview.CacheView` over a :class:`PrefixIndex` fed by KV events."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        index: PrefixIndex,
        lock: threading.Lock,
        *,
        base_model: str | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tokenizer = tokenizer
        self.clock = clock
        self.index = index
        self.lock = lock
        self.base_model = base_model
        self.block_size = index.block_size  # one truth: the size the index keys events in
        self.refused: Counter[str] = Counter()
        self.trust = HitCheck(self.block_size)

    def prompt(self, endpoint: str, body: Mapping[str, Any]) -> Prompt | None:
        try:
            ids = self.tokenizer.ids(endpoint, body)
            if ids is None:
                self.refused["tokenizer"] += 1
                return None
            keys = chain_keys(ids, self.block_size, adapter_of(body, self.base_model))
            return Prompt(tuple(keys), len(ids), self.block_size, tuple(ids))
        except Exception:  # never into the request: it is routed on load alone
            log.exception("precise view: a prompt could not be keyed")
            self.refused["error"] += 1
            return None

    def cached(self, prompt: Prompt, instances: Sequence[str]) -> dict[str, int]:
        now = self.clock()
        with self.lock:
            self.index.distrusted = self.trust.distrusted(now)
            return self.index.match(prompt.keys, instances)

    def verify(
        self,
        instance: str,
        predicted: int,
        reported: int | None,
        prompt_tokens: tuple[int, int] | None = None,
    ) -> Verdict:
        """A finished request's check: the cached tokens credited to ``instance`` when it was routed
        against those vLLM ``reported`` (None: not reported, nothing checked). ``prompt_tokens`` (the
        view's count and vLLM's) is not needed: this view counts with the model's own tokenizer."""
        now = self.clock()
        with self.lock:
            verdict = self.trust.observe(instance, predicted, reported, now)
            self.index.distrusted = self.trust.distrusted(now)
        if verdict == "distrusted":
            log.warning(
                "kv events: %s's predicted prefix hits did not come true (%d predicted, %d reported): "
                "its events are not trusted for now",
                instance,
                predicted,
                reported,
            )
        elif verdict == "trusted":
            log.info("kv events: %s's predicted hits come true again: its events are trusted", instance)
        return verdict

    def routed(self, prompt: Prompt, instances: Sequence[str], now: float) -> None:
        """Nothing to learn: the instances' own events will say what they stored."""
