"""Who is slow in a P×D matrix: the P, the D or the pair (pure: no I/O, no clock).

Every request goes through one P and one D, so per-pair figures (handoff time, KV pull time,
transfer failures, lease expiries) form a P×D matrix. :func:`factor` splits one window's matrix
into a typical figure × a P effect per row × a D effect per column × a residual per cell, and
names whom it blames, with the cells behind each blame. Turning blames into weights is the
caller's business. The rules:

* **Usable cells.** A cell counts when it has ``min_samples`` samples or more and a positive,
  finite value; the others are left out and counted in the notes. The fit works on logs, so
  every effect is a ratio: 3.0 is three times its peers.
* **Median polish.** Row medians, then column medians, are moved from the residuals into the
  row and column effects, for ``iterations`` rounds or until no median moves by 1e-9. Medians
  run over the cells present only, so a sparse matrix costs O(iterations × cells). They are
  lower medians (of an even count, the smaller middle value): faults only slow things down, so
  of two cells that disagree the faster is taken as the healthy one.
* **Anchored on the fast side.** Centred on their medians, two Ps with one 4× slower would read
  0.5× and 2×, and neither could be named. So after the polish each side's effects are shifted
  until their lower median is 1× (the shift goes into the typical): the slow P reads 4×, the
  fast one 1×.
* **Blame.** A judged P whose ratio is at least ``threshold`` is blamed, and a judged D alike.
  A pair is blamed when its residual (the cell over what its P and D predict) is at least
  ``threshold`` and clears the noise bar: a cell slow only because its P is slow is the P's
  alone, and a slow P with one still slower cell blames the P and that pair.
* **Noise.** With many cells, some healthy ones cross any fixed ratio by chance. From 20
  nonzero residuals on, their robust spread (1.4826 × the lower median of |residual| × √count,
  for a typical count) sets a bar too: a pair must stand ``noise_z`` spreads out, further when
  its cell has fewer samples than the typical. Below 20, the threshold alone decides.
* **Sparse rules.** A row or column with fewer than ``min_cells`` usable cells (or than the
  fleet's other side has instances, when that is fewer) is set aside with its cells, repeatedly, since
  that can thin another; then only the largest group of rows and columns linked by sampled
  pairs is fitted. A side left with one line cannot be told from the typical: with one P, the
  P is not judged and the Ds are judged against each other (one D alike; a 1×1 fleet judges
  nothing). A pair is placed only when its P and D are both judged, each on two cells or more;
  a cell outside the fit is never blamed, and when its line reads slow a note says the matrix
  cannot place it. Every instance not judged is in ``unjudged`` with its reason, and the notes
  say that per-instance evidence decides for it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median_low
from typing import Literal

Pair = tuple[str, str]
Side = Literal["prefill", "decode"]
Evidence = tuple[str, str, float, int]
Lines = tuple[dict[str, list[Pair]], dict[str, list[Pair]]]  # per side (0 rows, 1 columns): name -> cells
Reasons = tuple[dict[str, str], dict[str, str]]  # per side: name -> why it is not judged

SIDES: tuple[Side, Side] = ("prefill", "decode")
_SHORT = ("P", "D")
_SETTLED = 1e-9  # the polish stops once no median moves by more than this (in log units)
_MAD_TO_SD = 1.4826  # a normal's standard deviation over its median absolute deviation
_MIN_FREE = 20  # nonzero residuals needed to tell their spread (about a 5×6 fleet)


@dataclass(frozen=True, slots=True)
class Cell:
    """One pair's figure over the window: larger is worse and ratios mean something (a time, a rate)."""

    value: float
    count: int  # samples behind it


