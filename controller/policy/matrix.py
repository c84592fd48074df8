"""The P×D handoff matrix one tick reads, factored into P, D and pair effects (issue 29).

Each pair's cell is the median of its window's handoffs (P's answer to D's first token), or of its
recent ones where they say the link just slowed (:func:`recent_cells`); :func:`handoff_matrix`
factors the cells with :func:`analysis.blame.factor`. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from analysis.blame import BlameConfig, Cell, Factorization, Pair, factor
from controller.policy.config import PolicyConfig
from controller.policy.signals import Observation, PairSignals


def _slowed(x: PairSignals, cfg: PolicyConfig) -> bool:
    """Its recent handoffs' median is past ``latency_tolerance`` times its window's."""
    return (
        x.recent_p50_s is not None
        and x.recent_requests > 0
        and x.recent_p50_s > x.handoff_p50_s * cfg.latency_tolerance
    )


def _lines(pairs: Iterable[PairSignals], axis: int) -> dict[str, list[PairSignals]]:
    """The pairs with recent handoffs, by P (axis 0) or by D (axis 1)."""
    out: dict[str, list[PairSignals]] = {}
    for x in pairs:
        if x.recent_requests > 0:
            out.setdefault(x.p_instance if axis == 0 else x.d_instance, []).append(x)
    return out


def _alone(slowed: Sequence[PairSignals], axis: int, crossing: Mapping[str, tuple[int, int]]) -> bool:
    """Whether a line's slowdown is its own: of the other lines' cells that cross it (the other Ps'
    toward the same Ds, for a row; the same Ps' toward the other Ds, for a column) with recent
    handoffs, a third at most slowed too, and one at least to compare with. A D that slowed shows in
    every P's row; read row by row it blamed healthy Ps on a 4P+2D fleet. ``crossing``: per line of
    the other side, its cells with recent handoffs and those slowed (the line's own cells among
    them, one per crossed line, are taken out)."""
    crossed = [crossing.get(x.d_instance if axis == 0 else x.p_instance, (0, 0)) for x in slowed]
    recent = sum(n for n, _ in crossed) - len(slowed)
    slow = sum(k for _, k in crossed) - len(slowed)
    return recent > 0 and 3 * slow <= recent


def _recent_needed(slowed: Sequence[PairSignals], cfg: PolicyConfig) -> int:
    """The recent handoffs a line's slowed cells need together: ``min_recent_samples``, or half of it
    (rounded up) where each cell's recent median is past ``blame_threshold`` × ``latency_tolerance``
    times its window's. The proxies leave a P whose NIC slowed tenfold after a handoff or two per D:
    4P+2D, its row's recent handoffs were 2.7 s and 4.0 s against a window's 0.42 s, two per cell,
    and never five together, so the P went uncut."""
    far = cfg.blame_threshold * cfg.latency_tolerance
    if all(x.recent_p50_s is not None and x.recent_p50_s > x.handoff_p50_s * far for x in slowed):
        return -(-cfg.min_recent_samples // 2)
    return cfg.min_recent_samples


def recent_cells(pairs: Sequence[PairSignals], cfg: PolicyConfig) -> set[Pair]:
    """The pairs whose cell is read over their recent handoffs (``handoff_recent_s``, by first token).

    A window's median of a link that just slowed waits for half of the window to be slow, and the
    proxies, which predict each pair's handoff and leave a slow one at once, send it a handoff or two
    more per D: a P whose NIC slowed tenfold was blamed 9-10 s after onset, on cells whose recent
    handoffs had all been ten times the typical pair's since the third second. So a pair is read over
    its recent handoffs where they are past ``latency_tolerance`` times its window's median and either
    ``min_recent_samples`` of them say so alone, or its row or column says so together: two thirds of
    the line's cells with recent handoffs, two at least, slowed, with ``min_recent_samples`` recent
    handoffs among them (half as many where all are far past, :func:`_recent_needed`), and the
    lines crossing it not slowed alike (:func:`_alone`). Upward only, and
    still factored against the typical pair with the blame threshold: a healthy cell's recent noise,
    or the whole fleet slowing together, blames nobody."""
    chosen = {
        (x.p_instance, x.d_instance)
        for x in pairs
        if _slowed(x, cfg) and x.recent_requests >= cfg.min_recent_samples
    }
    lines = (_lines(pairs, 0), _lines(pairs, 1))
    counts = tuple(
        {name: (len(xs), sum(1 for x in xs if _slowed(x, cfg))) for name, xs in side.items()}
        for side in lines
    )
    for axis in (0, 1):
        for xs in lines[axis].values():
            slowed = [x for x in xs if _slowed(x, cfg)]
            if (
                len(slowed) >= 2
                and 3 * len(slowed) >= 2 * len(xs)
                and sum(x.recent_requests for x in slowed) >= _recent_needed(slowed, cfg)
                and _alone(slowed, axis, counts[1 - axis])
            ):
                chosen.update((x.p_instance, x.d_instance) for x in slowed)
    return chosen


def handoff_matrix(obs: Observation, cfg: PolicyConfig) -> Factorization | None:
    """The tick's P×D matrix of median handoffs over the up instances, each cell its window's median or,
    where :func:`recent_cells` says the link just slowed, its recent one; factored into P, D and pair
    effects (:func:`analysis.blame.factor`). None when no pair carried a handoff."""
    if not obs.pairs:
        return None
    recent = recent_cells(obs.pairs, cfg)
    cells = {
        (x.p_instance, x.d_instance): Cell(
            x.recent_p50_s
            if (x.p_instance, x.d_instance) in recent and x.recent_p50_s is not None
            else x.handoff_p50_s,
            x.requests,
        )
        for x in obs.pairs
    }
    up = [o for o in obs.instances if o.up]
    return factor(
        cells,
        [o.name for o in up if o.role == "prefill"],
        [o.name for o in up if o.role == "decode"],
        BlameConfig(min_samples=cfg.min_samples, threshold=cfg.blame_threshold),
    )
