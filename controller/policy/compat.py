"""Compatible pairs only: which P x D pairs may carry a handoff, by what the instances report of themselves.

Each instance's identity (``InstanceSignals.identity``: its model, KV block size and KV cache dtype as
the collector last scraped them, and its revision from the config) is compared P against D by
:func:`pdscope.kvcompat.compare`: a pair is compatible, incompatible (a field differs) or unknown (a
field reported by one side only, or malformed). An instance with nothing on record yet (never scraped
up) makes each of its pairs unknown.

**Which pairs are left out of routing** (``avoid_pairs``, reason ``IncompatiblePair``; the proxy
never picks them, never probes them):

- every incompatible pair;
- every unknown pair whose P has a compatible D, or whose D has a compatible P: a known-good pairing
  exists for that side, so nothing is risked on a guess. An unknown pair between two instances that
  have no compatible partner at all stays routable (a fleet whose metrics are malformed everywhere
  still serves, and is alerted).

An instance left with no routable partner is **unpaired**: the proxy leaves it out. An instance that
has no compatible partner (only incompatible or unknown ones) fires ``IncompatiblePair``
(:func:`no_partner`), unless it has nothing on record yet. The work is per distinct identity, not
per instance, so a fleet of a few identities costs a few comparisons. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from controller.policy.signals import InstanceSignals, Observation
from pdscope.kvcompat import Identity, Verdict, compare

_UNOBSERVED = Verdict("unknown", (), "nothing on record yet (not scraped up)")


@dataclass(frozen=True)
class AvoidedPair:
    """A pair left out of routing for its identities, since when, and why."""

    p_instance: str
    d_instance: str
    since: float
    status: str  # incompatible | unknown
    text: str


@dataclass(frozen=True)
class Compat:
    """One tick's judgement: the pairs left out, the instances with no routable partner, and per instance
    with no compatible partner (observed), why (the ``IncompatiblePair`` alert's description)."""

    avoided: tuple[AvoidedPair, ...] = ()
    unpaired: tuple[str, ...] = ()
    no_partner: Mapping[str, str] | None = None

    def by_pair(self) -> dict[str, AvoidedPair]:
        """The avoided pairs by "P->D": the state carried to the next tick (``PolicyState.compat``)."""
        return {f"{a.p_instance}->{a.d_instance}": a for a in self.avoided}


def _verdict(p: Identity | None, d: Identity | None) -> Verdict:
    return _UNOBSERVED if p is None or d is None else compare(p, d)


def _classes(instances: list[InstanceSignals]) -> dict[Identity | None, list[str]]:
    out: dict[Identity | None, list[str]] = {}
    for i in instances:
        out.setdefault(i.identity, []).append(i.name)
    return out


def judge(obs: Observation, prev: Mapping[str, AvoidedPair]) -> Compat:
    """The compatible-pairs judgement of ``obs`` (module docstring); ``prev``: the last tick's
    :meth:`Compat.by_pair`, so that a pair left out keeps its ``since``."""
    ps = _classes([i for i in obs.instances if i.role == "prefill"])
    ds = _classes([i for i in obs.instances if i.role == "decode"])
    if not ps or not ds:
        return Compat(no_partner={})
    verdicts = {(a, b): _verdict(a, b) for a in ps for b in ds}
    good_p = {a for (a, _), v in verdicts.items() if v.status == "compatible"}
    good_d = {b for (_, b), v in verdicts.items() if v.status == "compatible"}
    avoided: list[AvoidedPair] = []
    routable: set[str] = set()
    for (a, b), v in verdicts.items():
        left_out = v.status == "incompatible" or (v.status == "unknown" and (a in good_p or b in good_d))
        if not left_out:
            routable.update(ps[a] + ds[b])
            continue
        for p in ps[a]:
            for d in ds[b]:
                old = prev.get(f"{p}->{d}")
                avoided.append(AvoidedPair(p, d, obs.now if old is None else old.since, v.status, v.text))
    names = [n for group in (*ps.values(), *ds.values()) for n in group]
    return Compat(
        avoided=tuple(sorted(avoided, key=lambda a: (a.p_instance, a.d_instance))),
        unpaired=tuple(sorted(n for n in names if n not in routable)),
        no_partner=_no_partner(ps, ds, verdicts, good_p, good_d),
    )


def _no_partner(
    ps: Mapping[Identity | None, list[str]],
    ds: Mapping[Identity | None, list[str]],
    verdicts: Mapping[tuple[Identity | None, Identity | None], Verdict],
    good_p: set[Identity | None],
    good_d: set[Identity | None],
) -> dict[str, str]:
    """Per observed instance with no compatible partner: the verdict toward one instance of the other role
    (the first by name), as the alert's description."""
    out: dict[str, str] = {}
    for mine, others, good, role in ((ps, ds, good_p, "P"), (ds, ps, good_d, "D")):
        for ident, names in mine.items():
            if ident is None or ident in good:
                continue
            other = min(others, key=lambda o: min(others[o]))
            v = verdicts[(ident, other)] if role == "P" else verdicts[(other, ident)]
            for name in names:
                out[name] = (
                    f"{name} ({role}) is compatible with no instance of the other role; "
                    f"toward {min(others[other])}: {v.status}: {v.text}"
                )
    return out