@dataclass(frozen=True)
class BlameConfig:
    """The factorization's thresholds."""

    min_samples: int = 5  # a cell with fewer samples is left out
    min_cells: int = 2  # usable cells a row or column needs to be judged
    threshold: float = 2.0  # the least ratio (row, column or residual) that is blamed
    noise_z: float = 4.0  # how many typical-cell spreads a pair's residual must also stand out by
    iterations: int = 10  # median polish rounds at most

    def __post_init__(self) -> None:
        checks = (
            ("min_samples", self.min_samples >= 1),
            ("min_cells", self.min_cells >= 1),
            ("threshold", math.isfinite(self.threshold) and self.threshold > 1.0),
            ("noise_z", math.isfinite(self.noise_z) and self.noise_z >= 0.0),
            ("iterations", self.iterations >= 1),
        )
        for name, ok in checks:
            if not ok:
                raise ValueError(f"BlameConfig.{name} is out of range: {getattr(self, name)!r}")


@dataclass(frozen=True)
class Effect:
    """One instance's fitted effect: its row (a P) or its column (a D)."""

    name: str
    ratio: float  # against its side's fast half: 1.0 typical, 3.0 three times its peers (1.0 with no cells)
    cells: int  # the usable cells the ratio stands on
    judged: bool  # False: left to per-instance evidence (see Factorization.unjudged)


@dataclass(frozen=True)
class Blame:
    """One blamed instance or pair, with the cells that show it."""

    side: Literal["prefill", "decode", "pair"]
    name: str  # the instance; for a pair "P|D" (the evidence holds the two names unambiguously)
    ratio: float
    evidence: tuple[Evidence, ...]  # (p, d, value, count) of the cells that show it, sorted
    message: str  # one plain sentence with the numbers, for a decision's reason text


@dataclass(frozen=True)
class Factorization:
    """A window's matrix as typical × P effect × D effect × residual, and whom it blames."""

    typical: float  # exp(overall): the typical cell value (0.0 when no cell was fitted)
    prefill: Mapping[str, Effect]
    decode: Mapping[str, Effect]
    residual: Mapping[Pair, float]  # per fitted cell, as a ratio
    spread: float  # a typical cell's noise, robust, in log units (0.0: too few cells to tell)
    blames: tuple[Blame, ...]  # the Ps, then the Ds, then the pairs, each by name
    unjudged: tuple[str, ...]  # "side name: why", for per-instance evidence to decide
    notes: tuple[str, ...]  # the rules that applied (cells left out, sparse lines), for the decision text
    # (side, name) -> why, the same as ``unjudged``: one lookup per instance (a scan of ``unjudged`` per
    # instance was quadratic in the fleet: 0.11 s of a 1,000-instance tick)
    why_unjudged: Mapping[tuple[str, str], str] = field(default_factory=dict)


@dataclass
class _Fit:
    """The polish's working state over the fitted cells, in log units."""

    logs: dict[Pair, float]
    cells: Mapping[Pair, Cell]  # as given, for the evidence
    lines: Lines
    resid: dict[Pair, float] = field(default_factory=dict)
    effects: tuple[dict[str, float], dict[str, float]] = field(default_factory=lambda: ({}, {}))
    overall: float = 0.0


def factor(
    cells: Mapping[Pair, Cell],
    prefills: Sequence[str],
    decodes: Sequence[str],
    cfg: BlameConfig | None = None,
) -> Factorization:
    """Split one window's ``(p, d) -> Cell`` matrix into effects and say whom it blames."""
    cfg = cfg or BlameConfig()
    fleet = (sorted(set(prefills)), sorted(set(decodes)))
    notes: list[str] = []
    usable = _usable(cells, fleet, cfg, notes)
    core, reasons = _core(usable, fleet, cfg, notes)
    fit = _Fit(logs=core, cells=cells, lines=_index(core))
    _polish(fit, cfg.iterations)
    _anchor(fit)
    spread, bars = _bars(fit, cfg)
    effects = (_effects(fit, usable, fleet, reasons, 0), _effects(fit, usable, fleet, reasons, 1))
    notes.extend(_fallback_notes(fit, effects, reasons, cfg))
    return Factorization(
        typical=math.exp(fit.overall) if core else 0.0,
        prefill=effects[0],
        decode=effects[1],
        residual={k: math.exp(v) for k, v in sorted(fit.resid.items())},
        spread=spread,
        blames=_line_blames(fit, reasons, cfg) + _pair_blames(fit, reasons, bars),
        unjudged=tuple(
            f"{SIDES[axis]} {name}: {why}" for axis in (0, 1) for name, why in sorted(reasons[axis].items())
        ),
        notes=tuple(notes),
        why_unjudged={(SIDES[axis], name): why for axis in (0, 1) for name, why in reasons[axis].items()},
    )


