"""What one request record is charged with: the charging rules, record by record.

``controller.policy.evidence`` states the rules (a failure to the stage that failed it, a refusal as
invalid to nobody, ...); :func:`charge_of` applies them to one record's facts and says, in a
:class:`Charge`, every figure that record adds to the window's tally: which instances it counts on,
the failure and on whom, its stage times, its handoff, its pools' times. Two tallies take charges:
``evidence.WindowTally`` (a window read whole, each charge appended) and
``controller.policy.kepttally.KeptTally`` (a window kept between ticks, each charge kept by the
record's id so that a record updated or leaving the window takes back exactly what it added).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from pdscope.semconv import FAILED_OUTCOMES

# Failed request outcomes (FAILED_OUTCOMES) are charged to the instance that failed them; a 503
# refusal is overload, like a 429.
NOT_CHARGED_ERRORS = frozenset({"upstream_status_503"})

Pair = tuple[str, str]


class RecordFacts(NamedTuple):
    """One request record's columns the charging rules read (``observe`` selects them in this order)."""

    p_instance: str | None
    d_instance: str | None
    p_pool: str | None
    d_pool: str | None
    status: str | None
    http_status: int | None
    proxy_in: float | None
    p_sent: float | None
    p_done: float | None
    d_sent: float | None
    first_token: float | None
    done: float | None
    ttft_s: float | None
    kv_bytes: int | None
    error: str | None
    lease_expiry_suspect: bool | None
    p_queue_s: float | None
    request_id: str | None = None


class HandoffFacts(NamedTuple):
    """A charged record's handoff columns: what the handoff percentiles per P, D and pair are taken over."""

    p_instance: object
    d_instance: object
    p_done: object
    first_token: object
    lease_expiry_suspect: object


class PoolTime(NamedTuple):
    """A record's figures in one of its pools: its residence there (None: it has not ended there) and its
    KV bytes (None: not stored)."""

    pool: str
    residence: float | None
    kv_bytes: float | None


class Charge(NamedTuple):
    """What one record adds to a window's tally (:func:`charge_of`). ``invalid``: it counts on its
    instances as refused, and nothing else of it is charged."""

    p: str | None
    d: str | None
    t_in: float | None  # its arrival at the proxy (how far the records reach; the window's first)
    invalid: bool
    handoff_facts: HandoffFacts | None = None
    served: bool = False  # served through both: counted per pair after P's restart
    pair_failed: bool = False  # failed at D once it began: counted per pair (and after P's restart)
    failed_on: str | None = None  # the instance its failure is charged to
    p_done: float | None = None  # when P finished it (the pair counts after P's restart)
    unpulled: bool = False  # P finished it and no D served it
    request_id: str | None = None
    ttft_pair: float | None = None  # its TTFT, on its pair
    p_contribution: float | None = None  # P's own stage time
    d_contribution: float | None = None  # D's own stage time
    handoff: float | None = None  # P's answer to the first token
    service: float | None = None  # TTFT without the admission wait
    unqueued: float | None = None  # and without P's queue
    pools: tuple[PoolTime, ...] = ()

    @property
    def pair(self) -> Pair | None:
        return (self.p, self.d) if self.p is not None and self.d is not None else None


def _name(v: object) -> str | None:
    return v if isinstance(v, str) else None


def _num(v: object) -> float | None:
    return v if isinstance(v, float) else None


def charge_of(r: RecordFacts, invalid: bool) -> Charge:
    """The charges of one record; ``invalid``: refused as invalid (``store.queries.is_client_error``)."""
    p, d, t_in = _name(r.p_instance), _name(r.d_instance), _num(r.proxy_in)
    if invalid:  # nobody's fault, counted only
        return Charge(p, d, t_in, True)
    p_sent, p_done, d_sent, first = _num(r.p_sent), _num(r.p_done), _num(r.d_sent), _num(r.first_token)
    failed = r.status in FAILED_OUTCOMES and r.error not in NOT_CHARGED_ERRORS
    decoded = r.d_sent is not None
    # a failure is its stage's: D's once the decode stage began, else P's
    failed_on = d if d is not None and decoded else p if p is not None and not decoded else None
    # D's own time starts when it has the request and P has answered: push mode sends D's leg with P's,
    # and D's wait for P's prefill is P's
    d_from = None if d_sent is None else d_sent if p_done is None else max(d_sent, p_done)
    both, ok = p is not None and d is not None, r.status == "ok"
    facts = HandoffFacts(r.p_instance, r.d_instance, r.p_done, r.first_token, r.lease_expiry_suspect)
    service, unqueued, pools = _pool_part(r, t_in, p_done)
    return Charge(
        p,
        d,
        t_in,
        False,
        handoff_facts=facts,
        served=ok and both,
        pair_failed=failed and decoded and both,
        failed_on=failed_on if failed else None,
        p_done=p_done,
        unpulled=p is not None and p_done is not None and r.first_token is None,
        request_id=r.request_id,
        ttft_pair=_num(r.ttft_s) if ok and both else None,
        p_contribution=_since(p_sent, p_done) if p is not None else None,
        d_contribution=_since(d_from, first) if d is not None else None,
        handoff=_since(p_done, first),
        service=service,
        unqueued=unqueued,
        pools=pools,
    )


def _since(start: float | None, end: float | None) -> float | None:
    return max(0.0, end - start) if start is not None and end is not None else None


def _pool_part(
    r: RecordFacts, t_in: float | None, p_done: float | None
) -> tuple[float | None, float | None, tuple[PoolTime, ...]]:
    """TTFT without the admission wait (proxy in -> sent to P), and without P's queue too; each pool's
    residence (in until P, then D, finished it) and KV bytes. Nothing without an arrival time."""
    if t_in is None:
        return None, None, ()
    ttft, p_sent, p_queue = _num(r.ttft_s), _num(r.p_sent), _num(r.p_queue_s)
    service = None
    if r.status == "ok" and ttft is not None and p_sent is not None:
        service = ttft - max(0.0, p_sent - t_in)
    unqueued = max(0.0, service - p_queue) if service is not None and p_queue is not None else None
    kv = float(r.kv_bytes) if isinstance(r.kv_bytes, int) else None
    pools = tuple(
        PoolTime(pool, _since(t_in, end), kv if end is not None else None)
        for pool, end in ((r.p_pool, p_done), (r.d_pool, _num(r.done)))
        if isinstance(pool, str)
    )
    return service, unqueued, pools


def after_restart(restarted: Mapping[str, float] | None, p: str, p_done: object) -> bool:
    """Whether a handoff P finished at ``p_done`` came after P's latest restart (``restarted``: P -> when)."""
    at = (restarted or {}).get(p)
    return at is not None and isinstance(p_done, int | float) and p_done >= at
