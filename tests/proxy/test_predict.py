"""The TTFT predictor (``proxy.predict``) and admission by prediction through the gate and the flow."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdscope import semconv as sc
from pdscope.config import PredictSettings
from pdscope.routing import InstanceRate, PairRate, Rates
from proxy.predict import B_MIN, MIN_RATIOS, HandoffX, Line, PEstimate, Predictor, late_decodes, outlook
from tests.proxy.conftest import fake_fleet, make_settings, running_proxy
from tests.proxy.memory import COMPLETION, MemoryProxy, MemVLLM, memory_flow, memory_settings

PS = PredictSettings(min_samples=5)


def NOW() -> float:
    return 0.0


def test_the_online_line_finds_a_prefill_rate_and_base_from_noisy_completions() -> None:
    rng = random.Random(7)
    line = Line(0.02, 1 / 16.0, 0.98)  # a prior 4x too fast: 16 k tokens/s where P does 4 k
    for _ in range(300):
        x = rng.uniform(200, 20_000)
        line.update(x, (0.05 + x / 4000.0) * rng.uniform(0.95, 1.05))
    assert line(10_000) == pytest.approx(0.05 + 10_000 / 4000.0, rel=0.05)
    assert line(500) == pytest.approx(0.05 + 500 / 4000.0, rel=0.15)


def test_one_stall_moves_the_line_only_so_far_and_a_real_slowdown_is_followed() -> None:
    line = Line(0.0, 1.0, 0.9)
    for _ in range(50):
        line.update(1000, 1.0)
    line.update(1000, 1000.0)  # one stall
    assert line(1000) < 5.0
    for _ in range(60):  # P really became 3x slower
        line.update(1000, 3.0)
    assert line(1000) == pytest.approx(3.0, rel=0.05)


def _fitted(clock: list[float]) -> Line:
    """A line fitted on P's staircase: steps of 0.5 s each finishing six requests (6,000 tokens), all
    answered at the step's end with the step's time whatever their backlog."""
    line = Line(0.05, 1 / 13.0, 0.98)
    for _ in range(30):
        clock[0] += 0.5
        for i in range(6):
            line.update(1000 * (i + 1), 0.5, clock[0])
    return line


def test_answers_of_one_step_count_once_in_the_run_that_reopens_a_line() -> None:
    """One slow step (P stalled a moment) finishes six requests late: six errors of one side at one
    instant, one event, not a run of six. On a simulated fleet beside a bursty flood such clumps reopened
    P's line every few steps; it settled at a 1 s base and a flat slope, and its P was refused every
    request for 10 s."""
    t = [0.0]
    line = _fitted(t)
    assert line.reopened == 0
    assert line(3500) == pytest.approx(0.5, abs=0.2)  # through the middle of the stairs
    t[0] += 1.0
    for i in range(6):
        line.update(1000 * (i + 1), 1.0, t[0])
    assert line.reopened == 0
    spaced = _fitted([0.0])
    for i in range(6):  # the same late answers, each at an instant of its own: a run
        spaced.update(1000 * (i + 1), 1.0, 100.0 + i)
    assert spaced.reopened == 1
    stream = _fitted([0.0])
    for i in range(60):  # late answers 1 ms apart without a pause: one event per 5 ms, still a run
        stream.update(2000, 1.0, 200.0 + i * 0.001)
    assert stream.reopened >= 1


def test_a_run_of_steps_on_one_side_still_reopens_a_line() -> None:
    line = Line(0.05, 1 / 13.0, 0.98)
    t = 0.0
    for _ in range(20):
        t += 0.5
        line.update(2000, 0.2, t)
    before = line.reopened
    for _ in range(6):  # P became 5x slower: six steps, each clump of three late
        t += 0.5
        for _ in range(3):
            line.update(2000, 1.0, t)
    assert line.reopened == before + 1


def test_a_prediction_says_where_its_rates_came_from_and_only_a_fitted_one_may_reject() -> None:
    pred = Predictor(PS, 10_000, NOW)
    cold = pred.prefill("p0", 1000)
    assert (cold.source, cold.confident) == (sc.PREDICT_PRIOR, False)
    assert cold.seconds == pytest.approx(PS.prefill_base_s + 0.1)
    rates = Rates(
        fitted_at=0.0,
        window_s=30.0,
        instances=[InstanceRate(name="p0", prefill_base_s=0.1, prefill_s_per_token=0.001, samples=50)],
        pairs=[PairRate(prefill="p0", decode="d0", handoff_s=0.4, samples=9)],
    )
    pred.use_table(rates, share=0.5)
    pred.backlog.add("p0", 500)  # this proxy's 500 tokens, at half the pool: 1000 ahead
    table = pred.prefill("p0", 1000)
    assert (table.source, table.confident, table.ahead) == (sc.PREDICT_TABLE, True, 1000)
    assert table.seconds == pytest.approx(0.1 + 0.001 * 2000)
    assert pred.handoff("p0", "d0", HandoffX(2000, 2000)) == 0.4
    for _ in range(PS.min_samples):
        pred.observe_prefill("p0", 2000, 5.0)
    online = pred.prefill("p0", 1000)
    assert (online.source, online.confident) == (sc.PREDICT_ONLINE, True)
    assert online.seconds > table.seconds  # it learnt that P is slower than the table said


def test_the_error_factor_is_the_recent_ratio_quantile_and_one_while_few_are_known() -> None:
    pred = Predictor(PredictSettings(quantile=0.9), 10_000, NOW)
    for _ in range(MIN_RATIOS - 1):
        pred.observe_ttft("p0", 1.0, 2.0, True)
    assert pred.factor("p0") == 1.0
    pred = Predictor(PredictSettings(quantile=0.9), 10_000, NOW)
    for i in range(100):
        pred.observe_ttft("p0", 1.0, 1.0 + i / 100, True)
    assert pred.factor("p0") == pytest.approx(1.9, abs=0.05)
    assert pred.observe_ttft("p0", 0.0, 1.0, True) is None
    assert pred.observe_ttft("p0", 1.0, float("nan"), True) is None


def test_ratios_age_out_of_the_margin_though_no_first_token_replaces_them() -> None:
    """2P+4D, the other P's NIC slowed: the healthy P took the whole load at once, its queue was
    under-predicted up to 4x for a second, and those ratios (the 0.995 quantile of 256 is about their
    second largest) refused everything that met a queue for the rest of the run, so no first token
    came to replace them. Past ``errors_s`` they are the fleet's past, not the model's noise."""
    t = [0.0]
    pred = Predictor(PredictSettings(errors_s=20.0), 10_000, lambda: t[0])
    for _ in range(100):
        pred.observe_ttft("p0", 1.0, 1.05, True)
    t[0] = 5.0
    for _ in range(3):
        pred.observe_ttft("p0", 1.0, 4.5, True)  # the onset's saturation
    assert pred.factor("p0") == 4.0
    t[0] = 24.0  # the healthy ratios are gone, the onset's (19 s old) still count: too few, borrowed
    assert pred.factor("p0") == 1.0
    t[0] = 26.0
    assert pred.factor("p0") == 1.0
    for _ in range(MIN_RATIOS):
        pred.observe_ttft("p0", 1.0, 1.2, True)
    assert pred.factor("p0") == pytest.approx(1.2)  # new first tokens, the model's noise again


def test_a_handoff_waiting_on_a_late_ps_side_is_no_queue_at_its_d() -> None:
    """The same run: the slow P held a handoff at every D, so every request through the healthy P met
    'a queue at D' and was given the margin; they wait on the slow P's NIC, not in D's queue."""
    t = [0.0]
    pred = _handing(t)
    for d in ("d0", "d1"):
        pred.sent_to_d("p1", d, 2000)
        pred.handoff_began("p1", d, 0.3)
    assert pred.d_queued(["d0"], pred.handoff_lags())  # not yet due: p1's row is not late
    t[0] = 3.0
    lags = pred.handoff_lags()
    assert lags.row["p1"] > 1.0 and not pred.d_queued(["d0", "d1"], lags)
    pred.sent_to_d("p0", "d1", 2000)  # the healthy P's own request at d1 is a queue there
    assert pred.d_queued(["d0", "d1"], lags) and not pred.d_queued(["d0"], lags)


def test_one_ps_errors_do_not_widen_anothers_margin_and_a_cold_guess_widens_none() -> None:
    """The held-out failure: a P that slowed five times over filled a shared ring with ratios near 2-4
    while its line caught up, and the healthy P's predictions, times that factor, were rejected."""
    pred = Predictor(PredictSettings(quantile=0.98), 10_000, NOW)
    for _ in range(50):
        pred.observe_ttft("p0", 1.0, 0.95, True)  # the healthy P: its model fits
        pred.observe_ttft("p1", 1.0, 3.0, True)  # the P that slowed: its line lags
        pred.observe_ttft("p0", 0.2, 0.5, False)  # a cold prediction: a guess, not the model's noise
    assert pred.factor("p0") == 1.0
    assert pred.factor("p1") == pytest.approx(3.0)
    assert pred.factor("p2") == 1.0  # a P with no ratios of its own borrows the typical peer's, not p1's


