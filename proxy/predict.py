"""The per-request TTFT predictor: for every candidate P and D, when the request would see its first token.

A request's TTFT, from the moment admission lets it go, is its time in P plus its handoff::

    P part    base(P) + per_token(P) x (tokens ahead of it on P + its own uncached tokens)
    handoff   P's answer to D's first token, per P x D pair

**Tokens ahead** are the uncached prefill tokens this proxy sent to P and has not had answered
(:attr:`Predictor.backlog`), divided by this proxy's share of the pool when several proxies share
it (the controller's ``proxy.share``): the others' traffic is assumed alike. At a P that vLLM schedules
by priority (:attr:`Predictor.by_priority`), a request with a priority (tenants on, ``proxy.priority``)
has ahead of it only the work of a lower or equal priority number and what P has started
(``proxy.prioritybacklog``). A request's own
tokens are the KV view's count (less what P is predicted to hold), else the tokenizer's, else an
estimate from its text (``chars_per_token``).

**The rates** of each P are a line fitted online (:class:`Line`: a Kalman filter on the line's
base and slope, drifting as ``predict.forget`` says) on what this proxy saw complete:
``p_done - p_sent`` against
the tokens the request was predicted with. Until a P has ``min_samples`` completions its line is
the controller's (``RoutingTable.rates``, fitted from the stored traces, with the samples behind
it), else the configured prior (``prefill_base_s`` and the KV-aware cost model's
``prefill_tokens_per_s``); the source is recorded with each prediction. The handoff is a line too,
per pair (then per D, then the table's pair or D, then ``handoff_s``), in the tokens of KV D has to
pull for it: its own prompt's plus those of the requests this proxy sent ahead of it that have not
had their first token yet, over the share like P's. D pulls the whole prompt's KV, and pulls queue
behind one another: on a simulated 2P+4D fleet at 90 % load the handoff's median went from 0.29 s
with no other request pending at that D to 0.46 s with four, where a mean per pair is wrong for both.

**Which pulls are ahead** depends on where the transfers contend, which the proxy cannot know: on one
link (a P x D path that serves a transfer at a time, as the simulator's does), at D's NIC (every pull
into D), or at P's. So each D keeps two models and uses the one that has predicted its handoffs
better (:class:`_Rivals`): the pair's line in the tokens pending *on that pair*
(:attr:`Predictor.pair_backlog`), and D's line in the tokens pending *at D* through any P
(:attr:`Predictor.d_backlog`). On stored records of simulated 4P+2D overload runs, a least-squares
fit on the pair's pending tokens had a median error of 14-17 % (p90 27-42 %) against 23-25 % (p90
62-71 %) on D's: the other pairs' pulls did not delay it at all (their coefficient was 0.00).

**An answer still missing** says a P slowed before its line can learn it (:meth:`Predictor.lag`,
:meth:`Predictor.overrun`): the most overdue request in flight at P scales P's line by what its lag
exceeds the margin. **A first token still missing** says the same of a handoff
(:meth:`Predictor.handoff_lags`): P has answered, D has not begun, and the handoff is overdue. The lag
is placed as the P x D matrix places blame: on the pair; on P's row when its handoffs toward two Ds or
more are overdue, begun after its last one in time (P's side: its NIC, its transfers); on D's column
when two Ps or more are so toward it (D's side: a D that stopped pulling). A pair's handoff is scaled by
the largest of its three, past the margin. A link that slowed tenfold otherwise kept its old line until
its first slow handoff came back: on a simulated 2P+4D fleet at 90 % load, a P's NIC 10x slower toward
every D took 26 requests in the 2.6 s before that (every one late), where an overdue handoff shows
within a prediction's own time.

**Its error is its margin**: every first token of a *confident* prediction adds observed / predicted
TTFT to its P's ring of the last :data:`RATIOS` ratios, and :meth:`Predictor.factor` is their
``quantile`` (at least 1): a prediction through that P is multiplied by it before it is held against
a target. A P is *confident* (may reject) once its line rests on ``min_samples`` completions, its own
or the table's. The margin measures the noise of a model that fits, so three kinds of error are kept
out of it: a cold P's (the prior's or a few completions' guess: it rejects nothing anyway), another
P's (one P slowing down must not widen the margin of every other), and the run of errors that made a
line reopen (:class:`Line`: the P changed; those errors measured the change, not the noise). A P with
fewer than :data:`MIN_RATIOS` of its own borrows the typical peer's factor (:class:`_Errors`). The margin
is the queue model's: a request that meets no queue of this proxy's is judged by its own prediction alone
(:meth:`Predictor.margin`).

Pure: no I/O, no clock; every time is passed in.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from pdscope import semconv as sc
from pdscope.config import PredictSettings
from pdscope.routing import Rates
from pdscope.stats import percentile
from proxy.prioritybacklog import PriorityBacklog, predicted_start

RATIOS = 256  # observed/predicted TTFT ratios the error quantile is taken over
MIN_RATIOS = 20  # below this, the factor is 1 (a cold predictor does not reject anyway)
MAX_FACTOR = 4.0  # the error quantile's cap: a predictor this far off is reported, not trusted more
_CLIP = 5.0  # one observation moves a line at most this factor from its prediction
_PRIOR_VAR = 100.0  # s^2 (base) and (s per thousand tokens)^2 (slope): the covariance's start and cap
_NOISE_ALPHA = 0.05  # the noise estimate's weight per observation
_MIN_NOISE = 1e-6  # s^2: a 1 ms error floor
_RUN = 6  # errors in a row on one side that say the line is off, not noisy
CLUMP_S = 0.005  # answers this close to the first of theirs came at one step's end: one event for the run
_SETTLED = 10  # observations before one is clipped (until then the prior may be far off)
_KT = 1000.0  # the line's x is in thousands of tokens (conditioning)
HANDOFF_MIN = 3  # handoffs of a pair (or D) before its own line is used
PAIRS_IN_OUTLOOK = 256  # P x D candidates up to which an admission weighs each pair's handoff
_RIVAL_ALPHA = 0.05  # the weight of one handoff in a handoff model's running error
K = TypeVar("K", str, tuple[str, str])
B_MIN = 1e-9  # the least slope (s per thousand tokens): a line never falls with its backlog


class Line:
    """``y = a + b x`` tracked online by a Kalman filter whose state (``a``, ``b``) may drift: each
    observation first widens the covariance by a drift of ``(1 - forget)^2`` times the noise (so the
    newest ~``1 / (1 - forget)`` observations count most, in every direction, and a direction the
    load never varies in cannot lock), then weighs the observation against the noise, itself the
    running mean of the squared errors. ``n`` the observations seen. The prior is weak (a large
    covariance): the first completions decide, so a prior 10x off (a CPU P against a GPU default) is
    left at once.

    **The bounds** ``a >= 0`` and ``b >= B_MIN`` are kept by the update itself: where the joint step
    would cross one, that parameter stays on its bound and the observation is learnt by the other
    alone, their correlation dropped. Clamping after a joint step instead (as this class once did)
    leaves the filter believing in a move that did not happen: a P whose time does not grow with its
    backlog (its slope on the floor) then pushed every error into ``a`` through their correlation,
    and on a zero-latency fleet the line reached 770 s against observations of 10 ms."""

    __slots__ = (
        "a",
        "at",
        "b",
        "clump_at",
        "drift",
        "n",
        "noise",
        "p00",
        "p01",
        "p11",
        "reopened",
        "run",
        "since",
    )

    def __init__(self, a: float, b: float, forget: float) -> None:
        self.a, self.b, self.n = max(a, 0.0), max(b, B_MIN), 0
        self.at = -math.inf  # when it last learnt (the predictor's clock)
        self.clump_at = -math.inf  # when the first answer of the last clump came (:meth:`_bias`)
        self.drift = (1.0 - forget) ** 2
        self.noise = 1.0  # s^2: a guess, replaced by the errors seen
        self.p00, self.p01, self.p11 = _PRIOR_VAR, 0.0, _PRIOR_VAR
        self.run = 0  # errors in a row of one sign (+ over, - under)
        self.reopened = 0  # times a run of one-sided errors opened it again
        self.since = 0  # observations since it was opened (first or again): none is clipped before _SETTLED

    def __call__(self, tokens: float) -> float:
        return self.a + self.b * tokens / _KT

    def update(self, tokens: float, y: float, at: float = math.nan) -> None:
        """Learn that ``tokens`` took ``y`` seconds, observed at ``at`` (the predictor's clock; NaN:
        unknown, every observation its own event)."""
        x = tokens / _KT
        guess = self.a + self.b * x
        if guess > 0 and self.since >= _SETTLED:  # one outlier (a stall, mixed times) moves it only so far
            y = min(max(y, guess / _CLIP), guess * _CLIP)
        q = self.drift * self.noise
        p00, p11 = min(self.p00 + q, _PRIOR_VAR), min(self.p11 + q, _PRIOR_VAR)
        limit = 0.999 * math.sqrt(p00 * p11)  # the caps above must leave the covariance positive
        p01 = min(max(self.p01, -limit), limit)
        err = y - guess
        q0, q1 = p00 + p01 * x, p01 + p11 * x
        denom = q0 + q1 * x + self.noise
        k0, k1 = q0 / denom, q1 / denom
        a, b = self.a + k0 * err, self.b + k1 * err
        if a >= 0.0 and b >= B_MIN:
            self.a, self.b = a, b
            self.p00, self.p01, self.p11 = p00 - k0 * q0, p01 - k0 * q1, p11 - k1 * q1
        else:
            self._bounded(x, y, p00, p11, b < B_MIN)
        sq = err * err if self.since < _SETTLED else min(err * err, 9.0 * self.noise)  # one stall: 3 sigma
        self.noise = max(self.noise + (sq - self.noise) * _NOISE_ALPHA, _MIN_NOISE)
        self.n += 1
        self.since += 1
        clumped = at - self.clump_at <= CLUMP_S  # False for an unknown time (NaN)
        self._bias(err, y, clumped)
        if not math.isnan(at):
            self.at = at
            self.clump_at = self.clump_at if clumped else at

    def _bounded(self, x: float, y: float, p00: float, p11: float, slope_floor: bool) -> None:
        """The step crossed a bound: that parameter stays on it, the other learns ``y`` alone."""
        if slope_floor:  # b on its floor: a scalar update of a
            self.b = B_MIN
            k = p00 / (p00 + self.noise)
            self.a = max(self.a + k * (y - self.a - self.b * x), 0.0)
            self.p00 = p00 * (1.0 - k)
        else:  # a at 0: a scalar update of b (x is never negative)
            self.a = 0.0
            k = p11 * x / (p11 * x * x + self.noise)
            self.b = max(self.b + k * (y - self.b * x), B_MIN)
            self.p11 = p11 * (1.0 - k * x)
        self.p01 = 0.0

    def _bias(self, err: float, y: float, clumped: bool) -> None:
        """``_RUN`` errors in a row on one side: the line is off (a warm-up it learnt from, a P that
        changed), not noisy. Its covariance opens again, so the next completions decide afresh, and
        none of them is clipped against the line that was off. Its noise is at most what the last
        observation itself is worth (an error larger than ``y`` says the line was wrong, not noisy).

        Answers that come together (``clumped``: within :data:`CLUMP_S` of the first of them) ended in
        one step of P's, and count once: every request a step finishes is answered at its end, so their
        times are alike whatever their backlogs, and their errors run to one side together. Counted one
        by one, a step that finished six requests opened the line again; on a simulated 2P+4D fleet
        beside a bursty flood (steps of 0.5 s finishing four to eight requests) a P's line was opened
        every few steps, settled at a base of 1 s and a slope near 0, and its P was predicted late for
        every request, so it had none for 10 s while the other took them all. A clump is measured from
        its first answer, not from the one before: a P answering every few milliseconds without a pause
        still counts one event per :data:`CLUMP_S`, and its line can still reopen."""
        if abs(err) * abs(err) <= _MIN_NOISE:  # a hit (within the 1 ms floor) is on neither side
            self.run = 0
            return
        side = 1 if err > 0 else -1
        if clumped and self.run * side > 0:  # the same step's answer, on the same side: counted already
            return
        self.run = self.run + side if self.run * side > 0 else side
        if abs(self.run) >= _RUN:
            self.p00, self.p01, self.p11 = _PRIOR_VAR, 0.0, _PRIOR_VAR
            self.noise = max(min(self.noise, y * y), _MIN_NOISE)
            self.run = 0
            self.reopened += 1
            self.since = 0


@dataclass(frozen=True, slots=True)
class PEstimate:
    """A P's part of a request's TTFT: ``seconds``, the tokens ahead it assumed (this proxy's backlog
    over its share), where its line came from, and whether it may reject."""

    seconds: float
    ahead: int
    source: str
    confident: bool


class Predictor:
    """See the module docstring. ``clock``: the proxy's monotonic clock, for how old a fit is.

    **A fit goes stale**: a P whose line has learnt nothing for ``predict.probe_s`` and that has
    nothing of this proxy's in flight is not confident (so never late): the next request may go
    there and teach it again; while that probe is in flight the P is judged by its old line. A P
    that was slow and recovered is found again, not shunned for ever. A pair's or a D's handoff
    mean that old falls back a level (D, then the table, then the prior)."""

    def __init__(self, ps: PredictSettings, prefill_tokens_per_s: float, clock: Callable[[], float]) -> None:
        self.ps = ps
        self.clock = clock
        self.backlog: Backlog[str] = Backlog()  # P -> uncached prefill tokens sent and not yet answered
        self.by_priority: frozenset[str] = frozenset()  # the Ps vLLM schedules by priority
        self.ranked = PriorityBacklog()  # the same at those Ps, by priority, for requests that carry one
        self.d_backlog: Backlog[str] = Backlog()  # D -> prompt tokens sent to it without a first token yet
        self.pair_backlog: Backlog[tuple[str, str]] = Backlog()  # (P, D) -> the same, per pair
        self._flying: dict[str, dict[int, tuple[float, float]]] = {}  # P -> ticket -> (sent at, P part)
        # (P, D) -> ticket -> (P answered at, its handoff predicted): handoffs without a first token yet
        self._handing: dict[tuple[str, str], dict[int, tuple[float, float]]] = {}
        self._flying_to: dict[str, int] = {}  # D -> its handoffs in flight, through any P
        self._in_time_p: dict[str, float] = {}  # P -> when a handoff of it last came within its time
        self._in_time_d: dict[str, float] = {}  # D -> the same, into it
        self._tickets = itertools.count()
        self.share = 1.0  # this proxy's share of the pools (the controller's), for tokens ahead
        self._prior = (ps.prefill_base_s, _KT / prefill_tokens_per_s)
        self._lines: dict[str, Line] = {}
        self._pairs: dict[tuple[str, str], Line] = {}
        self._ds: dict[str, Line] = {}
        self._rivals: dict[str, _Rivals] = {}  # D -> how well its pair lines and its own line predict
        self._table_p: dict[str, tuple[float, float, int]] = {}  # P -> (base, s per k-token, samples)
        self._table_pair: dict[tuple[str, str], float] = {}
        self._table_d: dict[str, float] = {}
        self._errors = _Errors(ps.quantile, ps.errors_s, clock)

    # -- the controller's prior ------------------------------------------------------

    def use_table(self, rates: Rates | None, share: float | None) -> None:
        """The routing table's rates (None: keep the last) and this proxy's share (None: 1)."""
        self.share = share if share is not None and share > 0 else 1.0
        if rates is None:
            return
        table_p: dict[str, tuple[float, float, int]] = {}
        for r in rates.instances:
            if r.prefill_s_per_token is not None and r.prefill_s_per_token > 0:
                table_p[r.name] = (r.prefill_base_s or 0.0, r.prefill_s_per_token * _KT, r.samples)
            if r.handoff_s is not None:
                self._table_d[r.name] = r.handoff_s
        self._table_p = table_p
        self._table_pair = {(p.prefill, p.decode): p.handoff_s for p in rates.pairs}

    # -- predictions ------------------------------------------------------------------

    def sent_to_p(self, p: str, own: int, seconds: float, priority: int | None = None, ahead: int = 0) -> int:
        """A request is sent to ``p`` with ``own`` uncached tokens, its P part predicted ``seconds`` behind
        ``ahead`` tokens: its tokens join P's backlog (with its ``priority`` at a priority-scheduled P), and
        it is in flight there (:meth:`lag`) until :meth:`left_p`."""
        self.backlog.add(p, own)
        ticket = next(self._tickets)
        now = self.clock()
        self._flying.setdefault(p, {})[ticket] = (now, seconds)
        if priority is not None and p in self.by_priority:
            start = predicted_start(now, seconds, ahead, own)
            self.ranked.add(p, ticket, own, priority, start, now, now + seconds - start)
        return ticket

    def left_p(self, p: str, ticket: int, own: int) -> None:
        """The request :meth:`sent_to_p` gave ``ticket`` is answered (or went elsewhere, or ended)."""
        self.backlog.drop(p, own)
        self.ranked.drop(p, ticket)
        flying = self._flying.get(p)
        if flying is not None:
            flying.pop(ticket, None)
            if not flying:
                del self._flying[p]

    def lag(self, p: str) -> float:
        """How far past its prediction the most overdue of this proxy's requests in flight at ``p`` is:
        its age over its predicted P part, at least 1. A P's line learns only from answers, which come
        late when P slows down; an answer still missing says so first, and a P that stopped answering
        is predicted later and later, so no request is admitted to it in vain. A request passed in a
        priority-scheduled P's queue (``proxy.prioritybacklog``) is overdue by the work that passed it, not
        by P: left out."""
        flying = self._flying.get(p)
        if not flying:
            return 1.0
        now, passed = self.clock(), self.ranked.passed
        lags = ((now - at) / part for t, (at, part) in flying.items() if part > 0 and not passed(t))
        return max(1.0, max(lags, default=1.0))

    def overrun(self, p: str) -> float:
        """What P's line is multiplied by: :meth:`lag` past what :meth:`factor` (the margin a prediction
        through ``p`` is multiplied by anyway while it is queued) already covers, at least 1. A lag
        within the model's usual error is its noise (the most overdue of many requests in flight is
        its high quantile): counting it again rejected what a surge could serve."""
        lag = self.lag(p)
        return max(lag / self.factor(p), 1.0) if lag > 1.0 else 1.0

    def tokens_ahead(self, p: str, priority: int | None = None) -> int:
        """The tokens ahead of a request sent to ``p`` now: the whole backlog, or at a priority-scheduled P
        for a request of ``priority``, what goes before it there (``proxy.prioritybacklog``)."""
        if priority is None or p not in self.by_priority:
            return round(self.backlog.get(p, 0) / self.share)
        return round(self.ranked.ahead(p, priority, self.clock()) / self.share)

    def handoff_x(self, p: str | None, d: str, tokens: int) -> HandoffX:
        """The tokens of KV ahead of a prompt of ``tokens`` sent to ``d`` now, and its own: those pending
        at ``d`` through any P, and (``p`` given) those pending on the pair ``p`` x ``d``."""
        at_d = tokens + round(self.d_backlog.get(d, 0) / self.share)
        on_pair = tokens + round(self.pair_backlog.get((p, d), 0) / self.share) if p is not None else at_d
        return HandoffX(at_d, on_pair)

    def sent_to_d(self, p: str, d: str, tokens: int) -> None:
        """A prompt of ``tokens`` is bound for ``d`` through ``p``: pending there until its first token."""
        self.d_backlog.add(d, tokens)
        self.pair_backlog.add((p, d), tokens)

    def left_d(self, p: str, d: str, tokens: int) -> None:
        """The prompt :meth:`sent_to_d` has its first token (or went elsewhere, or ended)."""
        self.d_backlog.drop(d, tokens)
        self.pair_backlog.drop((p, d), tokens)

    def prefill(self, p: str, own: int, priority: int | None = None) -> PEstimate:
        ahead = self.tokens_ahead(p, priority)
        x = ahead + max(own, 0)
        line = self._lines.get(p)
        min_n = self.ps.min_samples
        if line is not None and line.n >= min_n:
            fresh = ahead > 0 or self.clock() - line.at <= self.ps.probe_s
            return PEstimate(line(x) * self.overrun(p), ahead, sc.PREDICT_ONLINE, fresh)
        table = self._table_p.get(p)
        if table is not None:
            base, per_kt, samples = table
            seconds = (base + per_kt * x / _KT) * self.overrun(p)
            return PEstimate(seconds, ahead, sc.PREDICT_TABLE, samples >= min_n)
        if line is not None:  # a few of its own beat the configured prior
            return PEstimate(line(x), ahead, sc.PREDICT_ONLINE, False)
        base, per_kt = self._prior
        return PEstimate(base + per_kt * x / _KT, ahead, sc.PREDICT_PRIOR, False)

    def rate(self, p: str) -> float | None:
        """P's prefill rate in tokens/s as fitted (its own line, else the table's); None: the prior's."""
        line = self._lines.get(p)
        if line is not None and line.n >= self.ps.min_samples:
            return _KT / line.b
        table = self._table_p.get(p)
        return _KT / table[1] if table is not None else None

    def handoff(self, p: str | None, d: str, x: HandoffX, lags: HandoffLags | None = None) -> float:
        """P's answer to D's first token through ``p`` x ``d`` (``p`` None: through D, any P), with ``x``
        the tokens of KV ahead and its own (:meth:`handoff_x`): the pair's line unless D's own has
        predicted D's handoffs better (:class:`_Rivals`), then D's line, the table, the prior; scaled
        by the overdue handoffs in flight past the margin (``lags``: :meth:`handoff_lags`, taken once
        for many pairs)."""
        lag = (lags if lags is not None else self.handoff_lags()).of(p, d)
        seconds = self._handoff_line(p, d, x)
        return seconds * max(lag / self.factor(p or ""), 1.0) if lag > 1.0 else seconds

    def _handoff_line(self, p: str | None, d: str, x: HandoffX) -> float:
        pair = self._usable(self._pairs.get((p, d)), self._pair_flying(p, d)) if p is not None else None
        each_d = self._usable(self._ds.get(d), self._d_flying(d))
        rivals = self._rivals.get(d)
        if pair is not None and (each_d is None or rivals is None or rivals.pair_wins()):
            return pair(x.on_pair)
        if each_d is not None:
            return each_d(x.at_d)
        table = self._table_pair.get((p, d)) if p is not None else None
        table = table if table is not None else self._table_d.get(d)
        return table if table is not None else self.ps.handoff_s

    def handoff_began(self, p: str, d: str, seconds: float) -> int:
        """P answered a request bound for ``d``, its handoff predicted ``seconds``: in flight on the pair
        (:meth:`handoff_lags`) until :meth:`handoff_ended` with the ticket returned."""
        ticket = next(self._tickets)
        self._handing.setdefault((p, d), {})[ticket] = (self.clock(), seconds)
        self._flying_to[d] = self._flying_to.get(d, 0) + 1
        return ticket

    def handoff_ended(self, p: str, d: str, ticket: int, arrived: bool = False) -> None:
        """The handoff :meth:`handoff_began` gave ``ticket`` is over: ``arrived``, D's first token came
        (else the request moved or ended). One that came within its prediction times the margin says
        its P's side and its D's side delivered in time (:meth:`handoff_lags`)."""
        flying = self._handing.get((p, d))
        if flying is None:
            return
        began = flying.pop(ticket, None)
        if not flying:
            del self._handing[p, d]
        if began is not None:
            left = self._flying_to.get(d, 0) - 1
            if left > 0:
                self._flying_to[d] = left
            else:
                self._flying_to.pop(d, None)
        if arrived and began is not None:
            now = self.clock()
            at, seconds = began
            if now - at <= seconds * self.factor(p):
                self._in_time_p[p] = self._in_time_d[d] = now

    def handoff_lags(self) -> HandoffLags:
        """How overdue the handoffs in flight are now: per pair, its most overdue one's age over its
        prediction (at least 1). Per P with handoffs in flight to two Ds or more: P's side (its NIC, its
        transfers) when toward two Ds or more a handoff is overdue past the margin that began after the
        P's last handoff that came in time; then the least of those pairs' lags, else 1. Per D waiting
        on two Ps or more, the same (D's side: a D that stopped pulling).

        Overdue pairs, not every pair: a P's handoff that began a moment ago is not yet due and says
        nothing either way. Counting it (the least of every pair's lag) let a P whose NIC slowed tenfold
        keep its row in time while each new request went to a D it had nothing in flight to: on a
        simulated 2P+4D fleet at 90 % load, 6 requests in 0.5 s, 2 s after its first handoffs were
        already overdue, every one of them 10 s late."""
        now = self.clock()
        pair: dict[tuple[str, str], float] = {}
        rows: dict[str, list[float]] = {}
        cols: dict[str, list[float]] = {}
        for (p, d), flying in self._handing.items():
            times, margin = flying.values(), self.factor(p)
            pair[p, d] = _most_overdue(times, now)
            # only what began after the line's last handoff in time is evidence against the line
            rows.setdefault(p, []).append(_past(_most_overdue(times, now, self._in_time_p.get(p)), margin))
            cols.setdefault(d, []).append(_past(_most_overdue(times, now, self._in_time_d.get(d)), margin))
        return HandoffLags(pair, _line_lags(rows), _line_lags(cols))

    def _pair_flying(self, p: str, d: str) -> bool:
        """Whether a request of this proxy is on its way through ``p`` x ``d``: sent, not yet at its first
        token. From the send, not from P's answer: until P answered, each request after the probe also
        saw the stale line's fallback, and a P whose NIC slowed tenfold was sent a handful per D every
        ``probe_s``, each late."""
        return (p, d) in self.pair_backlog or (p, d) in self._handing

    def _d_flying(self, d: str) -> bool:
        return d in self.d_backlog or d in self._flying_to

    def _usable(self, line: Line | None, flying: bool) -> Line | None:
        """``line`` if it rests on :data:`HANDOFF_MIN` handoffs, the last within ``probe_s`` or one of its
        handoffs in flight now (``flying``: the probe that will renew it; until its first token, the old
        line judges, as P's does, so that a slow pair is probed once, not with every request)."""
        if line is None or line.n < HANDOFF_MIN:
            return None
        if line.at < self.clock() - self.ps.probe_s and not flying:
            return None
        return line

    def factor(self, p: str) -> float:
        """The recent error quantile a prediction through ``p`` is multiplied by (1 while few are known)."""
        return self._errors.factor(p)

    def margin(self, p: str, queued: bool) -> float:
        """What a prediction through ``p`` is multiplied by: :meth:`factor` while anything of this proxy's
        waits on the request's way (``queued``: tokens ahead on P, a backlog at its D), else 1. The
        error quantile is the noise of the queue model; a request that meets no queue is judged by its
        own prompt alone. Without this, the ratios of a saturation (observed up to 3x predicted) kept
        the factor near 2 after it ended: every request was rejected, so no first token came to bring
        it down, and an idle 4P+2D fleet was refused for the last 15 s of a simulated run."""
        return self._errors.factor(p) if queued else 1.0

    def d_queued(self, ds: Iterable[str], lags: HandoffLags | None = None) -> bool:
        """Whether this proxy has a request waiting for a first token at one of ``ds``, leaving out those
        handed off by a P whose row is late (``lags``): they wait on that P's side, not in D's queue. A
        P whose NIC slowed tenfold held a handoff or more at every D for the rest of a simulated 2P+4D
        run; counted, they put the error margin (4, from the saturation when the fault began) on every
        request through the healthy P, which was refused with nothing queued ahead of it."""
        late = [p for p, lag in lags.row.items() if lag > 1.0] if lags is not None else []
        for d in ds:
            waiting = self.d_backlog.get(d, 0)
            if waiting > 0 and late:
                waiting -= sum(self.pair_backlog.get((p, d), 0) for p in late)
            if waiting > 0:
                return True
        return False

    def budget(self, target_s: float) -> float:
        """The part of ``target_s`` a prediction (times :meth:`factor`) must fit in."""
        return target_s * (1.0 - self.ps.margin)

    # -- learning from what completed -------------------------------------------------

    def observe_prefill(self, p: str, tokens: int, seconds: float) -> None:
        """P answered a request predicted with ``tokens`` (ahead + own) after ``seconds``."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            return
        line = self._lines.get(p)
        if line is None:
            table = self._table_p.get(p)
            base, per_kt = (table[0], table[1]) if table is not None else self._prior
            line = self._lines[p] = Line(base, per_kt, self.ps.forget)
        opened = line.reopened
        line.update(tokens, seconds, self.clock())
        if line.reopened != opened:  # P changed: the errors that showed it are not the model's noise
            self._errors.forget(p)

    def observe_handoff(self, p: str, d: str, x: HandoffX, seconds: float) -> None:
        """D's first token came ``seconds`` after P's answer, predicted with ``x`` (:meth:`handoff_x`).

        The pair's line always learns it; D's own line (through any P) and the rivalry between the two
        only while P's row is not late where D's column is not (:meth:`handoff_lags`): a handoff slow
        on P's side says nothing of D. On a simulated 2P+4D fleet whose one P's NIC slowed tenfold,
        that P's 3-6 s handoffs taught every D's line, which then predicted 2.5-2.9 s through the
        healthy P too: the proxy refused every request for the rest of the run (1.25 req/s served of
        the healthy P's 7), and, refusing, learned nothing that could undo it."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            return
        lags = self.handoff_lags()
        p_side = lags.row.get(p, 1.0) > 1.0 and lags.col.get(d, 1.0) <= 1.0
        pair = self._usable(self._pairs.get((p, d)), self._pair_flying(p, d))
        each_d = None if p_side else self._usable(self._ds.get(d), self._d_flying(d))
        if pair is not None and each_d is not None and seconds > 0:  # both could answer: which was nearer
            rivals = self._rivals.get(d) or self._rivals.setdefault(d, _Rivals())
            rivals.add(abs(pair(x.on_pair) - seconds) / seconds, abs(each_d(x.at_d) - seconds) / seconds)
        start = self._table_pair.get((p, d), self._table_d.get(d, self.ps.handoff_s))
        pair_line = self._pairs.get((p, d))
        if pair_line is None:
            pair_line = self._pairs[p, d] = Line(start, B_MIN, self.ps.forget)
        now = self.clock()
        pair_line.update(x.on_pair, seconds, now)
        if not p_side:
            d_line = self._ds.get(d) or self._ds.setdefault(d, Line(start, B_MIN, self.ps.forget))
            d_line.update(x.at_d, seconds, now)

    def observe_ttft(self, p: str, predicted: float, observed: float, confident: bool) -> float | None:
        """A first token through ``p``: the ratio observed / predicted (None when either is not a positive
        time); a confident prediction's joins ``p``'s error ring."""
        if not (predicted > 0 and observed >= 0 and math.isfinite(observed) and math.isfinite(predicted)):
            return None
        ratio = observed / predicted
        if confident:
            self._errors.add(p, ratio)
        return ratio

    def lines(self) -> Mapping[str, Line]:
        return self._lines


@dataclass(frozen=True, slots=True)
class HandoffLags:
    """:meth:`Predictor.handoff_lags`: overdue factors (at least 1) per pair, P row and D column."""

    pair: Mapping[tuple[str, str], float]
    row: Mapping[str, float]
    col: Mapping[str, float]

    def of(self, p: str | None, d: str) -> float:
        """The largest that applies to ``p`` x ``d`` (``p`` None: D's column alone)."""
        col = self.col.get(d, 1.0)
        if p is None:
            return col
        return max(self.pair.get((p, d), 1.0), self.row.get(p, 1.0), col)


def _most_overdue(flying: Iterable[tuple[float, float]], now: float, after: float | None = None) -> float:
    """The largest age over prediction of the handoffs in flight (those begun after ``after``), at least 1."""
    lags = ((now - at) / s for at, s in flying if s > 0 and (after is None or at > after))
    return max(max(lags, default=1.0), 1.0)


def _past(lag: float, margin: float) -> float:
    return lag if lag > margin else 0.0


def _line_lags(lines: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Per row (or column) with two pairs or more in flight: the least lag of its pairs past the margin
    (0: not past it) when two or more are, else 1."""
    out = {}
    for key, lags in lines.items():
        if len(lags) >= 2:
            due = [lag for lag in lags if lag > 0.0]
            out[key] = max(min(due), 1.0) if len(due) >= 2 else 1.0
    return out


class HandoffX(NamedTuple):
    """The tokens of KV a handoff was (or is) predicted with: pending at its D through any P, and
    pending on its pair; both count its own prompt."""

    at_d: int
    on_pair: int


class _Rivals:
    """A D's two handoff models (its pairs' lines, its own line) and the running mean of each one's
    relative error over the handoffs both could predict: the nearer one predicts the next."""

    __slots__ = ("d_err", "pair_err")

    def __init__(self) -> None:
        self.pair_err = self.d_err = 0.0

    def add(self, pair_err: float, d_err: float) -> None:
        self.pair_err += (pair_err - self.pair_err) * _RIVAL_ALPHA
        self.d_err += (d_err - self.d_err) * _RIVAL_ALPHA

    def pair_wins(self) -> bool:
        return self.pair_err <= self.d_err


class Backlog(dict[K, int]):
    """Tokens per instance (or pair) sent and not yet through (P: answered; D: its first token)."""

    def add(self, name: K, tokens: int) -> None:
        if tokens > 0:
            self[name] = self.get(name, 0) + tokens

    def drop(self, name: K, tokens: int) -> None:
        left = self.get(name, 0) - tokens
        if left > 0:
            self[name] = left
        else:
            self.pop(name, None)


class _Errors:
    """Observed / predicted TTFT ratios: a ring per P and a pooled ring of every P's (each of the last
    :data:`RATIOS`, and none older than ``horizon_s``), and their ``quantile``, cached until a ring
    changes.

    A P with fewer than :data:`MIN_RATIOS` of its own (new, or its line just reopened) borrows the
    typical peer's factor: the lower median of the factors of the Ps that have their own. Not the
    pooled ring: its quantile is its worst P's, and a P whose NIC slowed tenfold (ratios of 4 and
    more) once lent its factor to every healthy P whose line reopened under the load it shed, so
    each was rejected past one request in its queue (a simulated 4P+2D fleet at 90 % load). The
    pooled ring is for the start alone, while no P has enough of its own.

    **Ratios age out.** The quantile at 0.995 of 256 ratios is about their second largest, and only a
    first token brings a new one. On a simulated 2P+4D fleet whose other P's NIC slowed, the healthy
    P took the whole load at once and its queue was under-predicted up to 4x for a second; those
    ratios made its factor 4 (the cap), every request that met a queue was refused, so no first token
    came to replace them, and the P served one request in two seconds for the rest of the run. Past
    ``horizon_s`` a ratio is the fleet's past, not the model's noise."""

    def __init__(self, quantile: float, horizon_s: float, clock: Callable[[], float]) -> None:
        self.q = 100.0 * quantile
        self.horizon_s = horizon_s
        self.clock = clock
        self._own: dict[str, deque[tuple[float, float]]] = {}  # P -> (when, ratio)
        self._pooled: deque[tuple[str, float, float]] = deque(maxlen=RATIOS)  # (P, when, ratio)
        self._cached: dict[str, float] = {}  # P -> its own ring's quantile
        self._borrowed: float | None = None  # the typical peer's factor, or the pooled ring's
        self._next_expiry = -math.inf

    def add(self, p: str, ratio: float) -> None:
        now = self.clock()
        self._own.setdefault(p, deque(maxlen=RATIOS)).append((now, ratio))
        self._pooled.append((p, now, ratio))
        self._cached.pop(p, None)
        self._borrowed = None

    def forget(self, p: str) -> None:
        """``p``'s errors leave both rings (a reopened line: they measured a change, not noise)."""
        if self._own.pop(p, None) is not None:
            self._pooled = deque((x for x in self._pooled if x[0] != p), maxlen=RATIOS)
            self._cached.pop(p, None)
            self._borrowed = None

    def factor(self, p: str) -> float:
        self._expire()
        own = self._own.get(p)
        if own is not None and len(own) >= MIN_RATIOS:
            return self._own_factor(p, own)
        if self._borrowed is None:
            self._borrowed = self._typical()
        return self._borrowed

    def _expire(self) -> None:
        """Drop the ratios older than ``horizon_s``; looked at once per tenth of it (every ring is
        walked then, so a large fleet pays that walk ten times per horizon, not per request)."""
        now = self.clock()
        if now < self._next_expiry:
            return
        self._next_expiry = now + self.horizon_s / 10.0
        cutoff = now - self.horizon_s
        for p in list(self._own):
            ring = self._own[p]
            if ring and ring[0][0] < cutoff:
                while ring and ring[0][0] < cutoff:
                    ring.popleft()
                self._cached.pop(p, None)
                self._borrowed = None
                if not ring:
                    del self._own[p]
        while self._pooled and self._pooled[0][1] < cutoff:
            self._pooled.popleft()
            self._borrowed = None

    def _own_factor(self, p: str, ratios: deque[tuple[float, float]]) -> float:
        got = self._cached.get(p)
        if got is None:
            got = self._cached[p] = self._quantile(r for _, r in ratios)
        return got

    def _typical(self) -> float:
        """The lower median of the factors of the Ps with rings of their own; while there is none, the
        pooled ring's quantile; 1 while that too is short."""
        peers = sorted(self._own_factor(q, r) for q, r in self._own.items() if len(r) >= MIN_RATIOS)
        if peers:
            return peers[(len(peers) - 1) // 2]
        return self._quantile(r for _, _, r in self._pooled) if len(self._pooled) >= MIN_RATIOS else 1.0

    def _quantile(self, ratios: Iterable[float]) -> float:
        return min(max(percentile(list(ratios), self.q) or 1.0, 1.0), MAX_FACTOR)


@dataclass(frozen=True, slots=True)
class Outlook:
    """What the predictor says of one request's candidates now: the Ps predicted late (confident
    ones only: a cold P is never late), the best predicted TTFT from the request's start with the
    error factor applied, and the budget it is held against. ``hopeless``: every P is late."""

    late: frozenset[str]
    best_s: float
    budget_s: float
    hopeless: bool

    @property
    def slack_s(self) -> float:
        """How long the request may still wait for a pool's room and make its target."""
        return self.budget_s - self.best_s


def outlook(
    pred: Predictor,
    own: Mapping[str, int],
    ps: Sequence[str],
    ds: Sequence[str],
    elapsed: float,
    target_s: float,
    tokens: int = 0,
    priority: int | None = None,
) -> Outlook:
    """Each P in ``ps`` with its own uncached tokens ``own[p]`` (and the request's ``priority``), its best
    D's handoff among ``ds`` for the prompt's ``tokens``, held against ``target_s``. The handoff is each
    pair's while there are at most :data:`PAIRS_IN_OUTLOOK` pairs, else D's through any P (a pair's own is
    then weighed when the D is chosen, :func:`late_decodes`): the cost of an admission stays bounded on a
    large fleet."""
    budget = pred.budget(target_s)
    per_pair = bool(ds) and len(ps) * len(ds) <= PAIRS_IN_OUTLOOK
    lags = pred.handoff_lags()
    handoff = (
        pred.ps.handoff_s
        if per_pair
        else min(
            (pred.handoff(None, d, pred.handoff_x(None, d, tokens), lags) for d in ds),
            default=pred.ps.handoff_s,
        )
    )
    late: set[str] = set()
    best = math.inf
    d_queued = pred.d_queued(ds, lags)
    for p in ps:
        est = pred.prefill(p, own.get(p, 0), priority)
        if per_pair:
            handoff = min(pred.handoff(p, d, pred.handoff_x(p, d, tokens), lags) for d in ds)
        total = elapsed + (est.seconds + handoff) * pred.margin(p, d_queued or est.ahead > 0)
        best = min(best, total)
        if total > budget and est.confident:
            late.add(p)
    return Outlook(frozenset(late), best, budget, bool(ps) and len(late) == len(ps))


def late_decodes(
    pred: Predictor,
    p: str,
    est: PEstimate,
    ds: Sequence[str],
    elapsed: float,
    target_s: float,
    tokens: int = 0,
) -> set[str]:
    """The Ds through which ``p`` (its part ``est``) would be late for a prompt of ``tokens``, when at
    least one would not be."""
    budget = pred.budget(target_s)
    lags = pred.handoff_lags()

    def total(d: str) -> float:
        margin = pred.margin(p, est.ahead > 0 or pred.d_queued((d,), lags))
        return elapsed + (est.seconds + pred.handoff(p, d, pred.handoff_x(p, d, tokens), lags)) * margin

    late = {d for d in ds if total(d) > budget}
    return late if len(late) < len(ds) else set()
