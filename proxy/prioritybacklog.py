"""What is ahead of a request in the queue of a P that vLLM schedules by priority (``proxy.priority``).

Under fcfs every token this proxy sent to P and P has not answered is ahead of a new request
(:attr:`proxy.predict.Predictor.backlog`). Under vLLM's priority policy the waiting queue goes by
(priority, arrival), so a request waits only behind the waiting work of a lower or equal priority number,
and behind what P already runs: vLLM schedules its running requests before it takes any waiter, and does
not preempt one for a waiter (only for KV blocks a running request needs).

Which of a P's requests it already runs the proxy cannot see. A request counts as *started* once the wait
predicted for it when it was sent (its predicted P part less its own tokens' share of it) is over: one sent
to a P with nothing ahead has started at once. A request passed by one of a lower number starts that
one's own predicted time later. Other errors (a prediction that was short) count a request as started
early: the pessimistic error (it is predicted ahead of a request it may not delay). So the tokens ahead
of a request of priority ``q`` are those of every request in flight of a priority ``<= q`` and those of
the started ones of a larger number.

**Passed requests teach nothing.** A request that a later one of a lower number was sent past (it had
not started) waits for work that was not there when it was predicted: its time says nothing of P's
rate, nor of the model's noise. Counted in, the passed requests of a flooding tenant taught P's line a
steeper slope and P's error margin a larger factor, and every request through that P, the ones that
passed them included, was then predicted late. :meth:`PriorityBacklog.passed` says which they are.

Pure: no I/O, no clock (``now`` is passed in).
"""

from __future__ import annotations

from typing import NamedTuple


class _Sent(NamedTuple):
    tokens: int
    priority: int
    started_at: float  # when P is predicted to have started it (sent at + its predicted wait)


class PriorityBacklog:
    """Per P, this proxy's requests sent and not answered, each with its priority and predicted start."""

    def __init__(self) -> None:
        self._sent: dict[str, dict[int, _Sent]] = {}
        self._passed: set[int] = set()  # tickets of requests a later one of a lower number went past

    def add(
        self, p: str, ticket: int, tokens: int, priority: int, started_at: float, now: float, own_s: float
    ) -> None:
        """A request of ``priority`` sent to ``p`` at ``now``, predicted to start at ``started_at`` and to
        take ``own_s`` of P's time: the waiting ones of a larger number are passed, and start that much
        later."""
        sent = self._sent.setdefault(p, {})
        for other, s in sent.items():
            if s.priority > priority and s.started_at > now:
                self._passed.add(other)
                sent[other] = s._replace(started_at=s.started_at + own_s)
        sent[ticket] = _Sent(max(tokens, 0), priority, started_at)

    def passed(self, ticket: int) -> bool:
        """Whether a request of a lower number was sent past the request of ``ticket`` while it waited."""
        return ticket in self._passed

    def drop(self, p: str, ticket: int) -> None:
        self._passed.discard(ticket)
        sent = self._sent.get(p)
        if sent is not None:
            sent.pop(ticket, None)
            if not sent:
                del self._sent[p]

    def ahead(self, p: str, priority: int, now: float) -> int:
        """The tokens ahead of a request of ``priority`` sent to ``p`` at ``now``."""
        return sum(
            s.tokens for s in self._sent.get(p, {}).values() if s.priority <= priority or s.started_at <= now
        )


def predicted_start(sent_at: float, seconds: float, ahead: int, own: int) -> float:
    """When a request sent at ``sent_at`` with ``ahead`` tokens before its ``own`` and a predicted P part of
    ``seconds`` is predicted to start: after the tokens ahead's share of that part."""
    total = ahead + max(own, 0)
    return sent_at + (seconds * ahead / total if total > 0 and ahead > 0 else 0.0)
