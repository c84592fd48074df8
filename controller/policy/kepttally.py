"""The evidence window's tally kept between ticks: each record's charges added once, taken back exactly.

``controller.observe`` charged every record of the 30 s window on every tick (``evidence.WindowTally``):
at 1,000 instances, some 19,000 records each tick, most of them charged the same way as the tick before.
:class:`KeptTally` keeps what each record added, by the record's id (:meth:`KeptTally.add`): a record
updated (a late span) or leaving the window takes back what it added (:meth:`KeptTally.remove`) before
it is added anew, so a tick costs the records that changed. :meth:`KeptTally.tally` then lays the kept
figures out as the ``WindowTally`` a whole read would have built, for the same records:

- the counts are the same sums;
- each list holds the same values, in another order: what reads them does not depend on the order
  (percentiles; means and spreads summed exactly, ``math.fsum``), except the newest unpulled request ids
  of a P, which are the last by (arrival, id), the order a whole read adds them in
  (``controller.observe``'s read is ordered so);
- the handoffs counted after a P's restart are counted when laid out, against the restarts of that tick
  (a restart confirmed later counts the kept handoffs again);
- each P x D pair's lists are laid out again only when the pair's values changed (most of a large fleet's
  pairs hold a record or two, and do not change from one tick to the next): those lists are shared
  between the tallies laid out, and nothing may change them.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import TypeVar

from controller.policy.charges import Charge, HandoffFacts, Pair, after_restart
from controller.policy.evidence import UNPULLED_IDS, WindowTally
from controller.policy.signals import Role

K = TypeVar("K")
Sub = tuple[int, int]  # (record id, slot): a record may add twice to one bag (P and D of one name)


class _Instance:
    """What the kept records add to one instance."""

    __slots__ = ("contribution", "failed", "handoff", "refs", "refused", "requests", "unpulled")

    def __init__(self) -> None:
        self.refs = 0  # records that name it (a whole read's tally has it then, if only with zeros)
        self.requests = self.failed = self.refused = 0
        self.contribution: dict[Sub, float] = {}
        self.handoff: dict[Sub, float] = {}
        self.unpulled: dict[int, tuple[float, int, str | None]] = {}  # id -> (arrival, id, request id)


class _Pool:
    __slots__ = ("kv_bytes", "residence", "service", "unqueued")

    def __init__(self) -> None:
        self.service: dict[Sub, float] = {}
        self.unqueued: dict[Sub, float] = {}
        self.residence: dict[Sub, float] = {}
        self.kv_bytes: dict[Sub, float] = {}


def _put(bag: dict[K, float], key: K, value: float | None, add: bool) -> None:
    if value is not None:
        if add:
            bag[key] = value
        else:
            bag.pop(key, None)


class _PairBags:
    """A figure's values per P x D pair, by record id, and each pair's list as last laid out (kept until the
    pair's values change: most of a large fleet's pairs do not change from one tick to the next)."""

    __slots__ = ("bags", "dirty", "lists")

    def __init__(self) -> None:
        self.bags: dict[Pair, dict[int, float]] = {}
        self.lists: dict[Pair, list[float]] = {}
        self.dirty: set[Pair] = set()

    def put(self, pair: Pair | None, key: int, value: float | None, add: bool) -> None:
        if pair is None or value is None:
            return
        self.dirty.add(pair)
        if add:
            self.bags.setdefault(pair, {})[key] = value
            return
        bag = self.bags.get(pair)
        if bag is not None:
            bag.pop(key, None)
            if not bag:
                del self.bags[pair]

    def laid_out(self) -> defaultdict[Pair, list[float]]:
        """Each pair's values as a list (a pair with none left out); the lists are shared with the last
        call's where the pair did not change, and must not be changed."""
        for pair in self.dirty:
            bag = self.bags.get(pair)
            if bag:
                self.lists[pair] = list(bag.values())
            else:
                self.lists.pop(pair, None)
        self.dirty.clear()
        return defaultdict(list, self.lists)


