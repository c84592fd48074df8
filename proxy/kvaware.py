"""The KV-aware choice of P and D: expected time to first token, given the KV cache each holds.

For one request whose prompt a cache view keyed (:class:`proxy.prefixview.Prompt`), over the P
and D candidates admission offers (drained, ejected and full pools already left out: capacity is
a hard constraint, decided before this), the expected TTFT of sending it to P then D is::

    P queue      backlog(P) / (rate x w(P))            uncached prefill tokens sent to P, not done
  + P prefill    (prompt - cached(P)) / rate           what P computes of this prompt
  + transfer     (prompt - cached(D)) / transfer_rate  the blocks D lacks and pulls from P
  + D queue      D_INFLIGHT_S x inflight(D) / w(D)     a small per-request term

``rate`` is P's prefill rate as the TTFT predictor fitted it (``proxy.predict``: this proxy's own
fit, else the controller's from the stored traces), else ``proxy.kv_aware.prefill_tokens_per_s``
(the predictor's prior too), and ``backlog`` the predictor's count of P; ``transfer_rate`` its
``transfer_tokens_per_s``, and ``w`` an instance's routing weight (times its outlier factor)
relative to the mean weight of its role's candidates. Weights apply as in the load-only
selector (``proxy.selection``): they scale the load terms (an instance of twice the weight
carries twice the queue for the same cost) and draw the ties, so on an idle fleet with nothing
shared the traffic shares follow the weights, and under load the queues even out by weight.
The sum is separable (no term depends on both P and D), so the joint minimum is the cheapest
P with the cheapest D: O(P + D).

D's queue term is small on purpose: D joins a new request to its running batch, so its wait
grows by a decode step's share per request in flight, not by a prefill; what D's choice mostly
changes is the transfer (a D that holds the prefix pulls less). ``D_INFLIGHT_S`` (2 ms per
request) keeps D's load even when the transfer terms tie.

**Bounded affinity.** An instance loses its cache credit (counted as holding nothing) when its
load (requests in flight per unit of relative weight) is over ``affinity_bound`` x the mean load
of its role's candidates, the mean taken as at least 1 (so on an idle fleet a holder keeps its
credit up to ``affinity_bound`` requests in flight). A hot prefix then spills onto a second instance (which
computes it once and holds it too) instead of melting its first holder.

Ties (equal cost: an idle fleet, no sharing, a holder that lost its credit) go to the least
loaded (in flight per weight), then to a draw weighted by the instances' weights (``rng``),
like the load-only selector's; without ``rng`` the first in the given order.

**Conditional disaggregation.** With ``decode_only`` on, a request whose best D would compute
at most ``max_uncached_tokens`` of the prompt itself, or already holds at least
``min_d_cached_ratio`` of it, goes to D alone (``Decision.p`` is None): P would add a round
trip for little prefill.

Pure: no I/O, no clock (nothing here depends on time), randomness only from the ``rng`` passed.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pdscope.config import KvAwareSettings
from proxy.prefixview import Prompt
from proxy.routing import Target

D_INFLIGHT_S = 0.002  # D's wait per request in flight on it (at relative weight 1)
_TIE = 1e-9  # relative: costs this close are a tie

REASON_AFFINITY = "affinity"  # the chosen P holds more of the prompt than another, and that won it
REASON_LOAD = "load"  # no P's cache made a difference: the least loaded won
REASON_AFFINITY_BOUNDED = "affinity_bounded"  # a P holding more lost its credit to the load bound
REASON_NO_PROMPT = "no_prompt"  # the view could not key the prompt: load-only
REASON_VIEW_ERROR = "view_error"  # the view failed on this request: load-only
REASON_KEYING_BUSY = "keying_busy"  # too many long prompts were being tokenized already: load-only
REASON_DECODE_ONLY_SHORT = "decode_only_short"  # D alone: what D lacks is short
REASON_DECODE_ONLY_CACHED = "decode_only_cached"  # D alone: D holds nearly all of the prompt
REASONS = (
    REASON_AFFINITY,
    REASON_LOAD,
    REASON_AFFINITY_BOUNDED,
    REASON_NO_PROMPT,
    REASON_VIEW_ERROR,
    REASON_KEYING_BUSY,
    REASON_DECODE_ONLY_SHORT,
    REASON_DECODE_ONLY_CACHED,
)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One instance admission offers, with what the proxy knows of its load."""

    target: Target
    weight: float  # its routing weight, times its outlier factor (> 0)
    inflight: int  # upstream calls in flight on it
    backlog_tokens: int = 0  # P only: uncached prefill tokens ahead of it (the predictor's backlog)
    rate: float | None = None  # P only: its prefill tokens/s as the predictor fitted it (None: the prior)