def _usable(
    cells: Mapping[Pair, Cell], fleet: tuple[list[str], list[str]], cfg: BlameConfig, notes: list[str]
) -> dict[Pair, float]:
    """The log values of the usable cells, sorted; the others are counted in ``notes``."""
    known = (set(fleet[0]), set(fleet[1]))
    logs: dict[Pair, float] = {}
    outside = bad = thin = 0
    for (p, d), cell in cells.items():
        if p not in known[0] or d not in known[1]:
            outside += 1
        elif not (math.isfinite(cell.value) and cell.value > 0.0):
            bad += 1
        elif cell.count < cfg.min_samples:
            thin += 1
        else:
            logs[(p, d)] = math.log(cell.value)
    for n, what in (
        (outside, "naming an instance outside the fleet"),
        (bad, "with no usable value (zero, negative or not finite)"),
        (thin, f"with fewer than {cfg.min_samples} samples"),
    ):
        if n:
            notes.append(f"{_plural(n, 'cell')} {what} left out")
    return dict(sorted(logs.items()))


def _core(
    usable: dict[Pair, float], fleet: tuple[list[str], list[str]], cfg: BlameConfig, notes: list[str]
) -> tuple[dict[Pair, float], Reasons]:
    """The cells that can be fitted, and why each instance outside them (or alone on its side) is not judged.

    Lines with too few cells are set aside with their cells, again and again (setting one aside can
    thin another), and of what is left only the largest linked group is kept."""
    reasons: Reasons = ({}, {})
    for axis in (0, 1):
        sampled = {pair[axis] for pair in usable}
        reasons[axis].update(
            (n, "no pair with enough samples in the window") for n in fleet[axis] if n not in sampled
        )
    core, unlinked = usable, 0
    while True:
        thinned = _thin(core, (len(fleet[0]), len(fleet[1])), cfg, reasons)
        linked = _linked(thinned)
        for axis, lines in enumerate(_index(thinned)):
            kept = {pair[axis] for pair in linked}
            reasons[axis].update(
                (n, "its sampled pairs are not linked to the rest of the fleet")
                for n in lines
                if n not in kept
            )
        unlinked += len(thinned) - len(linked)
        if len(linked) == len(core):
            break
        core = linked
    if unlinked:
        notes.append(
            f"{_plural(unlinked, 'cell')} not linked by sampled pairs to the largest group left out: "
            "effects compare only within a linked group"
        )
    for axis, lines in enumerate(_index(core)):
        if len(lines) == 1:
            (name,) = lines
            one = f"one {_SHORT[axis]}" if len(fleet[axis]) == 1 else f"the only {_SHORT[axis]} judged"
            reasons[axis][name] = f"{one}: its side cannot be told from the typical"
    return core, reasons


def _thin(
    core: dict[Pair, float], sizes: tuple[int, int], cfg: BlameConfig, reasons: Reasons
) -> dict[Pair, float]:
    """``core`` less the lines with fewer than ``min_cells`` cells (or than the fleet's other side has
    instances, ``sizes``). The fleet's, not the sampled lines': a 4P+2D fleet whose other D was cut
    sampled one D, and each P's row over that D alone (which took the cut D's load, so its handoffs
    rose through the window) read as the P's, and blamed a healthy P at ×2.04 on its one cell. With
    two Ds in the fleet, one cell cannot tell a P from its pair; with one D, it is all there is."""
    lines = _index(core)
    thin: tuple[set[str], set[str]] = (set(), set())
    for axis in (0, 1):
        need = min(cfg.min_cells, sizes[1 - axis])
        for name, pairs in lines[axis].items():
            if len(pairs) < need:
                reasons[axis][name] = (
                    f"{_plural(len(pairs), 'usable pair')}, {need} needed to tell it from its pairs"
                )
                thin[axis].add(name)
    return {k: v for k, v in core.items() if k[0] not in thin[0] and k[1] not in thin[1]}


