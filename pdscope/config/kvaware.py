"""``proxy.kv_aware``: KV-aware routing and conditional disaggregation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pdscope.config.base import Count1M, PositiveFraction, _Frozen


class DecodeOnlySettings(_Frozen):
    """Conditional disaggregation: when P would add little, D alone computes the prompt."""

    enabled: bool = False
    """send a request to D alone (no prefill round trip, no KV handoff) when the thresholds below say its P
    would add little"""
    max_uncached_tokens: int = Field(default=256, ge=0, le=10_000_000)
    """D alone when the prompt tokens the best D does not hold are at most this many"""
    min_d_cached_ratio: PositiveFraction = 0.9
    """D alone when the best D already holds at least this share of the prompt"""


class KvAwareSettings(_Frozen):
    """KV-aware routing (docs/proxy.md): P and D chosen by expected TTFT given the KV cache each holds."""

    mode: Literal["off", "approximate", "precise"] = "off"
    """off: load-only routing (weights and in-flight load); approximate: a tree of the prompts this proxy
    routed (no tokenizer, no events); precise: the prompt tokenized with model.tokenizer and matched
    against the instances' KV events (kv_events_endpoint)"""
    affinity_bound: float = Field(default=1.5, ge=1, le=1000)
    """an instance whose load (in-flight requests per weight) would go over this multiple of its role's mean
    load loses its cache credit for the request, so a hot prefix spills onto another instance instead of
    melting one"""
    prefill_tokens_per_s: float = Field(default=16000, gt=0, le=1e9)
    """the prefill rate of one P (at weight 1) the cost model assumes"""
    transfer_tokens_per_s: float = Field(default=200000, gt=0, le=1e12)
    """the rate at which D pulls KV from P, in tokens, that the cost model assumes"""
    max_index_blocks: int = Field(default=1_000_000, ge=1, le=1_000_000_000)
    """precise mode: (instance, block) entries the prefix index holds fleet-wide; the least recently stored go
    first"""
    approx_block_chars: Count1M = 64
    """approximate mode: characters of prompt text per block of the prompt tree"""
    approx_chars_per_token: float = Field(default=4.0, gt=0, le=1000)
    """approximate mode: characters per token, to estimate a prompt's tokens: the starting figure, then learnt
    from the prompt tokens vLLM counts (within 8x of this)"""
    approx_ttl_s: float = Field(default=300, gt=0, le=86400 * 7)
    """approximate mode: a prompt routed this long ago is assumed evicted"""
    approx_capacity_tokens: int = Field(default=500000, ge=1, le=10**12)
    """approximate mode: the prompt tokens one instance is assumed to keep cached (its KV capacity); past it,
    its least recently routed prompts are forgotten"""
    event_queue_max: int = Field(default=10000, ge=1, le=10_000_000)
    """precise mode: KV event messages queued per instance before the newest are dropped (a drop shows as a
    sequence gap)"""
    decode_only: DecodeOnlySettings = DecodeOnlySettings()
    """conditional disaggregation: when D alone serves a request"""
