"""The prefix benchmark's seeded workloads: every request planned up front, body included.

Text is made of words ``w<n>`` (the simulator's tokenizer, ``pdscope.simtokenizer``, makes one
token per word, so lengths are exact in tokens), drawn from a seeded generator: the same seed
gives the same schedule, the same bodies and the same sharing for every contender.

- ``system_prompts``  16 system prompts of 2,000 tokens; each request is one of them (Zipf
                      popularity, exponent 1.0: the first is about 30 % of the traffic) plus a
                      unique user question of 20-60 tokens, on the chat endpoint;
- ``hot_prefix``      as ``system_prompts``, but prompt 0 carries half the traffic and the other
                      15 share the rest evenly;
- ``multi_turn``      conversations of 4-8 turns on the chat endpoint, each with its own 200-token
                      system prompt; turn k resends the whole history (k user messages of 60-160
                      tokens and the k-1 assistant answers of 40-100 tokens before it); turns of one
                      conversation are 2-5 s apart, conversations start as a Poisson process (already
                      under way at time 0: steady state from the first request);
- ``unique``          completions whose 2,000-token prompts share nothing (the control).

Arrivals are open loop (Poisson, or per conversation), at a rate given in requests per second
over the whole ``duration_s``; nothing is sent at or after it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SYSTEM_PROMPTS = 16
SYSTEM_TOKENS = 2000
QUESTION_TOKENS = (20, 60)
ZIPF_S = 1.0
HOT_SHARE = 0.5
CONV_SYSTEM_TOKENS = 200
TURNS = (4, 8)
USER_TOKENS = (60, 160)
ASSISTANT_TOKENS = (40, 100)
THINK_S = (2.0, 5.0)
UNIQUE_TOKENS = 2000
VOCAB = 50_000
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
CHAT_OVERHEAD = 4  # tokens the simulator's chat template adds per message


@dataclass(frozen=True)
class Planned:
    at: float
    endpoint: str
    body: dict[str, Any]  # without model, max_tokens and stream: the client adds them
    prompt_tokens: int
    group: str  # the shared prefix (system prompt or conversation) it belongs to; "" for none


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(VOCAB)}" for _ in range(n))


def _chat(messages: list[dict[str, str]]) -> tuple[dict[str, Any], int]:
    tokens = sum(len(m["content"].split()) + CHAT_OVERHEAD for m in messages)
    return {"messages": messages}, tokens


def _poisson(rng: random.Random, rate: float, duration_s: float) -> list[float]:
    out: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s and len(out) < 1_000_000:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _shared_prefix(weights: list[float], rate: float, duration_s: float, seed: int) -> list[Planned]:
    rng = random.Random(seed)
    prompts = [words(random.Random(seed * 1000 + i), SYSTEM_TOKENS) for i in range(SYSTEM_PROMPTS)]
    out = []
    for at in _poisson(rng, rate, duration_s):
        i = rng.choices(range(SYSTEM_PROMPTS), weights)[0]
        question = words(rng, rng.randint(*QUESTION_TOKENS))
        body, tokens = _chat(
            [{"role": "system", "content": prompts[i]}, {"role": "user", "content": question}]
        )
        out.append(Planned(at, CHAT, body, tokens, f"system-{i}"))
    return out


def zipf_weights(n: int, s: float) -> list[float]:
    raw = [1.0 / (k + 1) ** s for k in range(n)]
    total = sum(raw)
    return [w / total for w in raw]


def system_prompts(rate: float, duration_s: float, seed: int) -> list[Planned]:
    return _shared_prefix(zipf_weights(SYSTEM_PROMPTS, ZIPF_S), rate, duration_s, seed)


def hot_prefix(rate: float, duration_s: float, seed: int) -> list[Planned]:
    rest = (1.0 - HOT_SHARE) / (SYSTEM_PROMPTS - 1)
    return _shared_prefix([HOT_SHARE] + [rest] * (SYSTEM_PROMPTS - 1), rate, duration_s, seed)


def mean_turns() -> float:
    return (TURNS[0] + TURNS[1]) / 2


def multi_turn(rate: float, duration_s: float, seed: int) -> list[Planned]:
    """``rate`` requests/s in steady state: conversations start at ``rate / mean turns`` per second,
    from one longest conversation before 0 on, and only the turns in ``[0, duration_s)`` are kept
    (at 0 conversations are already under way, as on a live service)."""
    rng = random.Random(seed)
    lead = TURNS[1] * THINK_S[1]
    out = []
    for n, start in enumerate(_poisson(rng, rate / mean_turns(), duration_s + lead)):
        start -= lead
        history = [{"role": "system", "content": words(rng, CONV_SYSTEM_TOKENS)}]
        at = start
        for turn in range(rng.randint(*TURNS)):
            if turn:
                history.append({"role": "assistant", "content": words(rng, rng.randint(*ASSISTANT_TOKENS))})
                at += rng.uniform(*THINK_S)
            history.append({"role": "user", "content": words(rng, rng.randint(*USER_TOKENS))})
            if at >= duration_s:
                break
            if at < 0:
                continue
            body, tokens = _chat([dict(m) for m in history])
            out.append(Planned(at, CHAT, body, tokens, f"conv-{n}"))
    return sorted(out, key=lambda p: p.at)


def unique(rate: float, duration_s: float, seed: int) -> list[Planned]:
    rng = random.Random(seed)
    return [
        Planned(at, COMPLETIONS, {"prompt": words(rng, UNIQUE_TOKENS)}, UNIQUE_TOKENS, "")
        for at in _poisson(rng, rate, duration_s)
    ]


WORKLOADS: dict[str, Callable[[float, float, int], list[Planned]]] = {
    "system_prompts": system_prompts,
    "multi_turn": multi_turn,
    "unique": unique,
    "hot_prefix": hot_prefix,
}


def mean_prompt_tokens(planned: list[Planned]) -> float:
    return sum(p.prompt_tokens for p in planned) / max(1, len(planned))
