"""A pair fault's verdict (issue 29): was the slow P x D link avoided, without cutting its ends?

A fault on one link is neither its P's nor its D's: each serves its other links well, and a cut of
either takes their capacity away for one cell of the matrix. What answers it is that the pair
carries less: the controller serves every pair's handoff median in the routing table's rates, and
each proxy's predictor steers away from a slow pair. So for a pair fault the blame matrix reads the
pair's traffic from the stored records: its *share*, the handoffs it carried from ``REACTION_TICKS``
ticks after onset over what an even spread over every P x D pair would give it (1.0: treated like
any pair; 0: avoided altogether). It is *avoided* at ``AVOIDED_SHARE`` or less.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

AVOIDED_SHARE = 0.5  # a pair carrying at most half of an even share is avoided

Pair = tuple[str, str]


def fault_pair(injections: Iterable[Mapping[str, Any]]) -> Pair | None:
    """The (P, D) of a fault on one link (one injection naming both ends); None for any other fault."""
    pairs = {
        (str(i["prefill"]), str(i["decode"])) for i in injections if i.get("prefill") and i.get("decode")
    }
    return next(iter(pairs)) if len(pairs) == 1 else None


def read_pair_counts(store_url: str, since: float) -> dict[Pair, int]:
    """Handoffs per (P, D) of the records received from ``since`` (Unix s) that name both ends."""
    from sqlalchemy import create_engine, func, select

    from store.models import RequestRecord

    engine = create_engine(store_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                select(RequestRecord.p_instance, RequestRecord.d_instance, func.count())
                .where(RequestRecord.proxy_in >= since)
                .where(RequestRecord.p_instance.is_not(None), RequestRecord.d_instance.is_not(None))
                .group_by(RequestRecord.p_instance, RequestRecord.d_instance)
            ).all()
        return {(str(p), str(d)): int(n) for p, d, n in rows if p and d}
    finally:
        engine.dispose()


def pair_share(counts: Mapping[Pair, int], pair: Pair, n_pairs: int) -> float | None:
    """``pair``'s handoffs over an even share of all of ``counts`` among ``n_pairs`` pairs; None when
    nothing was counted."""
    total = sum(counts.values())
    if total <= 0 or n_pairs <= 0:
        return None
    return round(counts.get(pair, 0) / (total / n_pairs), 3)
