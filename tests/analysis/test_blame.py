"""The P×D blame factorization on hand-built matrices, and its noise floor on random healthy fleets."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Mapping

import pytest

from analysis import blame
from analysis.blame import BlameConfig, Cell, Factorization, Pair, factor, failing_rows

BASE = 0.3  # a healthy pair's handoff, seconds

Fleet = tuple[dict[Pair, Cell], list[str], list[str]]


def fleet(
    n_p: int,
    n_d: int,
    *,
    rows: Mapping[int, float] | None = None,
    cols: Mapping[int, float] | None = None,
    cells: Mapping[tuple[int, int], float] | None = None,
    count: int = 20,
) -> Fleet:
    """A clean n_p × n_d matrix at BASE, times the given row, column and cell factors."""
    prefills = [f"p{i}" for i in range(n_p)]
    decodes = [f"d{j}" for j in range(n_d)]
    rows, cols, cells = rows or {}, cols or {}, cells or {}
    matrix = {
        (p, d): Cell(BASE * rows.get(i, 1.0) * cols.get(j, 1.0) * cells.get((i, j), 1.0), count)
        for i, p in enumerate(prefills)
        for j, d in enumerate(decodes)
    }
    return matrix, prefills, decodes


def blamed(f: Factorization) -> set[tuple[str, str]]:
    return {(b.side, b.name) for b in f.blames}


def the(f: Factorization, name: str) -> blame.Blame:
    (found,) = [b for b in f.blames if b.name == name]
    return found


SHAPES = [(2, 4), (3, 3), (4, 2)]


# -- the table: who is slow ----------------------------------------------------------------------


@pytest.mark.parametrize(("n_p", "n_d"), SHAPES)
@pytest.mark.parametrize("factor_", [2.5, 4.0])
def test_a_slow_row_blames_its_prefill_alone(n_p: int, n_d: int, factor_: float) -> None:
    slow = n_p - 1
    matrix, prefills, decodes = fleet(n_p, n_d, rows={slow: factor_})
    f = factor(matrix, prefills, decodes)
    assert blamed(f) == {("prefill", f"p{slow}")}
    b = the(f, f"p{slow}")
    assert b.ratio == pytest.approx(factor_, rel=0.1)
    assert [(p, d) for p, d, _, _ in b.evidence] == [(f"p{slow}", d) for d in decodes]
    assert all(v == pytest.approx(BASE * factor_) and n == 20 for _, _, v, n in b.evidence)
    assert f"{factor_:.1f}×" in b.message
    assert f.typical == pytest.approx(BASE)
    assert all(e.ratio == pytest.approx(1.0) for e in f.decode.values())


@pytest.mark.parametrize(("n_p", "n_d"), SHAPES)
def test_a_slow_column_blames_its_decode_alone(n_p: int, n_d: int) -> None:
    matrix, prefills, decodes = fleet(n_p, n_d, cols={0: 3.0})
    f = factor(matrix, prefills, decodes)
    assert blamed(f) == {("decode", "d0")}
    b = the(f, "d0")
    assert b.side == "decode"
    assert b.ratio == pytest.approx(3.0, rel=0.1)
    assert [(p, d) for p, d, _, _ in b.evidence] == [(p, "d0") for p in prefills]
    assert all(e.ratio == pytest.approx(1.0) for e in f.prefill.values())


@pytest.mark.parametrize(("n_p", "n_d"), [*SHAPES, (3, 6)])
def test_one_slow_cell_blames_the_pair_not_its_prefill_or_decode(n_p: int, n_d: int) -> None:
    matrix, prefills, decodes = fleet(n_p, n_d, cells={(1, 1): 5.0})
    f = factor(matrix, prefills, decodes)
    assert blamed(f) == {("pair", "p1|d1")}
    b = the(f, "p1|d1")
    assert b.ratio == pytest.approx(5.0, rel=0.1)
    ((p, d, value, count),) = b.evidence
    assert (p, d, count) == ("p1", "d1", 20)
    assert value == pytest.approx(BASE * 5.0)
    assert f.prefill["p1"].ratio == pytest.approx(1.0)
    assert f.decode["d1"].ratio == pytest.approx(1.0)
    assert f.residual[("p1", "d1")] == pytest.approx(5.0)


def test_two_prefills_are_anchored_on_the_fast_one() -> None:
    # A plain median polish reads these rows as 0.5× and 2× (each log 2 off the middle) and can
    # name neither; anchored on the lower median, the slow one is 4× and the fast one 1×.
    matrix, prefills, decodes = fleet(2, 4, rows={1: 4.0})
    f = factor(matrix, prefills, decodes)
    assert f.prefill["p0"].ratio == pytest.approx(1.0)
    assert f.prefill["p1"].ratio == pytest.approx(4.0)
    assert f.typical == pytest.approx(BASE)
    assert blamed(f) == {("prefill", "p1")}
    # the same for two decodes
    matrix, prefills, decodes = fleet(4, 2, cols={0: 4.0})
    f = factor(matrix, prefills, decodes)
    assert f.decode["d0"].ratio == pytest.approx(4.0)
    assert f.decode["d1"].ratio == pytest.approx(1.0)
    assert blamed(f) == {("decode", "d0")}


@pytest.mark.parametrize(("n_p", "n_d"), [(2, 4), (3, 4), (4, 3)])
def test_a_slow_row_and_a_slow_cell_in_another_row(n_p: int, n_d: int) -> None:
    matrix, prefills, decodes = fleet(n_p, n_d, rows={0: 3.0}, cells={(1, 2): 5.0})
    f = factor(matrix, prefills, decodes)
    assert blamed(f) == {("prefill", "p0"), ("pair", "p1|d2")}
    assert the(f, "p0").ratio == pytest.approx(3.0)
    assert the(f, "p1|d2").ratio == pytest.approx(5.0)


@pytest.mark.parametrize(("n_p", "n_d"), [(2, 4), (3, 4), (4, 3)])
def test_a_slow_row_with_a_slower_cell_in_it_blames_both(n_p: int, n_d: int) -> None:
    matrix, prefills, decodes = fleet(n_p, n_d, rows={0: 3.0}, cells={(0, 2): 5.0})
    f = factor(matrix, prefills, decodes)
    # the row's other cells are slow only because the row is: the P's, not pairs'
    assert blamed(f) == {("prefill", "p0"), ("pair", "p0|d2")}
    assert the(f, "p0").ratio == pytest.approx(3.0)
    pair = the(f, "p0|d2")
    assert pair.ratio == pytest.approx(5.0)
    ((p, d, value, count),) = pair.evidence
    assert (p, d, count) == ("p0", "d2", 20)
    assert value == pytest.approx(BASE * 15)
    assert "×3.00" in pair.message  # the P's effect the pair is measured over


def test_a_slow_row_and_a_slow_column_blame_both_and_not_where_they_cross() -> None:
    matrix, prefills, decodes = fleet(3, 4, rows={2: 3.0}, cols={1: 3.0})
    f = factor(matrix, prefills, decodes)
    assert blamed(f) == {("prefill", "p2"), ("decode", "d1")}
    assert f.residual[("p2", "d1")] == pytest.approx(1.0)


def test_a_healthy_matrix_blames_nothing_and_reads_its_typical() -> None:
    matrix, prefills, decodes = fleet(3, 5)
    f = factor(matrix, prefills, decodes)
    assert f.blames == ()
    assert f.unjudged == ()
    assert f.typical == pytest.approx(BASE)
    assert all(r == pytest.approx(1.0) for r in f.residual.values())


def test_below_the_threshold_is_not_blamed() -> None:
    matrix, prefills, decodes = fleet(3, 4, rows={0: 1.9}, cells={(1, 1): 1.9})
    assert factor(matrix, prefills, decodes).blames == ()
    assert blamed(factor(matrix, prefills, decodes, BlameConfig(threshold=1.8))) == {
        ("prefill", "p0"),
        ("pair", "p1|d1"),
    }


def test_blames_come_in_a_fixed_order_whatever_the_input_order() -> None:
    matrix, prefills, decodes = fleet(4, 5, rows={3: 3.0}, cols={1: 3.0}, cells={(0, 4): 6.0, (1, 2): 6.0})
    f = factor(matrix, prefills, decodes)
    assert [(b.side, b.name) for b in f.blames] == [
        ("prefill", "p3"),
        ("decode", "d1"),
        ("pair", "p0|d4"),
        ("pair", "p1|d2"),
    ]
    shuffled = dict(reversed(list(matrix.items())))
    assert factor(shuffled, prefills[::-1], decodes[::-1]) == f


# -- sparse matrices: the stated rules --------------------------------------------------------------


def test_a_row_with_one_usable_cell_is_left_to_per_instance_evidence() -> None:
    matrix, prefills, decodes = fleet(3, 3, cells={(2, 0): 5.0})
    for j in (1, 2):
        del matrix[("p2", f"d{j}")]
    f = factor(matrix, prefills, decodes)
    assert f.blames == ()  # neither p2, nor d0, nor the pair: the slowness cannot be placed
    p2 = f.prefill["p2"]
    assert (p2.name, p2.cells, p2.judged) == ("p2", 1, False)
    assert p2.ratio == pytest.approx(5.0)  # reported, not blamed
    assert f.unjudged == ("prefill p2: 1 usable pair, 2 needed to tell it from its pairs",)
    assert any("per-instance evidence decides" in n and "p2" in n for n in f.notes)
    assert any(n.startswith("prefill p2 reads 5.0× on 1 usable pair") for n in f.notes)
    assert ("p2", "d0") not in f.residual  # set aside, so it does not pull d0's median either
    assert f.decode["d0"].judged and f.decode["d0"].ratio == pytest.approx(1.0)


def test_a_sparse_healthy_row_is_unjudged_but_not_called_slow() -> None:
    matrix, prefills, decodes = fleet(3, 3)
    matrix[("p2", "d1")] = Cell(BASE, 2)  # under-sampled: only d0's cell is usable
    del matrix[("p2", "d2")]
    f = factor(matrix, prefills, decodes)
    assert f.blames == ()
    assert not f.prefill["p2"].judged
    assert not any("reads" in n for n in f.notes)


def test_one_prefill_judges_the_decodes_against_each_other() -> None:
    matrix, prefills, decodes = fleet(1, 5, cols={3: 4.0})
    f = factor(matrix, prefills, decodes)
    assert blamed(f) == {("decode", "d3")}
    assert the(f, "d3").ratio == pytest.approx(4.0)
    assert f.unjudged == ("prefill p0: one P: its side cannot be told from the typical",)
    assert not f.prefill["p0"].judged
    assert all(e.judged for e in f.decode.values())


def test_one_prefill_with_every_pair_slow_blames_nothing() -> None:
    matrix, prefills, decodes = fleet(1, 4, rows={0: 5.0})
    f = factor(matrix, prefills, decodes)
    assert f.blames == ()  # all slow alike is the typical: nothing here to tell the P by
    assert f.typical == pytest.approx(BASE * 5.0)
    assert f.unjudged == ("prefill p0: one P: its side cannot be told from the typical",)


def test_one_decode_is_the_mirror_image() -> None:
    matrix, prefills, decodes = fleet(4, 1, rows={1: 3.0})
    f = factor(matrix, prefills, decodes)
    assert blamed(f) == {("prefill", "p1")}
    assert f.unjudged == ("decode d0: one D: its side cannot be told from the typical",)


def test_a_one_by_one_fleet_judges_nothing() -> None:
    matrix, prefills, decodes = fleet(1, 1, rows={0: 10.0})
    f = factor(matrix, prefills, decodes)
    assert f.blames == ()
    assert not f.prefill["p0"].judged and not f.decode["d0"].judged
    assert len(f.unjudged) == 2


@pytest.mark.parametrize("axis", [0, 1])
def test_the_only_sampled_line_of_a_wider_fleet_judges_nothing_on_one_cell(axis: int) -> None:
    # a 4P+2D fleet whose d1 was cut: only d0's column has samples, and it took d1's load, so the Ps'
    # cells toward it spread with when each P's handoffs fell; one cell cannot tell a P from its pair
    # (the mirror: the only sampled P of a wider fleet and the Ds' cells through it)
    matrix, prefills, decodes = fleet(4, 1, rows={1: 2.5}) if axis == 0 else fleet(1, 4, cols={1: 2.5})
    wider = (prefills, [*decodes, "d9"]) if axis == 0 else ([*prefills, "p9"], decodes)
    f = factor(matrix, *wider)
    assert f.blames == ()
    one = "p1" if axis == 0 else "d1"
    assert f"{blame.SIDES[axis]} {one}: 1 usable pair, 2 needed to tell it from its pairs" in f.unjudged
    assert (
        f"{blame.SIDES[1 - axis]} {'d9' if axis == 0 else 'p9'}: no pair with enough samples in the window"
        in (f.unjudged)
    )
    # the fleet of one D (or one P) has nothing else: its one cell per line is judged, as before
    assert blamed(factor(matrix, prefills, decodes)) == {(blame.SIDES[axis], one)}


def test_groups_not_linked_by_sampled_pairs_are_not_compared() -> None:
    # p0, p1 only ever paired with d0, d1; p2..p4 with d2, d3: two groups whose effects share no scale
    matrix, prefills, decodes = fleet(5, 4, cells={(3, 3): 5.0})
    for p, d in list(matrix):
        if (p in {"p0", "p1"}) != (d in {"d0", "d1"}):
            del matrix[(p, d)]
    f = factor(matrix, prefills, decodes)
    assert blamed(f) == {("pair", "p3|d3")}
    assert {u.split(":")[0] for u in f.unjudged} == {"prefill p0", "prefill p1", "decode d0", "decode d1"}
    assert any("4 cells not linked" in n for n in f.notes)


def test_a_large_sparse_fleet_fits_what_is_there() -> None:
    rng = random.Random(20)
    prefills = [f"p{i:02d}" for i in range(50)]
    decodes = [f"d{j:02d}" for j in range(50)]
    matrix = {
        (p, d): Cell(BASE * math.exp(rng.gauss(0.0, 0.05)), rng.randint(10, 50))
        for p in prefills
        for d in decodes
        if rng.random() < 0.1
    }
    slow_p = max(prefills, key=lambda p: sum(k[0] == p for k in matrix))
    slow_d = max(decodes, key=lambda d: sum(k[1] == d and k[0] != slow_p for k in matrix))
    for k, c in matrix.items():
        matrix[k] = Cell(
            c.value * (3.0 if k[0] == slow_p else 1.0) * (3.0 if k[1] == slow_d else 1.0), c.count
        )
    f = factor(matrix, prefills, decodes)
    assert blamed(f) == {("prefill", slow_p), ("decode", slow_d)}
    thin = {p for p in prefills if sum(k[0] == p for k in matrix) < 2}
    assert thin  # the draw has rows too sparse to judge, and they are said to be
    assert thin <= {u.split(":")[0].removeprefix("prefill ") for u in f.unjudged}
    assert all(not f.prefill[p].judged for p in thin)


def test_the_polish_costs_iterations_times_cells(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = [0]
    real = statistics.median_low

    def counting(values: Iterable[float]) -> float:
        listed = list(values)
        seen[0] += len(listed)
        return real(listed)

    monkeypatch.setattr(blame, "median_low", counting)
    rng = random.Random(3)
    matrix = {
        (f"p{i}", f"d{j}"): Cell(BASE * rng.lognormvariate(0.0, 0.25), 20)
        for i in range(200)
        for j in range(200)
        if rng.random() < 0.05
    }
    cfg = BlameConfig()
    factor(matrix, [f"p{i}" for i in range(200)], [f"d{j}" for j in range(200)], cfg)
    # each round reads every cell twice (its row, its column); then the anchor, the spread, a few lines
    assert seen[0] <= (2 * cfg.iterations + 4) * len(matrix) + 2 * 200


# -- what is left out ---------------------------------------------------------------------------


def test_an_under_sampled_slow_cell_blames_nothing() -> None:
    matrix, prefills, decodes = fleet(3, 3, cells={(1, 1): 5.0})
    matrix[("p1", "d1")] = Cell(matrix[("p1", "d1")].value, 4)  # one short of min_samples
    f = factor(matrix, prefills, decodes)
    assert f.blames == ()
    assert ("p1", "d1") not in f.residual
    assert "1 cell with fewer than 5 samples left out" in f.notes
    assert blamed(factor(matrix, prefills, decodes, BlameConfig(min_samples=4))) == {("pair", "p1|d1")}


def test_an_under_sampled_slow_row_blames_nothing() -> None:
    matrix, prefills, decodes = fleet(3, 4, rows={0: 4.0})
    for k in matrix:
        if k[0] == "p0":
            matrix[k] = Cell(matrix[k].value, 1)
    f = factor(matrix, prefills, decodes)
    assert f.blames == ()
    assert "prefill p0: no pair with enough samples in the window" in f.unjudged


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 0.0, -0.3])
def test_a_cell_with_no_usable_value_is_skipped(bad: float) -> None:
    matrix, prefills, decodes = fleet(3, 4, cells={(2, 3): 5.0})
    matrix[("p0", "d1")] = Cell(bad, 30)
    f = factor(matrix, prefills, decodes)
    assert blamed(f) == {("pair", "p2|d3")}
    assert ("p0", "d1") not in f.residual
    assert "1 cell with no usable value (zero, negative or not finite) left out" in f.notes


def test_no_usable_cell_at_all_judges_nothing() -> None:
    matrix = {("p0", "d0"): Cell(math.nan, 30), ("p1", "d1"): Cell(0.3, 0)}
    f = factor(matrix, ["p0", "p1"], ["d0", "d1"])
    assert (f.blames, f.typical, f.residual) == ((), 0.0, {})
    assert len(f.unjudged) == 4
    assert factor({}, [], []).blames == ()


def test_a_cell_naming_an_instance_outside_the_fleet_is_left_out() -> None:
    matrix, prefills, decodes = fleet(2, 3)
    matrix[("p-gone", "d0")] = Cell(9.0, 40)
    f = factor(matrix, prefills, decodes)
    assert f.blames == ()
    assert "1 cell naming an instance outside the fleet left out" in f.notes


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("min_samples", 0),
        ("min_cells", 0),
        ("threshold", 1.0),
        ("threshold", 0.5),
        ("threshold", math.nan),
        ("threshold", math.inf),
        ("noise_z", -1.0),
        ("noise_z", math.nan),
        ("iterations", 0),
    ],
)
def test_a_bad_config_value_is_refused_by_name(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"BlameConfig\.{field}\b"):
        BlameConfig(**{field: value})  # type: ignore[arg-type]


# -- noise: healthy fleets are not blamed, real faults are --------------------------------------------

NOISY_SHAPES = [(2, 4), (4, 2), (3, 3), (3, 6), (8, 16)]


def noisy(rng: random.Random, n_p: int, n_d: int, sigma: float) -> Fleet:
    """A healthy fleet: each cell the median of its 10-50 requests, each BASE × lognormal(0, sigma)."""
    matrix, prefills, decodes = fleet(n_p, n_d)
    for k in matrix:
        n = rng.randint(10, 50)
        samples = sorted(BASE * rng.lognormvariate(0.0, sigma) for _ in range(n))
        matrix[k] = Cell(samples[n // 2], n)
    return matrix, prefills, decodes


def scaled(matrix: dict[Pair, Cell], which: Iterable[Pair], by: float) -> None:
    for k in which:
        matrix[k] = Cell(matrix[k].value * by, matrix[k].count)


def test_healthy_noisy_fleets_blame_nothing() -> None:
    # Requests spread by 0.4 (log): a cell's median of 10-50 of them wanders by 0.07-0.16. Found
    # sound on 2 × 1000 fleets of these shapes; at 0.5 about one in 1000 blames a healthy pair, at
    # cell noise 0.25 whatever the samples the 2-row and 2-column shapes cannot hold 2× (see below).
    rng = random.Random(1)
    for trial in range(200):
        matrix, prefills, decodes = noisy(rng, *NOISY_SHAPES[trial % len(NOISY_SHAPES)], sigma=0.4)
        f = factor(matrix, prefills, decodes)
        assert f.blames == (), (trial, [b.message for b in f.blames])


@pytest.mark.parametrize("kind", ["row", "column", "cell"])
def test_a_fault_in_a_noisy_fleet_is_blamed_on_the_right_instance(kind: str) -> None:
    rng = random.Random({"row": 2, "column": 3, "cell": 4}[kind])
    for trial in range(100):
        matrix, prefills, decodes = noisy(rng, *NOISY_SHAPES[trial % len(NOISY_SHAPES)], sigma=0.4)
        p, d = rng.choice(prefills), rng.choice(decodes)
        if kind == "row":
            scaled(matrix, [k for k in matrix if k[0] == p], 3.0)
            want = {("prefill", p)}
        elif kind == "column":
            scaled(matrix, [k for k in matrix if k[1] == d], 3.0)
            want = {("decode", d)}
        else:
            scaled(matrix, [(p, d)], 5.0)
            want = {("pair", f"{p}|{d}")}
        f = factor(matrix, prefills, decodes)
        assert blamed(f) == want, (trial, [b.message for b in f.blames])
        injected = 5.0 if kind == "cell" else 3.0
        assert abs(math.log(f.blames[0].ratio / injected)) < 0.6, (trial, f.blames[0].message)


@pytest.mark.parametrize(("n_p", "n_d"), [(8, 16), (16, 16)])
def test_the_noise_bar_holds_the_threshold_on_a_large_noisy_fleet(n_p: int, n_d: int) -> None:
    # Cells that wander by 0.25 whatever their samples (the harshest reading of noise): among
    # thousands of cells, hundreds of healthy ones sit past 2× by chance, and the threshold alone
    # blames about one in a hundred. The residuals' spread cuts that to about one in two thousand.
    rng = random.Random(5)
    guarded = unguarded = cells = 0
    for _ in range(50):
        matrix, prefills, decodes = fleet(n_p, n_d)
        for k in matrix:
            matrix[k] = Cell(BASE * rng.lognormvariate(0.0, 0.25), rng.randint(10, 50))
        f = factor(matrix, prefills, decodes)
        assert 0.15 < f.spread < 0.35
        guarded += len(f.blames)
        unguarded += len(factor(matrix, prefills, decodes, BlameConfig(noise_z=0.0)).blames)
        cells += len(matrix)
    assert guarded <= cells / 1000
    assert unguarded >= 5 * max(guarded, 1)


# -- failing_rows: a P whose handoffs fail toward every D ---------------------------------------------

DS4 = ("d0", "d1", "d2", "d3")


def _served(n: int = 20) -> dict[tuple[str, str], int]:
    return {(p, d): n for p in ("p0", "p1") for d in DS4}


def test_a_p_failing_toward_every_d_is_a_row() -> None:
    rows = failing_rows({("p1", d): 3 for d in DS4}, _served(), min_events=3)
    assert list(rows) == ["p1"]
    assert "toward 4 of its 4 Ds: 12 failed of 92 (13%, the other Ps' 0%)" in rows["p1"]


@pytest.mark.parametrize(
    ("failures", "why"),
    [
        ({("p1", "d0"): 10, ("p1", "d1"): 1}, "one D holds them: the pair's"),
        ({(p, "d3"): 5 for p in ("p0", "p1")}, "one D from every P: the D's column"),
        ({(p, d): 2 for p in ("p0", "p1") for d in DS4}, "every pair alike: no P stands out"),
        ({("p1", "d0"): 1, ("p1", "d1"): 1}, "under min_events"),
        ({("p1", "d3"): 10, ("p1", "d1"): 2}, "one D holds far more than its share, a stray beside it"),
    ],
)
def test_what_is_not_a_failing_row(failures: dict[tuple[str, str], int], why: str) -> None:
    assert failing_rows(failures, _served(), min_events=3) == {}, why


def test_a_row_is_judged_by_rate_against_the_other_ps() -> None:
    """Both Ps fail toward every D, one at twice the other's rate or more: that one is the row."""
    failures = {**{("p0", d): 1 for d in DS4}, **{("p1", d): 4 for d in DS4}}
    assert list(failing_rows(failures, _served(), min_events=3)) == ["p1"]