@dataclass(frozen=True, slots=True)
class CostModel:
    affinity_bound: float = 1.5
    prefill_tokens_per_s: float = 16000.0
    transfer_tokens_per_s: float = 200000.0
    decode_only: bool = False
    max_uncached_tokens: int = 256
    min_d_cached_ratio: float = 0.9

    @classmethod
    def from_settings(cls, kv: KvAwareSettings) -> CostModel:
        return cls(
            affinity_bound=kv.affinity_bound,
            prefill_tokens_per_s=kv.prefill_tokens_per_s,
            transfer_tokens_per_s=kv.transfer_tokens_per_s,
            decode_only=kv.decode_only.enabled,
            max_uncached_tokens=kv.decode_only.max_uncached_tokens,
            min_d_cached_ratio=kv.decode_only.min_d_cached_ratio,
        )


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes and why. ``p`` is None on the decode-only path."""

    p: Target | None
    d: Target
    p_cached: int  # prompt tokens the view says the chosen P holds (0 when p is None)
    d_cached: int  # ... and the chosen D
    prefix_key: str | None  # hex of the deepest matched block's chain key (8 bytes), any candidate's
    prefix_tokens: int  # tokens of that matched prefix (0: no candidate holds any of the prompt)
    reason: str
    prompt_tokens: int
    cost_s: float  # the expected TTFT of the choice (seconds, the model's)

    @property
    def p_uncached(self) -> int:
        """The prefill tokens this request adds to its P's backlog."""
        return 0 if self.p is None else self.prompt_tokens - self.p_cached


def _clamp(n: object, hi: int) -> int:
    """A view's cached count, trusted only as an int in ``[0, hi]``."""
    if type(n) is not int or n <= 0:  # bool, float, str...: not a count
        return 0
    return n if n < hi else hi


@dataclass(slots=True)
class _Scored:
    cand: Candidate
    raw: int  # cached tokens the view reports
    credit: int  # cached tokens the cost counts (0 when over the load bound)
    rel: float  # relative weight
    cost: float


def _credits(cands: Sequence[Candidate], raw: list[int], bound: float) -> tuple[list[int], list[float]]:
    """Each candidate's credited cached tokens (bounded affinity) and relative weight."""
    n = len(cands)
    mean_w = sum(c.weight for c in cands) / n
    rel = [c.weight / mean_w for c in cands]
    load = [c.inflight / w for c, w in zip(cands, rel, strict=True)]
    # Over the bound: more than bound x the mean load, or than bound requests when the mean is under one
    # (so an idle fleet keeps its affinity for a request or so before a hot prefix spills).
    cap = bound * max(sum(load) / n, 1.0)
    return [r if x <= cap else 0 for r, x in zip(raw, load, strict=True)], rel


def _score(
    cands: Sequence[Candidate],
    cached: Mapping[str, int],
    prompt: int,
    m: CostModel,
    cost: Callable[[Candidate, int, float], float],
) -> list[_Scored]:
    """Each candidate scored: its cached tokens, their credit, its relative weight and
    ``cost(candidate, credit, relative weight)``."""
    raw = [_clamp(cached.get(c.target.name, 0), prompt) for c in cands]
    credit, rel = _credits(cands, raw, m.affinity_bound)
    return [_Scored(c, r, k, w, cost(c, k, w)) for c, r, k, w in zip(cands, raw, credit, rel, strict=True)]


