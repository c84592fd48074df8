"""The approximate cache view: what the proxy itself routed, without a tokenizer or KV events.

For fleets that publish no KV events, or whose tokenizer the proxy does not have. A prompt's
text is cut into blocks of ``block_chars`` characters and every full block keyed by a chain
digest (of its parent's key and its text; the first block's seeded with the request's
``model``, so an adapter's prompts share nothing with the base model's). A chat is rendered
canonically, its tools (as JSON) first, then each message as its role, a newline, its content
and a record separator, so a conversation that resends its history keys the same first blocks
as its previous turn. Token counts are estimates: ``chars_per_token`` characters per token (learnt, below).

:meth:`ApproxView.routed` records that the request's instances now hold its blocks, with the
time; :meth:`ApproxView.cached` credits each instance the longest run of the prompt's keys,
from the first, that it holds and has used within ``ttl_s``. What an instance really holds is
bounded by its KV capacity, so the view forgets in the same way: per instance at most
``capacity_tokens`` worth of blocks, the least recently used first; and at most ``max_entries``
(instance, block) entries in all, the least recently used fleet-wide first. A request's blocks
are touched last block first, so its first blocks are the most recent and eviction shortens a
chain from its tail, never leaving a tail without its head (vLLM evicts in the same order).
Expired entries are pruned lazily, from the old end, when an instance is read or written.

The view checks its predictions (:meth:`ApproxView.verify`: the request's
``usage.prompt_tokens_details.cached_tokens`` against the tokens the view credited it, with
:class:`proxy.kvtrust.HitCheck`'s rule and counts, without distrust), so its health shows per
instance. It does not act on a miss: in open-loop traffic a turn sent before the previous one's
prefill ran misses without any eviction (issue 33 measured a capacity that halved on misses
losing most of multi_turn's affinity), so the capacity stays ``capacity_tokens``.

What vLLM reports also says how long the prompt was in vLLM's tokens (P's or D's ``usage.prompt_tokens``):
``chars_per_token`` is learnt from them (:meth:`ApproxView._learn_chars_per_token`), so a prompt's
token estimate, which the cost model, decode-only and admission by prediction all use, becomes
vLLM's count whatever the configured figure; reported cached tokens are compared with the
prediction in the view's own estimate (scaled by the request's two counts). The keys, and the
capacity's unit (blocks of ``block_chars``), do not change.

Pure: no I/O; the clock is injected (``clock`` for reads, ``now`` for writes: the same clock).
One thread (the proxy's event loop).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from proxy.kvtrust import HitCheck, Verdict
from proxy.prefixview import Prompt
from proxy.prompts import DEFAULT_MAX_CHARS, Ids, Refused, Text, prompt_of

_ROOT = b"pdscope-approx-root\0"
CPT_PRIOR_TOKENS = 2000  # the configured chars_per_token counts as this many tokens seen
CPT_DECAY = 0.98  # per checked request: the learnt chars_per_token follows the last ~50 prompts
CPT_RANGE = 8.0  # ... within this factor of the configured one
_RS = "\x1e"  # ends every message of a canonical chat (a character no real prompt relies on)


def chat_text(messages: Sequence[Mapping[str, Any]], tools: Any = None) -> str:
    """A chat as one canonical text: per message, its role, a newline, its content, a separator;
    first the request's tools, if any, as JSON (templates render them ahead of the messages)."""
    head = f"tools\n{json.dumps(tools, sort_keys=True, default=str)}{_RS}" if tools else ""
    return head + "".join(f"{m.get('role')}\n{m.get('content') or ''}{_RS}" for m in messages)


def block_keys(text: str, block_chars: int, seed: str) -> list[bytes]:
    """The chain key of every full ``block_chars``-character block of ``text``, first block first."""
    keys: list[bytes] = []
    parent = _ROOT + seed.encode("utf-8", "surrogatepass") + b"\0"
    for start in range(0, len(text) - block_chars + 1, block_chars):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(text[start : start + block_chars].encode("utf-8", "surrogatepass"))
        parent = h.digest()
        keys.append(parent)
    return keys