def _linked(cells: dict[Pair, float]) -> dict[Pair, float]:
    """The cells of the largest group of rows and columns linked by sampled pairs (most cells, then by
    name)."""
    parent: dict[tuple[int, str], tuple[int, str]] = {}

    def root(node: tuple[int, str]) -> tuple[int, str]:
        while parent.setdefault(node, node) != node:
            parent[node] = parent[parent[node]]  # path halving keeps the walks short
            node = parent[node]
        return node

    for p, d in cells:
        a, b = root((0, p)), root((1, d))
        if a != b:
            parent[max(a, b)] = min(a, b)  # the smaller node leads, so the choice is deterministic
    groups: dict[tuple[int, str], list[Pair]] = {}
    for pair in cells:
        groups.setdefault(root((0, pair[0])), []).append(pair)
    if len(groups) <= 1:
        return cells
    keep = min(groups, key=lambda g: (-len(groups[g]), g))
    return {k: cells[k] for k in groups[keep]}


def _index(cells: Iterable[Pair]) -> Lines:
    rows: dict[str, list[Pair]] = {}
    cols: dict[str, list[Pair]] = {}
    for pair in cells:
        rows.setdefault(pair[0], []).append(pair)
        cols.setdefault(pair[1], []).append(pair)
    return rows, cols


def _polish(fit: _Fit, iterations: int) -> None:
    """Median polish: take row, then column, lower medians out of the residuals until settled."""
    fit.resid = dict(fit.logs)
    fit.effects = (dict.fromkeys(fit.lines[0], 0.0), dict.fromkeys(fit.lines[1], 0.0))
    for _ in range(iterations):
        moved = max(_sweep(fit, 0), _sweep(fit, 1))
        if moved < _SETTLED:
            break


def _sweep(fit: _Fit, axis: int) -> float:
    """Move each line's lower median from its residuals into its effect; the largest move."""
    moved = 0.0
    effects = fit.effects[axis]
    for name, pairs in fit.lines[axis].items():
        shift = median_low([fit.resid[k] for k in pairs])
        if shift != 0.0:
            effects[name] += shift
            for k in pairs:
                fit.resid[k] -= shift
            moved = max(moved, abs(shift))
    return moved


def _anchor(fit: _Fit) -> None:
    """Shift each side's effects so that their lower median is zero, into the overall: the fast side."""
    for effects in fit.effects:
        if effects:
            shift = median_low(effects.values())
            for name in effects:
                effects[name] -= shift
            fit.overall += shift


def _bars(fit: _Fit, cfg: BlameConfig) -> tuple[float, dict[Pair, float]]:
    """The typical cell's robust spread (log units) and the least residual each cell is blamed at.

    A cell's figure from n samples wanders about as 1/sqrt(n), so the spread is taken over
    |residual| × sqrt(count), 1.4826 × their lower median, and scaled to the typical count. The
    zeros the polish leaves (a median per line) say nothing of the noise and are left out; with
    fewer than ``_MIN_FREE`` others the estimate would follow the very outlier it is to judge, so
    the spread is 0.0 and the threshold alone decides. A cell with fewer samples than the typical
    must stand out further; one with more is held to the typical cell's bar, not a lower one
    (noise that does not shrink with samples, such as pairs that differ a little, stays).
    """
    least = math.log(cfg.threshold)
    free = [(abs(r), fit.cells[k].count) for k, r in fit.resid.items() if abs(r) > _SETTLED]
    if len(free) < _MIN_FREE:
        return 0.0, dict.fromkeys(fit.resid, least)
    typical_count = median_low(fit.cells[k].count for k in fit.resid)
    spread = _MAD_TO_SD * median_low(r * math.sqrt(n) for r, n in free) / math.sqrt(typical_count)
    return spread, {
        k: max(least, cfg.noise_z * spread * math.sqrt(max(1.0, typical_count / fit.cells[k].count)))
        for k in fit.resid
    }