def test_a_p_without_its_own_ratios_borrows_the_lower_median_peer_and_the_pooled_ring_at_the_start() -> None:
    """The held-out failure: a P's NIC slowed tenfold (its ratios near 4), a healthy P's line reopened
    under the load it shed, and the healthy P borrowed the pooled ring, whose quantile was the slow P's."""
    pred = Predictor(PredictSettings(quantile=0.98), 10_000, NOW)
    for _ in range(MIN_RATIOS // 2):
        pred.observe_ttft("p0", 1.0, 1.5, True)
        pred.observe_ttft("p1", 1.0, 1.5, True)
    assert pred.factor("p2") == pytest.approx(1.5)  # nobody has a ring of its own yet: the pooled one
    pred = Predictor(PredictSettings(quantile=0.98), 10_000, NOW)
    for _ in range(50):
        pred.observe_ttft("p0", 1.0, 1.2, True)
        pred.observe_ttft("p1", 1.0, 1.6, True)
        pred.observe_ttft("slow", 1.0, 5.0, True)
    pred.observe_ttft("p3", 1.0, 9.0, True)  # a few of its own do not count yet
    assert pred.factor("slow") == pytest.approx(4.0)
    assert pred.factor("p3") == pytest.approx(1.6)  # 1.2, 1.6, 4.0: the lower median
    pred.observe_ttft("p4", 1.0, 1.1, True)
    for _ in range(MIN_RATIOS):
        pred.observe_ttft("p4", 1.0, 1.1, True)
    assert pred.factor("p3") == pytest.approx(1.2)  # 1.1, 1.2, 1.6, 4.0: a new peer moves it


def test_the_errors_that_reopened_a_line_leave_its_margin() -> None:
    pred = _trained({"p0": 0.0001}, clock=_ticking())
    for _ in range(MIN_RATIOS):
        pred.observe_ttft("p0", 1.0, 1.0, True)
    for _ in range(5):
        pred.observe_ttft("p0", 1.0, 4.0, True)  # P got slower: its first-token errors show it
    assert pred.factor("p0") == pytest.approx(4.0)
    line = pred.lines()["p0"]
    opened = line.reopened
    while line.reopened == opened:  # ... and its prefill times run one-sided until the line reopens
        pred.observe_prefill("p0", 2000, 2.0)
    assert pred.factor("p0") == 1.0  # those errors measured the change; none are left to borrow


def _ticking(step_s: float = 0.01) -> Callable[[], float]:
    """A clock that moves ``step_s`` on every read: each answer an event of its own (never one step's)."""
    t = [0.0]

    def clock() -> float:
        t[0] += step_s
        return t[0]

    return clock


def _trained(per_token: dict[str, float], n: int = 10, clock: Callable[[], float] = NOW) -> Predictor:
    pred = Predictor(PS, 10_000, clock)
    for p, s in per_token.items():
        for x in (1000, 4000, 8000) * n:
            pred.observe_prefill(p, x, x * s)
    return pred


def test_outlook_rejects_only_when_every_fitted_p_is_late_and_a_cold_one_is_never_late() -> None:
    pred = _trained({"p0": 0.001, "p1": 0.0001})  # p0: 1 s per 1000 tokens; p1 ten times faster
    look = outlook(pred, {"p0": 2000, "p1": 2000}, ["p0", "p1"], ["d0"], 0.0, target_s=1.0)
    assert look.late == {"p0"} and not look.hopeless and look.slack_s > 0
    late = outlook(pred, {"p0": 2000}, ["p0"], ["d0"], 0.0, target_s=1.0)
    assert late.hopeless and late.best_s > late.budget_s
    with_cold = outlook(pred, {"p0": 2000, "p9": 2000}, ["p0", "p9"], ["d0"], 0.0, target_s=1.0)
    assert with_cold.late == {"p0"} and not with_cold.hopeless  # p9 has no fit: it may serve


def test_a_request_overdue_at_p_says_p_slowed_before_any_answer_does() -> None:
    """A P's line learns only from answers, which come late when P slows down: the most overdue of the
    requests in flight there scales its predictions at once, and a P that stopped answering is
    predicted later and later (no request is admitted to it in vain); its answer ends that."""
    t = [0.0]
    pred = Predictor(PS, 10_000, lambda: t[0])
    for p in ("p0", "p1"):
        for x in (1000, 4000, 8000) * 10:
            pred.observe_prefill(p, x, x * 0.0002)  # 0.2 s per 1000 tokens
    part = pred.prefill("p0", 2000).seconds
    assert part == pytest.approx(0.4, rel=0.05) and pred.lag("p0") == 1.0
    ticket = pred.sent_to_p("p0", 2000, part)
    t[0] = 0.3  # not yet due: nothing is said
    assert pred.lag("p0") == 1.0
    t[0] = 1.2  # three times its prediction and no answer: p0 is at least three times slower
    assert pred.lag("p0") == pytest.approx(3.0, rel=0.05)
    behind_it = pred.prefill("p1", 4000).seconds  # p0's line for 2000 tokens behind its 2000
    assert pred.prefill("p0", 2000).seconds == pytest.approx(3.0 * behind_it, rel=0.1)
    look = outlook(pred, {"p0": 2000, "p1": 2000}, ["p0", "p1"], ["d0"], 0.0, target_s=1.5)
    assert look.late == {"p0"} and not look.hopeless
    t[0] = 10.0  # it stopped answering
    assert pred.lag("p0") == pytest.approx(25.0, rel=0.05)
    pred.left_p("p0", ticket, 2000)
    assert pred.lag("p0") == 1.0 and pred.backlog == {}


def test_a_lag_within_the_margin_is_the_models_noise_and_scales_nothing() -> None:
    """The margin (the error quantile) multiplies a queued prediction anyway: the line is scaled only by
    the lag past it, or a surge's most overdue request (a high quantile of many) is counted twice."""
    t = [0.0]
    pred = _trained({"p0": 0.0002})
    pred.clock = lambda: t[0]
    for _ in range(MIN_RATIOS):
        pred.observe_ttft("p0", 1.0, 2.0, True)  # the margin: 2
    assert pred.factor("p0") == pytest.approx(2.0)
    pred.sent_to_p("p0", 2000, 0.4)
    t[0] = 0.6  # 1.5x its prediction: within the margin
    assert pred.lag("p0") == pytest.approx(1.5) and pred.overrun("p0") == 1.0
    t[0] = 1.6  # 4x: twice what the margin covers
    assert pred.overrun("p0") == pytest.approx(2.0)


def test_a_slow_pair_is_avoided_when_another_d_is_in_time() -> None:
    pred = _trained({"p0": 0.0001})
    for _ in range(5):
        pred.observe_handoff("p0", "d0", HandoffX(2000, 2000), 3.0)
        pred.observe_handoff("p0", "d1", HandoffX(2000, 2000), 0.05)
    est = PEstimate(0.2, 0, sc.PREDICT_ONLINE, True)
    assert late_decodes(pred, "p0", est, ["d0", "d1"], 0.0, 1.0, 2000) == {"d0"}
    assert late_decodes(pred, "p0", est, ["d0"], 0.0, 1.0, 2000) == set()  # no D in time: the gate picks


def _handing(t: list[float]) -> Predictor:
    """Two Ps at 0.2 s per 1000 tokens, every pair of 2P x 3D handing off in 0.3 s, on clock ``t``."""
    pred = _trained({"p0": 0.0002, "p1": 0.0002})
    pred.clock = lambda: t[0]
    for p in ("p0", "p1"):
        for d in ("d0", "d1", "d2"):
            for _ in range(5):
                pred.observe_handoff(p, d, HandoffX(2000, 2000), 0.3)
    return pred


X = HandoffX(2000, 2000)


def test_an_overdue_handoff_says_its_pair_slowed_before_its_first_token_does() -> None:
    """A pair's line learns only from first tokens, which come late when the link slows down: the most
    overdue handoff in flight on it scales its predictions at once; one pair says nothing of its P's
    other pairs nor of its D's, and its first token ends it."""
    t = [0.0]
    pred = _handing(t)
    assert pred.handoff("p0", "d0", X) == pytest.approx(0.3, rel=0.01)
    ticket = pred.handoff_began("p0", "d0", 0.3)
    t[0] = 0.2  # not yet due
    assert pred.handoff_lags().of("p0", "d0") == 1.0
    t[0] = 3.0  # ten times its prediction and no first token
    assert pred.handoff_lags().of("p0", "d0") == pytest.approx(10.0)
    assert pred.handoff("p0", "d0", X) == pytest.approx(3.0, rel=0.01)
    assert pred.handoff("p0", "d1", X) == pytest.approx(0.3, rel=0.01)  # p0's other link: no word
    assert pred.handoff("p1", "d0", X) == pytest.approx(0.3, rel=0.01)  # d0 from another P: no word
    assert pred.handoff(None, "d0", X) == pytest.approx(0.3, rel=0.01)
    est = pred.prefill("p0", 2000)
    assert late_decodes(pred, "p0", est, ["d0", "d1"], 0.0, 2.0, 2000) == {"d0"}
    pred.handoff_ended("p0", "d0", ticket)
    assert pred.handoff("p0", "d0", X) == pytest.approx(0.3, rel=0.01)


def test_handoffs_overdue_toward_every_d_a_p_hands_to_place_the_lag_on_ps_side() -> None:
    """A P whose NIC slowed: every D it hands to waits, so its row is late, even toward a D it has
    nothing in flight to; a P with one overdue pair and one in time is not (that is the pair's)."""
    t = [0.0]
    pred = _handing(t)
    pred.handoff_began("p1", "d0", 0.3)
    pred.handoff_began("p1", "d1", 0.3)
    pred.handoff_began("p0", "d0", 0.3)
    t[0] = 0.3
    pred.handoff_began("p0", "d1", 0.3)  # p0's to d1 began later: in time
    t[0] = 0.5
    pred.handoff_began("p0", "d2", 0.3)
    t[0] = 2.4  # p1's: 8x overdue toward both Ds; p0's: overdue toward d0 only
    lags = pred.handoff_lags()
    assert lags.row == {"p1": pytest.approx(8.0), "p0": pytest.approx(19 / 3)}
    t[0] = 0.55  # back when p0's d1 and d2 were within their time: p0's row is not late
    lags = pred.handoff_lags()
    assert lags.row["p0"] == 1.0 and lags.of("p1", "d2") == pytest.approx(0.55 / 0.3)
    assert lags.of("p0", "d2") == 1.0
    look = outlook(pred, {"p0": 2000, "p1": 2000}, ["p0", "p1"], ["d2"], 0.0, target_s=0.9, tokens=2000)
    assert look.late == {"p1"}  # 0.4 s + 0.55 s over the budget of 0.855 s; p0 0.4 s + 0.3 s


def test_a_handoff_not_yet_due_does_not_clear_ps_row_and_one_in_time_does() -> None:
    """The held-out failure: a P whose NIC slowed kept its row in time because each new request went to
    a D it had nothing in flight to, whose handoff had just begun (not yet due: no word either way)."""
    t = [0.0]
    pred = _handing(t)
    pred.handoff_began("p0", "d0", 0.3)
    pred.handoff_began("p0", "d1", 0.3)
    t[0] = 1.5
    pred.handoff_began("p0", "d2", 0.3)  # just began
    t[0] = 1.6
    lags = pred.handoff_lags()
    assert lags.row["p0"] == pytest.approx(1.6 / 0.3)  # d0 and d1 overdue: P's side
    assert lags.of("p0", "d2") == pytest.approx(1.6 / 0.3)
    ticket = pred.handoff_began("p0", "d2", 0.3)
    t[0] = 1.8
    pred.handoff_ended("p0", "d2", ticket, arrived=True)  # p0's handoff came within its time
    assert pred.handoff_lags().row["p0"] == 1.0  # so p0's side delivers: d0 and d1 are their pairs'
    assert pred.handoff_lags().of("p0", "d0") == pytest.approx(1.8 / 0.3)
    t[0] = 2.0
    moved = pred.handoff_began("p0", "d1", 0.3)
    t[0] = 2.5
    pred.handoff_ended("p0", "d1", moved)  # moved to another D: no word either way
    assert pred.handoff_lags().row["p0"] == 1.0  # d2's 1.5 s one is overdue, but began before 1.8 s
    pred.handoff_began("p0", "d1", 0.3)
    t[0] = 3.0
    pred.handoff_began("p0", "d2", 0.3)
    t[0] = 3.5
    lags = pred.handoff_lags()
    assert lags.row["p0"] == pytest.approx(0.5 / 0.3)  # overdue since it came in time: d1's, d2's
    assert lags.of("p0", "d0") == pytest.approx(3.5 / 0.3)  # a pair's own lag counts all it holds


def test_a_handoff_slow_on_ps_side_teaches_its_pair_not_its_ds_line() -> None:
    """2P+4D on the simulator, one P's NIC ten times slower: that P's 3-6 s handoffs taught every D's
    own line, which then predicted 2.5-2.9 s through the healthy P as well, and the proxy refused every
    request for the rest of the run. While the P's row is late and the D's column is not, its first
    tokens teach its pairs only."""
    t = [0.0]
    pred = _handing(t)
    for d in ("d0", "d1"):
        pred._rivals.pop(d, None)  # no record yet of which of the two predicts d better
        for _ in range(20):
            pred.observe_handoff("p0", d, X, 0.3)
    for d in ("d0", "d1", "d2"):  # a queue on each of p1's links: the older of two ends first
        pred.handoff_began("p1", d, 0.3)
    tickets = {d: pred.handoff_began("p1", d, 0.3) for d in ("d0", "d1", "d2")}
    t[0] = 3.0  # p1's handoffs 10x overdue (a queue on each link): its row is late; each D waits on p1 alone
    assert pred.handoff_lags().row["p1"] > 1.0
    for d in ("d0", "d1"):
        pred.handoff_ended("p1", d, tickets[d], arrived=True)
        for _ in range(10):
            pred.observe_handoff("p1", d, X, 3.0)
    assert pred.handoff(None, "d0", X) == pytest.approx(0.3, rel=0.05)  # D's own line: p0's handoffs
    assert pred.handoff("p0", "d1", X) == pytest.approx(0.3, rel=0.05)
    assert pred._pairs["p1", "d0"](X.on_pair) > 2.0  # the pair learnt its P's slowness
    # a D whose column is late too (both Ps overdue toward it): its line learns from every P, as before
    t[0] = 10.0
    for p in ("p0", "p1"):
        for d in ("d2", "d3"):
            pred.handoff_began(p, d, 0.3)
    t[0] = 13.0
    assert pred.handoff_lags().col["d2"] > 1.0
    for _ in range(10):
        pred.observe_handoff("p1", "d2", X, 3.0)
    assert pred.handoff(None, "d2", X) > 2.0


def test_a_stale_pair_line_judges_again_while_its_probe_is_in_flight() -> None:
    """A pair that learnt nothing for ``probe_s`` falls back to its D's line, so it is tried again; while
    that probe is in flight its own line judges, and the next request is not sent the same way."""
    t = [0.0]
    pred = _handing(t)
    for _ in range(10):
        pred.observe_handoff("p0", "d0", X, 3.0)  # the pair slowed; d0's own line mixes both
    t[0] = 1.0
    for _ in range(30):
        pred.observe_handoff("p1", "d0", X, 0.3)
    slow = pred.handoff("p0", "d0", X)
    assert slow > 2.0
    t[0] = 1.0 + PS.probe_s + 1
    assert pred.handoff("p0", "d0", X) < 1.0  # stale: d0's line, so one request may probe the pair
    pred.sent_to_d("p0", "d0", 2000)  # the probe is sent: still at P, the pair's own line judges
    assert pred.handoff("p0", "d0", X) == pytest.approx(slow)
    pred.handoff_began("p0", "d0", 0.4)
    assert pred.handoff("p0", "d0", X) == pytest.approx(slow)  # and while its handoff is in flight
    pred.left_d("p0", "d0", 2000)


def test_handoffs_overdue_from_every_p_a_d_waits_on_place_the_lag_on_ds_side() -> None:
    """A D that stopped pulling: every P handing to it waits, so its column is late for every P, and for
    a request weighed through D alone (any P); the Ps' other Ds stay in time."""
    t = [0.0]
    pred = _handing(t)
    pred.handoff_began("p0", "d2", 0.3)
    pred.handoff_began("p1", "d2", 0.3)
    t[0] = 1.4
    pred.handoff_began("p0", "d0", 0.3)
    pred.handoff_began("p1", "d1", 0.3)
    t[0] = 1.5  # d2's: 5x overdue from both Ps; d0's and d1's: in time
    lags = pred.handoff_lags()
    assert lags.col == {"d2": pytest.approx(5.0)} and lags.row == {"p0": 1.0, "p1": 1.0}
    assert lags.of(None, "d2") == lags.of("p0", "d2") == lags.of("p1", "d2") == pytest.approx(5.0)
    assert lags.of("p0", "d1") == lags.of("p1", "d0") == lags.of(None, "d0") == 1.0
    assert pred.handoff(None, "d2", X) == pytest.approx(1.5, rel=0.01)
    est = pred.prefill("p1", 2000)
    assert late_decodes(pred, "p1", est, ["d0", "d1", "d2"], 0.0, 1.5, 2000) == {"d2"}


def test_a_handoff_lag_within_the_margin_is_the_models_noise() -> None:
    t = [0.0]
    pred = _handing(t)
    for _ in range(MIN_RATIOS):
        pred.observe_ttft("p0", 1.0, 2.0, True)  # p0's margin: 2
    pred.handoff_began("p0", "d0", 0.3)
    t[0] = 0.45  # 1.5x: within it
    assert pred.handoff("p0", "d0", X) == pytest.approx(0.3, rel=0.01)
    t[0] = 1.2  # 4x: twice what the margin covers
    assert pred.handoff("p0", "d0", X) == pytest.approx(0.6, rel=0.01)


def test_the_handoff_grows_with_the_kv_d_pulls_its_own_and_what_is_ahead_of_it() -> None:
    """D pulls the whole prompt's KV, behind the pulls of the requests sent to it before: one mean
    per pair over mixed lengths and queues would be wrong for both the short and the long."""
    pred = Predictor(PS, 10_000, NOW)
    for _ in range(20):
        for x in (1000, 4000, 8000):
            pred.observe_handoff("p0", "d0", HandoffX(x, x), 0.05 + x * 50e-6)  # 50 us per token of KV
    assert pred.handoff_x("p0", "d0", 2000) == (2000, 2000)
    pred.sent_to_d("p0", "d0", 3000)  # a request already sent to d0, its first token still to come
    x = pred.handoff_x("p0", "d0", 2000)
    assert x == (5000, 5000) and pred.handoff_x("p0", "d1", 2000) == (2000, 2000)
    assert pred.handoff_x("p1", "d0", 2000) == (5000, 2000)  # ahead at d0, not on p1's pair
    for p in ("p0", None):
        assert pred.handoff(p, "d0", x) == pytest.approx(0.05 + 5000 * 50e-6, rel=0.05)
    pred.left_d("p0", "d0", 3000)
    assert pred.handoff_x("p0", "d0", 2000) == (2000, 2000) and pred.d_backlog == pred.pair_backlog == {}


@pytest.mark.parametrize("contended", ["link", "d"])
def test_each_d_predicts_with_the_queue_its_handoffs_wait_in(contended: str) -> None:
    """Transfers may contend on each P x D link (the simulator's) or at D (every pull into it): D's
    handoffs are predicted by the model, the pair's queue or D's, that has predicted them better."""
    pred = Predictor(PS, 10_000, NOW)
    rng = random.Random(1)
    for i in range(200):
        p, own = f"p{i % 2}", 2000
        x = HandoffX(own + rng.randrange(0, 20_000), own + rng.randrange(0, 6000))  # independent queues
        pred.observe_handoff(p, "d0", x, 0.05 + 100e-6 * (x.on_pair if contended == "link" else x.at_d))
    busy_d_idle_link = HandoffX(22_000, 2000)
    expected = 0.05 + 100e-6 * (2000 if contended == "link" else 22_000)
    assert pred.handoff("p0", "d0", busy_d_idle_link) == pytest.approx(expected, rel=0.1)


def test_a_fit_that_learnt_nothing_for_probe_s_lets_one_request_through_to_learn_again() -> None:
    t = [0.0]
    pred = Predictor(PredictSettings(min_samples=5, probe_s=10.0), 10_000, lambda: t[0])
    for _ in range(10):
        pred.observe_prefill("p0", 1000, 50.0)  # p0 was very slow
        pred.observe_handoff("p0", "d0", HandoffX(1000, 1000), 9.0)
    assert pred.prefill("p0", 1000).confident and pred.handoff(
        "p0", "d0", HandoffX(1000, 1000)
    ) == pytest.approx(9.0, rel=0.01)
    t[0] = 11.0  # nothing learnt since: p0 may get one request (a probe), d0's mean falls back
    assert not pred.prefill("p0", 1000).confident
    assert pred.handoff("p0", "d0", HandoffX(1000, 1000)) == PredictSettings().handoff_s
    pred.backlog.add("p0", 1000)  # the probe is in flight: judged by its old line meanwhile
    assert pred.prefill("p0", 1000).confident
    pred.backlog.drop("p0", 1000)
    pred.observe_prefill("p0", 1000, 0.2)
    assert pred.prefill("p0", 1000).confident  # fresh again


def _proxy(
    n_p: int, spans: InMemorySpanExporter | None = None, **predict: object
) -> tuple[MemoryProxy, list[MemVLLM]]:
    p = [MemVLLM(f"p{i}", "prefill") for i in range(n_p)]
    d = [MemVLLM("d0", "decode", serves_plain=True)]
    settings = memory_settings(
        {"prefill": ("prefill", p), "decode": ("decode", d)}, proxy={"predict": {"min_samples": 5, **predict}}
    )
    return memory_flow(settings, [*p, *d], spans), p


STREAMED = {**COMPLETION, "stream": True}


def _slow(px: MemoryProxy, *names: str) -> None:
    pred = px.flow.gate.predictor
    for name in names:
        for x in (10, 100, 1000) * 5:
            pred.observe_prefill(name, x, 100.0)  # 100 s, whatever the prompt


async def test_a_request_every_p_would_serve_late_is_rejected_at_once_with_the_drain_time() -> None:
    spans = InMemorySpanExporter()
    px, _ = _proxy(2, spans)
    _slow(px, "p0", "p1")
    reply = await px.send()
    assert reply.status == 429
    assert b"predicted_late" in reply.data
    retry_after = int(dict(reply.headers)[b"retry-after"])
    assert 60 <= retry_after <= 120  # ~100 s predicted against a 2 s target
    assert px.metric("pdscope_proxy_rejections_total", pool="prefill", reason="predicted_late") == 1
    (root,) = [s for s in spans.get_finished_spans() if s.name == sc.SPAN_REQUEST]
    assert root.attributes is not None and root.attributes[sc.PREDICTED_TTFT_S] > 90


async def test_a_request_goes_to_the_p_in_time_and_records_its_prediction() -> None:
    spans = InMemorySpanExporter()
    px, p = _proxy(2, spans)
    _slow(px, "p0")
    for _ in range(4):
        assert (await px.send(STREAMED)).status == 200
    assert (len(p[0].calls), len(p[1].calls)) == (0, 4)
    roots = [s.attributes for s in spans.get_finished_spans() if s.name == sc.SPAN_REQUEST]
    assert roots[0] is not None and roots[0][sc.PREDICT_SOURCE] == sc.PREDICT_PRIOR  # nothing fitted for p1
    assert all(r is not None and r[sc.PREDICT_SOURCE] in sc.PREDICT_SOURCES for r in roots)
    assert all(r is not None and 0 < r[sc.PREDICTED_TTFT_S] < 1 and r[sc.TTFT_TARGET_S] == 2.0 for r in roots)
    assert px.metric("pdscope_proxy_ttft_prediction_ratio_count", pool="prefill") == 4


async def test_admission_by_prediction_can_be_turned_off() -> None:
    px, _ = _proxy(1, admit=False)
    _slow(px, "p0")
    assert (await px.send()).status == 200


@pytest.mark.parametrize("value", [b"50", b"abc", b"1e12", b"nan"])
async def test_a_target_header_out_of_bounds_is_a_400_naming_it(value: bytes) -> None:
    px, _ = _proxy(1)
    reply = await px.send(headers={b"x-pdscope-ttft-target-ms": value})
    assert reply.status == 400 and b"x-pdscope-ttft-target-ms" in reply.data


async def test_a_batch_request_with_a_long_target_is_admitted_where_an_interactive_one_is_not() -> None:
    px, _ = _proxy(1)
    _slow(px, "p0")
    assert (await px.send(headers={b"x-pdscope-ttft-target-ms": b"1000"})).status == 429
    assert (await px.send(headers={b"x-pdscope-ttft-target-ms": b"300000"})).status == 200


async def test_the_served_proxy_reads_the_target_header_named_in_the_config() -> None:
    """Over HTTP (the ASGI app keeps only the headers the flow reads): the configured header's target
    is the one held against, a bad one is a 400 naming it."""
    async with fake_fleet(1, 1) as fleet:
        settings = make_settings(
            [i.url for i in fleet.prefill],
            [i.url for i in fleet.decode],
            {"predict": {"target_header": "X-Budget"}},
        )
        async with running_proxy(settings) as (url, app), httpx.AsyncClient(timeout=10) as client:
            pred = app.parts.flow.gate.predictor
            for x in (10, 100, 1000) * 10:  # past min_samples (20)
                pred.observe_prefill("p0", x, 100.0)  # p0 takes 100 s, whatever the prompt
            body = {"model": "fake", "prompt": "a b c", "max_tokens": 2}
            late = await client.post(url + "/v1/completions", json=body)
            batch = await client.post(url + "/v1/completions", json=body, headers={"x-budget": "300000"})
            bad = await client.post(url + "/v1/completions", json=body, headers={"X-Budget": "soon"})
    assert late.status_code == 429 and late.json()["error"]["code"] == "predicted_late"
    assert batch.status_code == 200
    assert bad.status_code == 400 and "X-Budget" in bad.json()["error"]["message"]


def test_a_line_whose_slope_sits_on_its_floor_stays_near_what_it_sees() -> None:
    """A P whose time does not grow with its backlog (a zero-latency fleet; a P that batches the whole
    queue at once): the slope sits on its floor. The update used to clamp it after a joint step, and
    the error it could not put there went into the base through their correlation, every step: the
    line reached 770 s against observations of 2-32 ms, and every request was rejected."""
    rng = random.Random(1)
    line = Line(0.05, 0.0625, 0.98)
    for i in range(400):
        line.update(135 * (i % 64), 0.002 + rng.random() * 0.03)  # the backlog ramps, the time does not
        if i >= 10:  # past the prior's first guesses
            assert 0.0 <= line(0) <= 0.05 and line(135 * 63) <= 0.1, (i, line.a, line.b)
    assert line.b >= B_MIN and line.p00 * line.p11 >= line.p01**2


def test_a_line_at_zero_base_learns_its_slope_alone() -> None:
    line = Line(0.0, 0.001, 0.98)
    for i in range(100):
        tokens = 1000 * (1 + i % 8)
        line.update(tokens, 0.0005 * tokens / 1000)  # all slope, no base: a sits on its bound
    assert line.a >= 0.0 and line(8000) == pytest.approx(0.004, rel=0.1)


def test_the_error_margin_is_for_a_queue_and_a_request_meeting_none_is_judged_by_its_own_prompt() -> None:
    """A saturation's errors widen the margin; once nothing of this proxy's waits on the way, they must
    not refuse a request to an idle fleet (nothing admitted, no first token would ever narrow it)."""
    pred = _trained({"p0": 0.0004})  # 0.4 s per 1000 tokens
    for _ in range(MIN_RATIOS):
        pred.observe_ttft("p0", 1.0, 2.5, True)  # the saturation: 2.5x what was predicted
    assert pred.factor("p0") == pytest.approx(2.5)
    idle = outlook(pred, {"p0": 2000}, ["p0"], ["d0"], 0.0, target_s=2.0)
    assert not idle.hopeless  # 0.8 s of its own prefill and the handoff: in time, with no queue
    pred.backlog.add("p0", 1000)  # something of ours is ahead on P: the margin is the queue model's
    assert outlook(pred, {"p0": 2000}, ["p0"], ["d0"], 0.0, target_s=2.0).hopeless
    pred.backlog.drop("p0", 1000)
    pred.sent_to_d("p0", "d0", 2000)  # or waits for D's first token
    assert outlook(pred, {"p0": 2000}, ["p0"], ["d0"], 0.0, target_s=2.0).hopeless
    pred = _trained({"p0": 0.0004})
    assert outlook(pred, {"p0": 6000}, ["p0"], ["d0"], 0.0, target_s=2.0).hopeless  # too long for it alone


async def test_a_non_streamed_answer_teaches_neither_the_handoff_nor_the_margin() -> None:
    """What the proxy sees first of a non-streamed answer is its end: D's decode, not its handoff."""
    px, _ = _proxy(1)
    pred = px.flow.gate.predictor
    assert (await px.send()).status == 200
    assert pred.handoff("p0", "d0", HandoffX(100, 100)) == pred.ps.handoff_s  # no handoff learnt: the prior
    assert px.metric("pdscope_proxy_ttft_prediction_ratio_count", pool="prefill") == 0
    assert pred.d_backlog == pred.pair_backlog == {}  # it left D's backlog all the same
    for _ in range(3):
        assert (await px.send(STREAMED)).status == 200
    assert pred.handoff("p0", "d0", HandoffX(100, 100)) != pred.ps.handoff_s  # a streamed one teaches it
    assert px.metric("pdscope_proxy_ttft_prediction_ratio_count", pool="prefill") == 3


async def test_a_streamed_requests_handoff_is_in_flight_from_ps_answer_to_its_first_token() -> None:
    """Through the flow: once P answers, the handoff is in flight on its pair (its lag can grow) until
    the request ends; a non-streamed one is never (its first bytes are its whole decode)."""
    p, d = MemVLLM("p0", "prefill"), MemVLLM("d0", "decode", serves_plain=True, mode="hang")
    settings = memory_settings(
        {"prefill": ("prefill", [p]), "decode": ("decode", [d])}, proxy={"predict": {"min_samples": 5}}
    )
    px = memory_flow(settings, [p, d])
    pred = px.flow.gate.predictor
    for body, flying in ((STREAMED, {("p0", "d0")}), (COMPLETION, set())):
        d.entered.clear()
        task = asyncio.ensure_future(px.send(body))
        await d.entered.wait()  # P answered; D holds the request without a first token
        assert set(pred.handoff_lags().pair) == flying
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert pred.handoff_lags().pair == {}


def test_at_a_priority_scheduled_p_only_work_of_its_priority_or_before_and_what_runs_is_ahead() -> None:
    """p0 is priority-scheduled, p1 fcfs; each has, in flight from this proxy: 1000 tokens of priority 2 sent
    with nothing ahead (started at once), then 4000 of priority 2 behind them (waiting, predicted to start
    at 0.5 s), then 500 of priority 0. A request of priority 0 has the started 1000 and the 500 ahead of it
    at p0, everything at p1; one of priority 2 everything at both. Past 0.5 s and the 500's own time (it
    passed them) the 4000 have started too."""
    now = [0.0]
    pred = Predictor(PS, 10_000, lambda: now[0])
    pred.by_priority = frozenset({"p0"})
    for p in ("p0", "p1"):
        pred.sent_to_p(p, 1000, 0.1, priority=2, ahead=0)
        pred.sent_to_p(p, 4000, 2.5, priority=2, ahead=1000)  # 1000 of 5000 tokens ahead: starts at 0.5 s
        pred.sent_to_p(p, 500, 0.6, priority=0, ahead=5000)
    assert pred.tokens_ahead("p0", 0) == 1500 and pred.tokens_ahead("p1", 0) == 5500
    assert pred.tokens_ahead("p0", 2) == 5500 and pred.tokens_ahead("p0") == 5500
    assert pred.prefill("p0", 100, 0).ahead == 1500 and pred.prefill("p1", 100, 0).ahead == 5500
    first, last = (outlook(pred, {"p0": 100}, ["p0"], [], 0.0, 10.0, 100, q).best_s for q in (0, 2))
    assert first < last  # the outlook weighs the request's own priority
    now[0] = 0.6  # 0.5 s, and the 500 tokens' own 0.05 s that passed them
    assert pred.tokens_ahead("p0", 0) == 5500


def test_a_request_passed_in_a_priority_queue_teaches_neither_the_line_nor_the_lag() -> None:
    """At a priority-scheduled P, a waiting request of priority 3 is passed by one of priority 0 sent after
    it: its long wait is the work that passed it, so it is not overdue by P, and it is marked passed (the
    gate then keeps its time out of P's line and error ring). The one that passed it is not."""
    now = [0.0]
    pred = Predictor(PS, 10_000, lambda: now[0])
    pred.by_priority = frozenset({"p0"})
    first = pred.sent_to_p("p0", 1000, 2.0, priority=3, ahead=0)  # started at once: never passed
    slow = pred.sent_to_p("p0", 1000, 0.1, priority=3, ahead=1000)  # waits until 0.05 s
    fast = pred.sent_to_p("p0", 1000, 0.5, priority=0, ahead=1000)
    assert pred.ranked.passed(slow) and not pred.ranked.passed(fast) and not pred.ranked.passed(first)
    now[0] = 0.1  # slow was predicted to start at 0.05 s; fast, sent past it, takes 0.25 s of P first
    assert pred.tokens_ahead("p0", 0) == 2000  # first (started) and fast, not slow
    now[0] = 2.0  # slow 20x past its prediction, fast 4x, first on time
    assert pred.lag("p0") == pytest.approx(4.0)
    pred.left_p("p0", slow, 1000)
    assert not pred.ranked.passed(slow)