class ApproxView:
    """A :class:`proxy.prefixview.CacheView` learnt from the proxy's own routing."""

    def __init__(
        self,
        block_chars: int,
        chars_per_token: float,
        ttl_s: float,
        capacity_tokens: int,
        max_entries: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_chars: int = DEFAULT_MAX_CHARS,
    ) -> None:
        if block_chars <= 0 or chars_per_token <= 0 or ttl_s <= 0 or capacity_tokens <= 0 or max_entries <= 0:
            raise ValueError(
                "block_chars, chars_per_token, ttl_s, capacity_tokens and max_entries must be positive"
            )
        self.block_chars = block_chars
        self.chars_per_token = chars_per_token  # learnt from vLLM's prompt counts (verify)
        self._cpt_bounds = (chars_per_token / CPT_RANGE, chars_per_token * CPT_RANGE)
        self._chars, self._tokens = chars_per_token * CPT_PRIOR_TOKENS, float(CPT_PRIOR_TOKENS)
        self.block_tokens = max(1, round(block_chars / chars_per_token))  # as configured: capacity's unit
        self.ttl_s = ttl_s
        self.capacity_blocks = max(1, capacity_tokens // self.block_tokens)
        self.max_entries = max_entries
        self.clock = clock
        self.max_chars = max_chars
        self._held: dict[str, OrderedDict[bytes, float]] = {}  # instance -> key -> last used, LRU first
        self._all: OrderedDict[tuple[str, bytes], None] = OrderedDict()  # fleet-wide LRU
        self.refused: Counter[str] = Counter()
        self.evicted = 0  # over an instance's capacity or the fleet-wide bound
        self.expired = 0
        self.trust = HitCheck(self.block_tokens, distrust=False)  # predictions against vLLM's reports

    # -- the protocol -------------------------------------------------------------------

    def prompt(self, endpoint: str, body: Mapping[str, Any]) -> Prompt | None:
        p = prompt_of(endpoint, body, self.max_chars)
        if not isinstance(p, Refused) and body.get("truncate_prompt_tokens") is not None:
            p = Refused("truncate")  # vLLM drops the prompt's head past that many tokens: not countable here
        if isinstance(p, Refused | Ids):  # ids: their text is unknown, and a count of chars meaningless
            self.refused[p.reason if isinstance(p, Refused) else "token_ids"] += 1
            return None
        text = p.text if isinstance(p, Text) else chat_text(p.messages, body.get("tools"))
        if len(text) > self.max_chars:  # the tools, which prompt_of does not count
            self.refused["too_long"] += 1
            return None
        model = body.get("model")
        keys = block_keys(text, self.block_chars, model if isinstance(model, str) else "")
        tokens = max(1, round(len(text) / self.chars_per_token))
        return Prompt(tuple(keys), tokens, max(1, round(self.block_chars / self.chars_per_token)))

    def cached(self, prompt: Prompt, instances: Sequence[str]) -> dict[str, int]:
        now = self.clock()
        out: dict[str, int] = {}
        for inst in instances:
            held = self._held.get(inst)
            if held is None:
                out[inst] = 0
                continue
            self._expire(inst, held, now)
            run = 0
            for key in prompt.keys:
                used = held.get(key)
                if used is None or now - used > self.ttl_s:
                    break
                run += 1
            out[inst] = run * prompt.block_tokens
        return out

    def routed(self, prompt: Prompt, instances: Sequence[str], now: float) -> None:
        for inst in dict.fromkeys(instances):  # P and D may be one instance (D alone): once
            held = self._held.setdefault(inst, OrderedDict())
            self._expire(inst, held, now)
            for key in reversed(prompt.keys[: self.capacity_blocks]):
                held[key] = now
                held.move_to_end(key)
                self._all[(inst, key)] = None
                self._all.move_to_end((inst, key))
            while len(held) > self.capacity_blocks:
                key, _ = held.popitem(last=False)
                del self._all[(inst, key)]
                self.evicted += 1
        while len(self._all) > self.max_entries:
            (inst, key), _ = self._all.popitem(last=False)
            del self._held[inst][key]
            self.evicted += 1
        for inst in [i for i, held in self._held.items() if not held]:
            del self._held[inst]

    def verify(
        self,
        instance: str,
        predicted: int,
        reported: int | None,
        prompt_tokens: tuple[int, int] | None = None,
    ) -> Verdict:
        """A finished request's check: the cached tokens credited to ``instance`` when it was routed
        against those vLLM ``reported`` (None: not reported, nothing checked). ``prompt_tokens``: the
        prompt's length as this view estimated it and as vLLM counted it, so ``reported`` is compared in
        the view's own (estimated) tokens: a wrong ``chars_per_token`` is no miss; and the view learns
        vLLM's characters per token from them. The check is counted (``trust``); a miss changes nothing."""
        if prompt_tokens is not None and prompt_tokens[0] > 0 and prompt_tokens[1] > 0:
            if reported is not None:
                reported = round(reported * prompt_tokens[0] / prompt_tokens[1])
            self._learn_chars_per_token(*prompt_tokens)
        return self.trust.observe(instance, predicted, reported, self.clock())

    def _learn_chars_per_token(self, estimated: int, counted: int) -> None:
        """vLLM counted ``counted`` tokens in a prompt this view estimated at ``estimated``: characters
        per token follow the recent prompts' (decayed sums, within a factor of ``CPT_RANGE`` of the
        configured figure), so the prompt lengths the cost model and admission use are vLLM's."""
        self._chars = self._chars * CPT_DECAY + estimated * self.chars_per_token
        self._tokens = self._tokens * CPT_DECAY + counted
        lo, hi = self._cpt_bounds
        self.chars_per_token = min(hi, max(lo, self._chars / self._tokens))

    # -- reads for metrics and tests ----------------------------------------------------

    def blocks(self, instance: str) -> int:
        return len(self._held.get(instance, ()))

    def __len__(self) -> int:
        return len(self._all)

    # -- internals ----------------------------------------------------------------------

    def _expire(self, inst: str, held: OrderedDict[bytes, float], now: float) -> None:
        """Drop ``inst``'s entries unused for over ``ttl_s``, oldest first (LRU order is time order
        while the clock does not go back; one that did only delays a prune, never a miss)."""
        while held:
            key, used = next(iter(held.items()))
            if now - used <= self.ttl_s:
                return
            del held[key]
            del self._all[(inst, key)]
            self.expired += 1