class KeptTally:
    """Each kept record's charges, by id, and what they add up to (see the module docstring)."""

    def __init__(self) -> None:
        self._charges: dict[int, Charge] = {}
        self._instances: dict[str, _Instance] = {}
        self._pools: dict[str, _Pool] = {}
        self._ttft, self._service, self._unqueued = _PairBags(), _PairBags(), _PairBags()
        self._handoffs: dict[int, float] = {}
        self._charged: dict[int, HandoffFacts] = {}
        self._pair_failures: dict[Pair, int] = {}
        # P -> id -> (D, P done, served, failed at D): what counts per pair after P's restart
        self._through: dict[str, dict[int, tuple[str, float | None, bool, bool]]] = {}
        self._first: dict[int, float] = {}  # the charged records' arrivals
        self._last: dict[int, float] = {}  # every record's arrival

    def __len__(self) -> int:
        return len(self._charges)

    def charge(self, key: int) -> Charge | None:
        """Record ``key``'s kept charges (None: none kept)."""
        return self._charges.get(key)

    def add(self, key: int, c: Charge) -> None:
        """Keep record ``key``'s charges (first taking back those it had)."""
        self.remove(key)
        self._charges[key] = c
        self._walk(key, c, True)

    def remove(self, key: int) -> None:
        """Take back what record ``key`` added; nothing if it added nothing."""
        c = self._charges.pop(key, None)
        if c is not None:
            self._walk(key, c, False)
            for name in (c.p, c.d):
                if name is not None:
                    self._release(name)

    def _walk(self, key: int, c: Charge, add: bool) -> None:
        """Add (``add``) or take back every figure of ``c``: the one place that says where each goes."""
        step = 1 if add else -1
        names = [inst for inst in (c.p, c.d) if inst is not None]
        insts = [self._instance(name, step) for name in names]
        _put(self._last, key, c.t_in, add)
        if c.invalid:
            for inst in insts:
                inst.refused += step
            return
        if c.handoff_facts is not None:
            if add:
                self._charged[key] = c.handoff_facts
            else:
                self._charged.pop(key, None)
        for inst in insts:
            inst.requests += step
        self._outcome(key, c, step)
        if c.p is not None:
            _put(self._instances[c.p].contribution, (key, 0), c.p_contribution, add)
        if c.d is not None:
            _put(self._instances[c.d].contribution, (key, 1), c.d_contribution, add)
        _put(self._handoffs, key, c.handoff, add)
        for slot, inst in enumerate(insts):
            _put(inst.handoff, (key, slot), c.handoff, add)
        self._ttft.put(c.pair, key, c.ttft_pair, add)
        if c.t_in is not None:
            self._times(key, c, add)

    def _instance(self, name: str, step: int) -> _Instance:
        inst = self._instances.get(name)
        if inst is None:
            inst = self._instances[name] = _Instance()
        inst.refs += step
        return inst

    def _release(self, name: str) -> None:
        """Forget an instance no kept record names any more (a whole read would not have it)."""
        inst = self._instances.get(name)
        if inst is not None and inst.refs <= 0:
            del self._instances[name]

    def _outcome(self, key: int, c: Charge, step: int) -> None:
        pair = c.pair
        if c.failed_on is not None:
            self._instances[c.failed_on].failed += step  # one of the record's own: held by its refs
        if pair is not None and c.pair_failed:
            n = self._pair_failures.get(pair, 0) + step
            if n:
                self._pair_failures[pair] = n
            else:
                self._pair_failures.pop(pair, None)
        if pair is not None and (c.served or c.pair_failed):
            through = self._through.setdefault(pair[0], {})
            if step > 0:
                through[key] = (pair[1], c.p_done, c.served, c.pair_failed)
            else:
                through.pop(key, None)
                if not through:
                    del self._through[pair[0]]
        if c.unpulled and c.p is not None:
            unpulled = self._instances[c.p].unpulled
            if step > 0:
                unpulled[key] = (c.t_in if c.t_in is not None else -float("inf"), key, c.request_id)
            else:
                unpulled.pop(key, None)

    def _times(self, key: int, c: Charge, add: bool) -> None:
        """What a record with an arrival time adds: the window's first arrival, its pools' figures."""
        _put(self._first, key, c.t_in, add)
        self._service.put(c.pair, key, c.service, add)
        self._unqueued.put(c.pair, key, c.unqueued, add)
        for slot, t in enumerate(c.pools):
            pool = self._pools.get(t.pool)
            if pool is None:
                if not add:
                    continue
                pool = self._pools[t.pool] = _Pool()
            sub = (key, slot)
            _put(pool.service, sub, c.service, add)
            _put(pool.unqueued, sub, c.unqueued, add)
            _put(pool.residence, sub, t.residence, add)
            _put(pool.kv_bytes, sub, t.kv_bytes, add)

    def tally(
        self, pools: Mapping[str, Role], now: float, restarted: Mapping[str, float] | None
    ) -> WindowTally:
        """The kept records' ``WindowTally`` at ``now``, with these pools and restarts: a fresh one each
        call (the tick charges its failed attempts and lease expiries on it)."""
        t = WindowTally(pools, now, restarted)
        for name, inst in self._instances.items():
            out = t.instances[name]
            out.requests, out.failed, out.refused = inst.requests, inst.failed, inst.refused
            out.contribution = list(inst.contribution.values())
            out.handoff = list(inst.handoff.values())
            if inst.unpulled:
                out.unpulled = len(inst.unpulled)
                ids = [rid for _, _, rid in sorted(inst.unpulled.values()) if rid]
                out.unpulled_ids = ids[-UNPULLED_IDS:]
        t.ttft_by_pair = self._ttft.laid_out()
        t.service_by_pair = self._service.laid_out()
        t.unqueued_by_pair = self._unqueued.laid_out()
        t.handoffs = list(self._handoffs.values())
        t.charged_handoffs = list(self._charged.values())
        t.pair_failures = defaultdict(int, self._pair_failures)
        for p, at in (restarted or {}).items():
            for d, p_done, served, failed in self._through.get(p, {}).values():
                if after_restart({p: at}, p, p_done):
                    if served:
                        t.served_since_restart[p, d] += 1
                    if failed:
                        t.failed_since_restart[p, d] += 1
        for name, pool in self._pools.items():
            agg = t.pools.get(name)
            if agg is not None:
                agg.service_ttft = list(pool.service.values())
                agg.unqueued_ttft = list(pool.unqueued.values())
                agg.residence = list(pool.residence.values())
                agg.kv_bytes = list(pool.kv_bytes.values())
                agg.done = len(pool.residence)
        t.first_in = min(now, min(self._first.values(), default=now))
        t.last_in = max(self._last.values(), default=None)
        return t
