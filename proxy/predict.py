"""The per-request TTFT predictor: for every candidate P and D, when the request would see its first token.

A request's TTFT, from the moment admission lets it go, is its time in P plus its handoff::

    P part    base(P) + per_token(P) x (tokens ahead of it on P + its own uncached tokens)
    handoff   P's answer to D's first token, per P x D pair

**Tokens ahead** are the uncached prefill tokens this proxy sent to P and has not had answered
(:attr:`Predictor.backlog`), divided by this proxy's share of the pool when several proxies share
it (the controller's ``proxy.share``): the others' traffic is assumed alike. A request's own
tokens are the KV view's count (less what P is predicted to hold), else the tokenizer's, else an
estimate from its text (``chars_per_token``).

**The rates** of each P are a line fitted online (:class:`Line`: a Kalman filter on the line's
base and slope, drifting as ``predict.forget`` says) on what this proxy saw complete:
``p_done - p_sent`` against
the tokens the request was predicted with. Until a P has ``min_samples`` completions its line is
the controller's (``RoutingTable.rates``, fitted from the stored traces, with the samples behind
it), else the configured prior (``prefill_base_s`` and the KV-aware cost model's
``prefill_tokens_per_s``); the source is recorded with each prediction. The handoff is a running
mean per pair (then per D, then the table's pair or D, then ``handoff_s``).

**Its error is its margin**: every first token adds observed / predicted TTFT to a ring of the last
:data:`RATIOS` ratios, and :meth:`Predictor.factor` is their ``quantile`` (at least 1): a
prediction is multiplied by it before it is held against a target. A P is *confident* (may reject)
once its line rests on ``min_samples`` completions, its own or the table's.

Pure: no I/O, no clock; every time is passed in.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pdscope import semconv as sc
from pdscope.config import PredictSettings
from pdscope.routing import Rates
from pdscope.stats import percentile

RATIOS = 256  # observed/predicted TTFT ratios the error quantile is taken over
MIN_RATIOS = 20  # below this, the factor is 1 (a cold predictor does not reject anyway)
MAX_FACTOR = 4.0  # the error quantile's cap: a predictor this far off is reported, not trusted more
_CLIP = 5.0  # one observation moves a line at most this factor from its prediction
_PRIOR_VAR = 100.0  # s^2 (base) and (s per thousand tokens)^2 (slope): the covariance's start and cap
_NOISE_ALPHA = 0.05  # the noise estimate's weight per observation
_MIN_NOISE = 1e-6  # s^2: a 1 ms error floor
_RUN = 6  # errors in a row on one side that say the line is off, not noisy
_SETTLED = 10  # observations before one is clipped (until then the prior may be far off)
_KT = 1000.0  # the line's x is in thousands of tokens (conditioning)
HANDOFF_MIN = 3  # handoffs of a pair (or D) before its own mean is used


class Line:
    """``y = a + b x`` tracked online by a Kalman filter whose state (``a``, ``b``) may drift: each
    observation first widens the covariance by a drift of ``(1 - forget)^2`` times the noise (so the
    newest ~``1 / (1 - forget)`` observations count most, in every direction, and a direction the
    load never varies in cannot lock), then weighs the observation against the noise, itself the
    running mean of the squared errors. ``a >= 0``, ``b > 0``; ``n`` the observations seen. The prior
    is weak (a large covariance): the first completions decide, so a prior 10x off (a CPU P against
    a GPU default) is left at once."""

    __slots__ = ("a", "at", "b", "drift", "n", "noise", "p00", "p01", "p11", "run")

    def __init__(self, a: float, b: float, forget: float) -> None:
        self.a, self.b, self.n = a, max(b, 1e-9), 0
        self.at = -math.inf  # when it last learnt (the predictor's clock)
        self.drift = (1.0 - forget) ** 2
        self.noise = 1.0  # s^2: a guess, replaced by the errors seen
        self.p00, self.p01, self.p11 = _PRIOR_VAR, 0.0, _PRIOR_VAR
        self.run = 0  # errors in a row of one sign (+ over, - under)

    def __call__(self, tokens: float) -> float:
        return self.a + self.b * tokens / _KT

    def update(self, tokens: float, y: float) -> None:
        x = tokens / _KT
        guess = self.a + self.b * x
        if guess > 0 and self.n >= _SETTLED:  # one outlier (a stall, mixed times) moves it only so far
            y = min(max(y, guess / _CLIP), guess * _CLIP)
        q = self.drift * self.noise
        p00, p01, p11 = min(self.p00 + q, _PRIOR_VAR), self.p01, min(self.p11 + q, _PRIOR_VAR)
        q0, q1 = p00 + p01 * x, p01 + p11 * x
        err = y - guess
        denom = q0 + q1 * x + self.noise
        k0, k1 = q0 / denom, q1 / denom
        self.a = max(self.a + k0 * err, 0.0)
        self.b = max(self.b + k1 * err, 1e-9)
        self.p00, self.p01, self.p11 = p00 - k0 * q0, p01 - k0 * q1, p11 - k1 * q1
        sq = err * err if self.n < _SETTLED else min(err * err, 9.0 * self.noise)  # one stall: 3 sigma
        self.noise = max(self.noise + (sq - self.noise) * _NOISE_ALPHA, _MIN_NOISE)
        self.n += 1
        self._bias(err)

    def _bias(self, err: float) -> None:
        """``_RUN`` errors in a row on one side: the line is off (a warm-up it learnt from, a P that
        changed), not noisy. Its covariance opens again, so the next completions decide afresh."""
        side = 1 if err > 0 else -1
        self.run = self.run + side if self.run * side > 0 else side
        if abs(self.run) >= _RUN:
            self.p00, self.p01, self.p11 = _PRIOR_VAR, 0.0, _PRIOR_VAR
            self.noise = max(err * err, _MIN_NOISE)
            self.run = 0


class Mean:
    """A running mean that turns into an exponential one (weight :data:`ALPHA`) after a few samples."""

    ALPHA = 0.1
    __slots__ = ("at", "n", "value")

    def __init__(self) -> None:
        self.n, self.value, self.at = 0, 0.0, -math.inf

    def add(self, y: float, now: float) -> None:
        self.n, self.at = self.n + 1, now
        self.value += (y - self.value) * max(1.0 / self.n, self.ALPHA)


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
        self.backlog: dict[str, int] = {}  # P -> uncached prefill tokens sent and not yet answered
        self.share = 1.0  # this proxy's share of the pools (the controller's), for tokens ahead
        self._prior = (ps.prefill_base_s, _KT / prefill_tokens_per_s)
        self._lines: dict[str, Line] = {}
        self._pairs: dict[tuple[str, str], Mean] = {}
        self._ds: dict[str, Mean] = {}
        self._table_p: dict[str, tuple[float, float, int]] = {}  # P -> (base, s per k-token, samples)
        self._table_pair: dict[tuple[str, str], float] = {}
        self._table_d: dict[str, float] = {}
        self._ratios: deque[float] = deque(maxlen=RATIOS)
        self._factor: float | None = None

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

    def tokens_ahead(self, p: str) -> int:
        return round(self.backlog.get(p, 0) / self.share)

    def prefill(self, p: str, own: int) -> PEstimate:
        ahead = self.tokens_ahead(p)
        x = ahead + max(own, 0)
        line = self._lines.get(p)
        min_n = self.ps.min_samples
        if line is not None and line.n >= min_n:
            fresh = ahead > 0 or self.clock() - line.at <= self.ps.probe_s
            return PEstimate(line(x), ahead, sc.PREDICT_ONLINE, fresh)
        table = self._table_p.get(p)
        if table is not None:
            base, per_kt, samples = table
            return PEstimate(base + per_kt * x / _KT, ahead, sc.PREDICT_TABLE, samples >= min_n)
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

    def handoff(self, p: str | None, d: str) -> float:
        """P's answer to D's first token through ``p`` x ``d`` (``p`` None: through D, any P)."""
        oldest = self.clock() - self.ps.probe_s
        pair = self._pairs.get((p, d)) if p is not None else None
        if pair is not None and pair.n >= HANDOFF_MIN and pair.at >= oldest:
            return pair.value
        mean = self._ds.get(d)
        if mean is not None and mean.n >= HANDOFF_MIN and mean.at >= oldest:
            return mean.value
        table = self._table_pair.get((p, d)) if p is not None else None
        table = table if table is not None else self._table_d.get(d)
        return table if table is not None else self.ps.handoff_s

    def factor(self) -> float:
        """The recent error quantile the predictions are multiplied by (1 while too few are known)."""
        if self._factor is None:
            if len(self._ratios) < MIN_RATIOS:
                self._factor = 1.0
            else:
                q = percentile(list(self._ratios), 100.0 * self.ps.quantile)
                self._factor = min(max(q or 1.0, 1.0), MAX_FACTOR)
        return self._factor

    def budget(self, target_s: float) -> float:
        """The part of ``target_s`` a prediction (times :meth:`factor`) must fit in."""
        return target_s * (1.0 - self.ps.margin)

    # -- the backlog ------------------------------------------------------------------

    def add_backlog(self, p: str, tokens: int) -> None:
        if tokens > 0:
            self.backlog[p] = self.backlog.get(p, 0) + tokens

    def drop_backlog(self, p: str, tokens: int) -> None:
        left = self.backlog.get(p, 0) - tokens
        if left > 0:
            self.backlog[p] = left
        else:
            self.backlog.pop(p, None)

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
        line.update(tokens, seconds)
        line.at = self.clock()

    def observe_handoff(self, p: str, d: str, seconds: float) -> None:
        if not (seconds >= 0 and math.isfinite(seconds)):
            return
        now = self.clock()
        self._pairs.setdefault((p, d), Mean()).add(seconds, now)
        self._ds.setdefault(d, Mean()).add(seconds, now)

    def observe_ttft(self, predicted: float, observed: float) -> float | None:
        """A first token: the ratio observed / predicted (None when either is not a positive time)."""
        if not (predicted > 0 and observed >= 0 and math.isfinite(observed) and math.isfinite(predicted)):
            return None
        ratio = observed / predicted
        self._ratios.append(ratio)
        self._factor = None
        return ratio

    def lines(self) -> Mapping[str, Line]:
        return self._lines


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
) -> Outlook:
    """Each P in ``ps`` with its own uncached tokens ``own[p]``, its best D's handoff among ``ds`` (D
    level: a pair's own is weighed when the D is chosen), held against ``target_s``."""
    factor, budget = pred.factor(), pred.budget(target_s)
    handoff = min((pred.handoff(None, d) for d in ds), default=pred.ps.handoff_s)
    late: set[str] = set()
    best = math.inf
    for p in ps:
        est = pred.prefill(p, own.get(p, 0))
        total = elapsed + (est.seconds + handoff) * factor
        best = min(best, total)
        if total > budget and est.confident:
            late.add(p)
    return Outlook(frozenset(late), best, budget, bool(ps) and len(late) == len(ps))


def late_decodes(
    pred: Predictor, p: str, p_s: float, ds: Sequence[str], elapsed: float, target_s: float
) -> set[str]:
    """The Ds through which ``p`` (its part ``p_s``) would be late, when at least one would not be."""
    factor, budget = pred.factor(), pred.budget(target_s)
    late = {d for d in ds if elapsed + (p_s + pred.handoff(p, d)) * factor > budget}
    return late if len(late) < len(ds) else set()