def test_a_row_over_two_ds_split_as_a_coin_falls_is_still_a_row() -> None:
    """Seen on the bench (4P+2D, 30 % of one P's transfers failing): 3 and 7 failures at the two Ds,
    with 4 and 2 handoffs that came through. The rule it replaces (no D with 70 %) called it one link's
    trouble and left both Ds charged."""
    handoffs = {
        ("p3", "d0"): 4,
        ("p3", "d1"): 2,
        **{(f"p{i}", d): 30 for i in range(3) for d in ("d0", "d1")},
    }
    assert list(failing_rows({("p3", "d0"): 3, ("p3", "d1"): 7}, handoffs, min_events=3)) == ["p3"]
    # the same P failing toward one of the two Ds alone: its pair's
    one_link = {
        ("p3", "d0"): 12,
        ("p3", "d1"): 0,
        **{(f"p{i}", d): 30 for i in range(3) for d in ("d0", "d1")},
    }
    assert failing_rows({("p3", "d1"): 10, ("p3", "d0"): 1}, one_link, min_events=3) == {}


def test_a_row_whose_failures_the_proxies_steered_unevenly_is_still_a_row() -> None:
    """Seen on the bench (2P+4D): the proxies had left decode-0 after its first failures, so 12 of the
    P's 14 handoffs to it had failed against 5 of 17 to decode-1: unevenly spread, but toward every D,
    and the other P's handoffs to each D came through."""
    failures = {("p1", "d0"): 12, ("p1", "d1"): 5, ("p1", "d2"): 10, ("p1", "d3"): 7}
    handoffs = {("p1", "d0"): 2, ("p1", "d1"): 12, ("p1", "d2"): 6, ("p1", "d3"): 15}
    handoffs |= {("p0", d): 12 for d in DS4}
    assert list(failing_rows(failures, handoffs, min_events=3)) == ["p1"]
    # two of four Ds is not more than half: one link's trouble and a stray
    assert failing_rows({("p1", "d3"): 10, ("p1", "d1"): 2}, _served(), min_events=3) == {}
