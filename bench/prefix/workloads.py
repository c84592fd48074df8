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
- ``unique``          completions whose 2,000-token prompts share nothing (the control);
- ``live_chat``       conversations like ``multi_turn``'s (4-8 turns, a 200-token system prompt, user
                      messages of 60-160 tokens, answers of 40-100 tokens), but each turn carries the
                      answer the fleet really returned to the turn before it (``max_tokens`` the
                      answer's planned length; the client reads it from the stream) and is sent
                      only when that answer has arrived plus a think time of 2-5 s: closed loop within a
                      conversation, conversations arriving open loop (Poisson), many of them
                      interleaved. A conversation under way at time 0 starts from its first turn at or
                      after 0 with its earlier history planned (answers as ``multi_turn``'s).

Arrivals are open loop (Poisson, or per conversation), at a rate given in requests per second
over the whole ``duration_s``; nothing is sent at or after it. ``live_chat`` plans
:class:`Conversation` values, not requests: its rate is the nominal one (conversations start at
``rate / mean turns``), and what is sent depends on how fast the fleet answers.
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


@dataclass(frozen=True)
class Conversation:
    """A ``live_chat`` conversation: its history before time 0 (planned), then the turns to send."""

    at: float  # when its first live turn is due
    history: tuple[tuple[str, str], ...]  # (role, content) before the first live turn, system first
    users: tuple[str, ...]  # the user message of each live turn
    thinks: tuple[float, ...]  # seconds from an answer to the next turn (one per live turn after the first)
    answers: tuple[int, ...]  # each live turn's answer length (its max_tokens; ignore_eos)
    group: str
    endpoint: str = CHAT

    @property
    def body(self) -> dict[str, Any]:
        """The first live turn's body."""
        return _chat([*self.messages(), {"role": "user", "content": self.users[0]}])[0]

    @property
    def prompt_tokens(self) -> int:
        """The first live turn's prompt tokens."""
        return self.turn_tokens()[0]

    def messages(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.history]

    def turn_tokens(self) -> list[int]:
        """Each live turn's prompt tokens (the answers' lengths as planned, one token a word)."""
        n = sum(len(c.split()) + CHAT_OVERHEAD for _, c in self.history)
        out = []
        for i, user in enumerate(self.users):
            n += (self.answers[i - 1] + CHAT_OVERHEAD if i else 0) + len(user.split()) + CHAT_OVERHEAD
            out.append(n)
        return out


def live_chat(rate: float, duration_s: float, seed: int) -> list[Conversation]:
    """Conversations starting at ``rate / mean turns`` per second, from one longest conversation
    before 0 on; only those with a turn due in ``[0, duration_s)`` are kept."""
    rng = random.Random(seed)
    lead = TURNS[1] * THINK_S[1]
    out = []
    for n, start in enumerate(_poisson(rng, rate / mean_turns(), duration_s + lead)):
        at = start - lead
        history = [("system", words(rng, CONV_SYSTEM_TOKENS))]
        users: list[str] = []
        thinks: list[float] = []
        answers: list[int] = []
        first = 0.0
        for turn in range(rng.randint(*TURNS)):
            think = rng.uniform(*THINK_S) if turn else 0.0
            answer = words(rng, rng.randint(*ASSISTANT_TOKENS)) if turn else ""
            user = words(rng, rng.randint(*USER_TOKENS))
            at += think
            if not users and turn:  # a turn before 0 was answered: planned, as the history is
                history.append(("assistant", answer))
            if not users and at < 0:  # before time 0: planned history
                history.append(("user", user))
                continue
            if not users:
                first = at
            else:
                thinks.append(think)
            users.append(user)
            answers.append(rng.randint(*ASSISTANT_TOKENS))
        if users and first < duration_s:
            conv = Conversation(
                first, tuple(history), tuple(users), tuple(thinks), tuple(answers), f"conv-{n}"
            )
            out.append(conv)
    return sorted(out, key=lambda c: c.at)


def unique(rate: float, duration_s: float, seed: int) -> list[Planned]:
    rng = random.Random(seed)
    return [
        Planned(at, COMPLETIONS, {"prompt": words(rng, UNIQUE_TOKENS)}, UNIQUE_TOKENS, "")
        for at in _poisson(rng, rate, duration_s)
    ]


Plan = list[Planned] | list[Conversation]

WORKLOADS: dict[str, Callable[[float, float, int], Plan]] = {
    "system_prompts": system_prompts,
    "multi_turn": multi_turn,
    "unique": unique,
    "hot_prefix": hot_prefix,
    "live_chat": live_chat,
}


def request_tokens(plan: Plan) -> list[int]:
    """The prompt tokens of every request of a plan (a conversation's: estimated, every live turn)."""
    out: list[int] = []
    for p in plan:
        out += p.turn_tokens() if isinstance(p, Conversation) else [p.prompt_tokens]
    return out


def mean_prompt_tokens(plan: Plan) -> float:
    tokens = request_tokens(plan)
    return sum(tokens) / max(1, len(tokens))
