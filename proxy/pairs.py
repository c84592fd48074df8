"""The P x D pairs the controller says to leave out, and this proxy's probes through them.

The routing table's ``avoid_pairs`` (a D whose agent for a restarted P is stale: every pull fails)
become, per P, Ds that a pick with that P leaves out (:meth:`PairProbes.left_out`), so the request
goes to another D instead of failing and retrying. Two exceptions keep the proxy serving and
the pair able to come back:

- **a probe**: a pair not tried by this proxy for ``probe_s`` (counted from when it first saw the
  pair avoided) is not left out of the next pick; when that pick chooses it
  (:meth:`PairProbes.picked`), the probe clock restarts. A served probe
  is what lets the controller take the pair off the list;
- **nowhere else**: when every D the pick could choose is left out, none is.

Pure apart from the state it keeps; the clock is passed in.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping


class PairProbes:
    def __init__(self, probe_s: float) -> None:
        self.probe_s = probe_s
        self._tried: dict[tuple[str, str], float] = {}

    def left_out(
        self, avoid: Mapping[str, frozenset[str]], p: str, ds: Collection[str], now: float
    ) -> frozenset[str]:
        """The Ds of ``ds`` a pick with ``p`` leaves out now: the avoided ones not due a probe, unless
        that is every one of ``ds``."""
        avoided = avoid.get(p)
        if not avoided:
            return frozenset()
        for d in avoided:  # first seen avoided: its first probe is due a probe_s from now
            self._tried.setdefault((p, d), now)
        out = frozenset(d for d in avoided if now - self._tried[p, d] < self.probe_s)
        return frozenset() if all(d in out for d in ds) else out

    def picked(self, avoid: Mapping[str, frozenset[str]], p: str, d: str, now: float) -> bool:
        """Note the pick of ``(p, d)``: True when it is a probe of an avoided pair."""
        if d not in avoid.get(p, ()):
            return False
        self._tried[p, d] = now
        if len(self._tried) > 4 * max(1, sum(len(v) for v in avoid.values())) + 64:
            # bounded: forget the pairs the table no longer avoids
            self._tried = {k: v for k, v in self._tried.items() if k[1] in avoid.get(k[0], ())}
        return True