def _effects(
    fit: _Fit, usable: Mapping[Pair, float], fleet: tuple[list[str], list[str]], reasons: Reasons, axis: int
) -> dict[str, Effect]:
    """Each instance's effect: fitted, or for one outside the fit its cells against what the fit expects."""
    fitted, other = fit.effects[axis], fit.effects[1 - axis]
    usable_lines = _index(usable)[axis]
    out: dict[str, Effect] = {}
    for name in fleet[axis]:
        pairs = fit.lines[axis].get(name) or usable_lines.get(name, [])
        if name in fitted:
            effect = fitted[name]
        elif pairs and fit.logs:
            effect = median_low(usable[k] - fit.overall - other.get(k[1 - axis], 0.0) for k in pairs)
        else:
            effect = 0.0
        out[name] = Effect(name, math.exp(effect), len(pairs), name not in reasons[axis])
    return out


def _line_blames(fit: _Fit, reasons: Reasons, cfg: BlameConfig) -> tuple[Blame, ...]:
    """A judged P (row) or D (column) whose ratio is at or past the threshold."""
    out: list[Blame] = []
    for axis in (0, 1):
        for name, effect in sorted(fit.effects[axis].items()):
            if name in reasons[axis] or effect < math.log(cfg.threshold):
                continue
            pairs = fit.lines[axis][name]
            values = [fit.cells[k].value for k in pairs]
            message = (
                f"{SIDES[axis]} {name} is {math.exp(effect):.1f}× its peers over "
                f"{_plural(len(pairs), 'sampled pair')} (their median {median_low(values):.3g} "
                f"against a typical pair's {math.exp(fit.overall):.3g})"
            )
            out.append(Blame(SIDES[axis], name, math.exp(effect), _evidence(fit, pairs), message))
    return tuple(out)


def _pair_blames(fit: _Fit, reasons: Reasons, bars: Mapping[Pair, float]) -> tuple[Blame, ...]:
    """A pair whose residual (once its P and D are out) is at or past its bar, where it can be placed:
    its P and D both judged, each on two cells or more (with one, the line takes the cell whole)."""
    out: list[Blame] = []
    for (p, d), resid in fit.resid.items():
        placed = all(
            name not in reasons[axis] and len(fit.lines[axis][name]) >= 2 for axis, name in ((0, p), (1, d))
        )
        if placed and resid >= bars[(p, d)]:
            row, col = fit.effects[0][p], fit.effects[1][d]
            message = (
                f"pair {p}|{d} is {math.exp(resid):.1f}× what prefill {p} (×{math.exp(row):.2f}) and decode "
                f"{d} (×{math.exp(col):.2f}) predict: {fit.cells[(p, d)].value:.3g} against "
                f"{math.exp(fit.overall + row + col):.3g}"
            )
            out.append(Blame("pair", f"{p}|{d}", math.exp(resid), _evidence(fit, [(p, d)]), message))
    return tuple(out)


def _evidence(fit: _Fit, pairs: Iterable[Pair]) -> tuple[Evidence, ...]:
    return tuple(sorted((p, d, fit.cells[(p, d)].value, fit.cells[(p, d)].count) for p, d in pairs))


def _fallback_notes(
    fit: _Fit, effects: tuple[dict[str, Effect], dict[str, Effect]], reasons: Reasons, cfg: BlameConfig
) -> list[str]:
    """Per side, the instances per-instance evidence decides for and why; and, for any of them that reads
    slow on its few cells, that the matrix cannot say whether it, its peers or the pair is at fault."""
    notes: list[str] = []
    for axis in (0, 1):
        if reasons[axis]:
            listed = "; ".join(f"{name} ({why})" for name, why in sorted(reasons[axis].items()))
            notes.append(f"per-instance evidence decides for these {SIDES[axis]}s: {listed}")
        for name in sorted(reasons[axis]):
            e = effects[axis][name]
            if name not in fit.effects[axis] and e.cells and e.ratio >= cfg.threshold:
                notes.append(
                    f"{SIDES[axis]} {name} reads {e.ratio:.1f}× on {_plural(e.cells, 'usable pair')}, "
                    "which the matrix cannot place on it, its peers or the pair: nothing blamed"
                )
    return notes


