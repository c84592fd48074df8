"""Which fitted rates the routing table serves: the gate between the fit and ``RoutingTable.rates``.

The leader fits the rates on a cadence (:func:`analysis.rates.fit_rates`, over the records ``observe``
read on that tick), not every tick: the fit and the record columns it needs add most of a tick's
observe cost, and rates fitted over a 30 s window barely move in one 2 s interval. :meth:`RatesGate.due`
says whether this tick fits: when none has been fitted yet (a restart, a new leader: the gate starts
empty or was cleared on standing down), when nothing is served yet (an idle fleet's empty fits are
cheap, and the first rates reach the proxies at the first tick with records), when ``every_s``
seconds have passed since the last fit, or when the clock went back (a fit from the future is no
guide). The cadence is in seconds of the tick's ``now``, not in ticks: it holds whatever
``controller.interval_s`` is, and a failed tick does not shift it. Between fits the last served rates
stay, their ``fitted_at`` giving their age.

Serving each fit would change the table's ETag on noise, and every proxy would fetch the table
again. :class:`RatesGate` serves a fit, rounded to 3 significant digits, when

* none is served yet (and the fit has a row),
* ``refresh_s`` seconds have passed since the served one and the rounded figures differ, or
* an instance's figure (a P's base or seconds per token, a D's handoff, a pair's handoff) moved by
  more than ``move`` of the served one (a time by more than ``move`` of it, or ``floor_s`` at least),
  or an instance or pair appeared: a changed fleet reaches the proxies at the next fit.

A fit with no row keeps the served rates (an idle window says nothing new; ``fitted_at`` shows their
age). The served rates carry a digest (``pdscope.routing.rates_digest``), computed once here, that the
routing endpoint folds into the ETag: a proxy gets new rates, and 304 while they are the same.

The rates are not a decision: they are no input of the policy, not in the tick record, not replayed
(a replay decides on the recorded observation, which never held them). Each tick's log line says
whether it fitted them, or how old the last fit is.
Pure: the time is passed in; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pdscope.routing import Rates, rates_digest

REFRESH_S = 10.0
EVERY_S = 5.0  # controller.rates_every_s's default
MOVE = 0.2
FLOOR_S = 0.005  # a time's move under this is noise, whatever its share


@dataclass(frozen=True)
class ServedRates:
    rates: Rates
    tag: str  # rates_digest(rates), folded into the routing ETag
    at: float  # when it was first served


def _sig3(v: float | None) -> float | None:
    return None if v is None else float(f"{v:.3g}")


def rounded(rates: Rates) -> Rates:
    """``rates`` with every figure to 3 significant digits (samples and times as they are)."""
    return rates.model_copy(
        update={
            "instances": [
                r.model_copy(
                    update={
                        "prefill_base_s": _sig3(r.prefill_base_s),
                        "prefill_s_per_token": _sig3(r.prefill_s_per_token),
                        "handoff_s": _sig3(r.handoff_s),
                        "error": _sig3(r.error),
                    }
                )
                for r in rates.instances
            ],
            "pairs": [p.model_copy(update={"handoff_s": _sig3(p.handoff_s)}) for p in rates.pairs],
        }
    )


def _figures(rates: Rates) -> Iterator[tuple[tuple[str, str, str], float | None, bool]]:
    """``(key, value, is a time)`` of every figure a proxy predicts with."""
    for r in rates.instances:
        yield (r.name, "", "base"), r.prefill_base_s, True
        yield (r.name, "", "slope"), r.prefill_s_per_token, False
        yield (r.name, "", "handoff"), r.handoff_s, True
    for p in rates.pairs:
        yield (p.prefill, p.decode, "handoff"), p.handoff_s, True


def moved(old: Rates, new: Rates, move: float = MOVE, floor_s: float = FLOOR_S) -> bool:
    """Whether a figure of ``new`` moved by more than ``move`` from ``old``, or appeared."""
    before = {key: v for key, v, _ in _figures(old)}
    for key, v, is_time in _figures(new):
        if v is None:
            continue
        was = before.get(key)
        if was is None:
            return True
        if abs(v - was) > move * max(abs(was), floor_s if is_time else 0.0):
            return True
    return False


class RatesGate:
    """Holds the served rates and when the last fit was; ask :meth:`due` each tick, :meth:`offer` each
    fit. Not thread-safe: the reconciler's lock holds it."""

    def __init__(self, refresh_s: float = REFRESH_S, move: float = MOVE, every_s: float = EVERY_S) -> None:
        self.refresh_s = refresh_s
        self.move = move
        self.every_s = every_s
        self.served: ServedRates | None = None
        self.last_fit: float | None = None  # when the last fit was tried, served or not

    def due(self, now: float) -> bool:
        """Whether the tick at ``now`` fits the rates (the module docstring says when)."""
        last = self.last_fit
        return self.served is None or last is None or now < last or now - last >= self.every_s

    def offer(self, fitted: Rates, now: float) -> ServedRates | None:
        """The rates to serve after this fit (the same object while they do not change); the fit's time
        starts the next wait of the cadence."""
        self.last_fit = now
        if not fitted.instances and not fitted.pairs:
            return self.served
        new = rounded(fitted)
        cur = self.served
        if cur is not None:
            due = now - cur.at >= self.refresh_s and (new.instances, new.pairs) != (
                cur.rates.instances,
                cur.rates.pairs,
            )
            if not due and not moved(cur.rates, new, self.move):
                return cur
        self.served = ServedRates(new, rates_digest(new), now)
        return self.served

    def clear(self) -> None:
        """Forget the served rates and the cadence: the next leader tick fits."""
        self.served = None
        self.last_fit = None