def _score_p(
    cands: Sequence[Candidate], cached: Mapping[str, int], prompt: int, m: CostModel
) -> list[_Scored]:
    prior = m.prefill_tokens_per_s
    return _score(
        cands,
        cached,
        prompt,
        m,
        lambda c, k, w: (max(c.backlog_tokens, 0) / w + prompt - k) / (c.rate or prior),
    )


def _score_d(
    cands: Sequence[Candidate], cached: Mapping[str, int], prompt: int, m: CostModel
) -> list[_Scored]:
    rate = m.transfer_tokens_per_s
    return _score(
        cands, cached, prompt, m, lambda c, k, w: (prompt - k) / rate + D_INFLIGHT_S * c.inflight / w
    )


def _cheapest(scored: list[_Scored], rng: random.Random | None) -> _Scored:
    best = min(s.cost for s in scored)
    tied = [s for s in scored if s.cost <= best + _TIE * max(1.0, abs(best))]
    if len(tied) > 1:
        least = min(s.cand.inflight / s.rel for s in tied)
        tied = [s for s in tied if s.cand.inflight / s.rel <= least]
    if rng is None or len(tied) == 1:
        return tied[0]
    x = rng.random() * sum(s.rel for s in tied)
    for s in tied:
        x -= s.rel
        if x < 0:
            return s
    return tied[-1]


def _prefix(prompt: Prompt, tokens: int) -> tuple[str | None, int]:
    blocks = tokens // prompt.block_tokens if prompt.block_tokens > 0 else 0
    if blocks <= 0 or blocks > len(prompt.keys):
        return None, 0
    return prompt.keys[blocks - 1][:8].hex(), tokens


def _decode_only_reason(d: _Scored, prompt: int, m: CostModel) -> str | None:
    if not m.decode_only:
        return None
    if prompt - d.raw <= m.max_uncached_tokens:
        return REASON_DECODE_ONLY_SHORT
    if d.raw >= m.min_d_cached_ratio * prompt:
        return REASON_DECODE_ONLY_CACHED
    return None


def choose(
    prompt: Prompt,
    cached: Mapping[str, int],
    p_cands: Sequence[Candidate],
    d_cands: Sequence[Candidate],
    model: CostModel,
    rng: random.Random | None = None,
) -> Decision | None:
    """The cheapest (P, D) for ``prompt`` -- or D alone -- given ``cached`` (prompt tokens each
    instance holds, from the view; a missing, stale or bogus entry counts as 0). None when there is
    no D, or no P and the request does not qualify for D alone."""
    if not d_cands:
        return None
    tokens = max(prompt.tokens, 0)
    d_scored = _score_d(d_cands, cached, tokens, model)
    d = _cheapest(d_scored, rng)
    p_scored = _score_p(p_cands, cached, tokens, model) if p_cands else []
    key, prefix_tokens = _prefix(prompt, max(s.raw for s in (*p_scored, *d_scored)))
    alone = _decode_only_reason(d, tokens, model)
    if alone is not None:
        d_cost = (tokens - d.raw) / model.prefill_tokens_per_s + D_INFLIGHT_S * d.cand.inflight / d.rel
        return Decision(None, d.cand.target, 0, d.raw, key, prefix_tokens, alone, tokens, d_cost)
    if not p_scored:
        return None
    p = _cheapest(p_scored, rng)
    if p.credit > min(s.credit for s in p_scored):  # its cache, not only its load, won it
        reason = REASON_AFFINITY
    elif any(s.raw > p.raw and s.credit == 0 for s in p_scored):
        reason = REASON_AFFINITY_BOUNDED
    else:
        reason = REASON_LOAD
    return Decision(
        p.cand.target, d.cand.target, p.raw, d.raw, key, prefix_tokens, reason, tokens, p.cost + d.cost
    )