def _plural(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


# -- failures: counts, not times ---------------------------------------------------------------------

ROW_MIN_PER_D = 2  # a D counts in a P's row with this many of the P's failures or more


def _rate(failed: int, served: int) -> float:
    return failed / (failed + served) if failed + served > 0 else 0.0


def _per_d(counts: Mapping[Pair, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for (_, d), n in counts.items():
        out[d] = out.get(d, 0) + max(n, 0)
    return out


def _failing_toward(
    p: str,
    ds: Iterable[str],
    failures: Mapping[Pair, int],
    handoffs: Mapping[Pair, int],
    totals: tuple[Mapping[str, int], Mapping[str, int]],
    ratio: float,
) -> list[str]:
    """The Ds among ``ds`` that ``p``'s handoffs fail toward: :data:`ROW_MIN_PER_D` failures or more,
    at ``ratio`` times the other Ps' pooled rate toward that D or more (failing from every P is the
    D's trouble, not any P's). ``totals``: every P's failures and handoffs per D (:func:`_per_d`)."""
    out = []
    for d in sorted(ds):
        f, h = failures.get((p, d), 0), handoffs.get((p, d), 0)
        if f < ROW_MIN_PER_D:
            continue
        others = _rate(totals[0].get(d, 0) - f, totals[1].get(d, 0) - max(h, 0))
        if _rate(f, h) >= ratio * others:
            out.append(d)
    return out


def failing_rows(
    failures: Mapping[Pair, int], handoffs: Mapping[Pair, int], min_events: int, ratio: float = 2.0
) -> dict[str, str]:
    """The Ps failing toward every D: P -> why. A failed handoff is counted by the D that pulled it,
    so a P whose transfers fail toward every D reads as every D failing. A P's failures are its row's
    when there are at least ``min_events`` of them, it fails toward more than half of the Ds it handed
    off to and two at least (:func:`_failing_toward`: one D is one link's trouble), and its failure
    rate (failures over its handoffs and failures) is at least ``ratio`` times the other Ps' pooled
    rate. A rule on shares (no D with 70 % of them) read a 7-to-3 split over two Ds as one link's, and
    one on binomial shares failed when the proxies had left one D after its failures: counts of where
    the failures fell, not how evenly. Failures are counts, often zero, so this is a rate comparison
    rather than :func:`factor`'s polish on logs; the anchoring is the same: the rest of the fleet is
    the healthy reference."""
    served: dict[str, int] = {}
    reached: dict[str, set[str]] = {}
    for (p, d), n in handoffs.items():
        served[p] = served.get(p, 0) + max(n, 0)
        reached.setdefault(p, set()).add(d)
    per_p: dict[str, int] = {}
    for (p, d), n in failures.items():
        if n > 0:
            per_p[p] = per_p.get(p, 0) + n
            reached.setdefault(p, set()).add(d)
    total_f, total_h = sum(per_p.values()), sum(served.values())
    totals = (_per_d({k: n for k, n in failures.items() if n > 0}), _per_d(handoffs))
    rows: dict[str, str] = {}
    for p, f in sorted(per_p.items()):
        toward = _failing_toward(p, reached[p], failures, handoffs, totals, ratio)
        if f < min_events or len(toward) < 2 or 2 * len(toward) <= len(reached[p]):
            continue
        own = _rate(f, served.get(p, 0))
        others = _rate(total_f - f, total_h - served.get(p, 0))
        if own >= ratio * others:
            rows[p] = (
                f"{p}'s handoffs fail toward {len(toward)} of its {len(reached[p])} Ds: {f} failed of "
                f"{f + served.get(p, 0)} ({own:.0%}, the other Ps' {others:.0%})"
            )
    return rows
