"""A bad link or the D's own trouble: how often the SLO-miss attribution names the right one.

Seeded windows of one decode instance's requests (``decode-1``), routed a given share through
``prefill-0`` and the rest through ``prefill-1``, beside healthy traffic to two other Ds:

    queue   every request into the D misses with ``--queue-miss`` through either P (the D's fault:
            its queue)
    slow_p  the D's queue slows every handoff alike (0.3 s, lognormal sigma 0.3), and prefill-0's
            prefill is 150 ms slower than prefill-1's, so its requests miss more (still the D's fault)
    link    every request through prefill-0 -> decode-1 misses, the others into the D with
            ``--stray`` (a bad link beside the D's stray misses)
    link_part  the D hands off in 0.2 s; a fifth of the requests through prefill-0 -> decode-1 take
            0.35 s more (and miss), the others into the D with ``--stray``
    link_wide  the D's usual handoffs spread wide (50 ms, lognormal sigma 1); every request through
            prefill-0 -> decode-1 takes 0.4 s more, the others into the D with ``--stray``

For each case this counts the windows whose top reason (``analysis.attribution.attribute``) is one
P x D pair, under this rule (``_holds``: each pair against its own requests) and under the rule
before it, measured in the same run as the baseline: one pair holding 70 % of the D's misses, with a
binomial tail under 5 % against an even spread over the pairs with misses. A queue (or slow_p) read as a
link is wrong; a link read as a link is right. Each case draws from its own stream (the seed and the
case's place), so adding a case moves no other. Prints a table, writes the JSON to ``--out``.

    .venv/bin/python bench/attribution_links.py [--windows 400] [--out bench/results/attribution_links.json]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import analysis.attribution as attribution  # noqa: E402
from analysis.attribution import StageRecord, attribute  # noqa: E402
from pdscope.config import LatencySLO, SLOSettings  # noqa: E402

SLO = SLOSettings(ttft=LatencySLO(target_ms=500.0), tpot=LatencySLO(target_ms=50.0))
T0 = 1_700_000_000.0
# (fault, share of the D's requests through prefill-0, the D's requests in the window)
CASES: tuple[tuple[str, float, int], ...] = (
    ("queue", 0.5, 20),
    ("queue", 0.5, 80),
    ("queue", 0.8, 40),
    ("queue", 0.8, 80),
    ("queue", 0.9, 200),
    ("queue", 0.95, 80),
    ("slow_p", 0.5, 80),
    ("slow_p", 0.8, 80),
    ("link", 0.5, 10),
    ("link", 0.5, 40),
    ("link", 0.2, 40),
    ("link", 0.8, 40),
    ("link", 0.1, 100),
    ("link", 0.1, 200),
    ("link", 0.05, 200),
    ("link_part", 0.5, 80),
    ("link_part", 0.2, 100),
    ("link_part", 0.5, 400),
    ("link_wide", 0.5, 80),
    ("link_wide", 0.2, 100),
)


def record(i: int, p: str, d: str, handoff: float, prefill: float = 0.1) -> StageRecord:
    """A request admitted in 10 ms, 20 ms in P's queue, ``prefill`` s of prefill, ``handoff`` s to its
    first token, then ten tokens 20 ms apart."""
    t = T0 + i
    p_sent = t + 0.01
    p_done = p_sent + 0.02 + prefill
    first = p_done + handoff
    return StageRecord(
        request_id=f"r{i}",
        proxy_in=t,
        status="ok",
        p_instance=p,
        d_instance=d,
        p_sent=p_sent,
        p_done=p_done,
        d_sent=p_done,
        first_token=first,
        done=first + 0.2,
        p_queue_s=0.02,
        ttft_s=first - t,
        tpot_s=0.02,
        completion_tokens=11,
    )


def window(
    rng: random.Random, fault: str, share: float, requests: int, queue_miss: float, stray: float
) -> list[StageRecord]:
    """30 healthy requests to decode-0 and decode-2, then the D's ``requests``."""
    out = [record(k, f"prefill-{k % 2}", ("decode-0", "decode-2")[k % 2], 0.05) for k in range(30)]
    for k in range(requests):
        p = "prefill-0" if rng.random() < share else "prefill-1"
        if fault == "link_wide":  # the D's usual handoffs spread wide; the link adds 0.4 s to each of its own
            usual = 0.05 * rng.lognormvariate(0.0, 1.0)
            slow = p == "prefill-0" or rng.random() < stray
            out.append(record(1000 + k, p, "decode-1", usual + (0.4 if slow else 0.0)))
            continue
        if fault == "link_part":  # the D hands off in 0.2 s; the link slows a fifth of its own by 0.35 s
            rate = 0.2 if p == "prefill-0" else stray
            out.append(record(1000 + k, p, "decode-1", 0.55 if rng.random() < rate else 0.2))
            continue
        if fault == "slow_p":  # the D's queue slows every handoff alike; prefill-0 is slower itself
            handoff = 0.3 * rng.lognormvariate(0.0, 0.3)
            out.append(record(1000 + k, p, "decode-1", handoff, 0.25 if p == "prefill-0" else 0.1))
            continue
        rate = queue_miss if fault == "queue" else (1.0 if p == "prefill-0" else stray)
        out.append(record(1000 + k, p, "decode-1", 0.8 if rng.random() < rate else 0.05))
    return out


def _even_tail(n: int, k: int, p: float) -> float:
    return sum(math.comb(n, i) * p**i * (1.0 - p) ** (n - i) for i in range(k, n + 1))


def rule_before(per: dict[str, int], met: dict[str, int], slow: object = None) -> set[str]:
    """The rule before, as ``_holds`` answers: every pair holds when there is one, or when the one with
    the most has 70 % of the misses and its binomial tail under an even spread over the pairs with
    misses is under 5 %; none otherwise (``met`` and the slow handoffs unread)."""
    if len(per) < 2:
        return set(per)
    n, top = sum(per.values()), max(per.values())
    held = top / n >= 0.7 and _even_tail(n, top, 1.0 / len(per)) < 0.05
    return set(per) if held else set()


@contextmanager
def holding(rule: Callable[[dict[str, int], dict[str, int], object], set[str]] | None) -> Iterator[None]:
    """Attribution with ``rule`` in place of its own ``_holds`` (None: its own)."""
    names = vars(attribution)  # the module's own names: what _spread calls by name
    own = names["_holds"]
    if rule is not None:
        names["_holds"] = rule
    try:
        yield
    finally:
        names["_holds"] = own


def read_as_a_link(windows: list[list[StageRecord]]) -> float:
    """The share of ``windows`` whose top reason is one P x D pair into decode-1."""
    links = 0
    for w in windows:
        top = attribute(w, SLO, since=T0, until=T0 + 1e5).top
        links += bool(top) and top[0].place.endswith("->decode-1") and not top[0].place.startswith("*")
    return links / len(windows)


def _windows(text: str) -> int:
    n = int(text)
    if not 1 <= n <= 100_000:
        raise argparse.ArgumentTypeError(f"{n} is not 1-100000")
    return n


def _rate(text: str) -> float:
    x = float(text)
    if not 0.0 <= x <= 1.0:  # NaN too
        raise argparse.ArgumentTypeError(f"{text} is not 0-1")
    return x


def _worst(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The worst case of each side: a D's fault read as a link most often, a link found least often."""
    queue = [r for r in rows if not r["fault"].startswith("link")]
    link = [r for r in rows if r["fault"].startswith("link")]
    return {
        "queue_read_as_link_worst": {k: max(r[f"link_{k}"] for r in queue) for k in ("now", "before")},
        "link_found_worst": {k: min(r[f"link_{k}"] for r in link) for k in ("now", "before")},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument(
        "--windows", type=_windows, default=400, help="seeded windows a case, 1-100000 (default 400)"
    )
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--queue-miss", type=_rate, default=0.3, help="a queue's miss rate, 0-1 (default 0.3)")
    ap.add_argument(
        "--stray", type=_rate, default=0.05, help="the stray misses beside a link, 0-1 (default 0.05)"
    )
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "attribution_links.json")
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    print(
        f"{args.windows} windows a case; a queue or slow_p read as a link is wrong, a link read as one right",
        flush=True,
    )
    print(
        "| fault | the D's requests | share through prefill-0 | read as a link: this rule | the rule before |"
    )
    print("|---|---|---|---|---|")
    for i, (fault, share, requests) in enumerate(CASES):
        rng = random.Random(args.seed * 1000 + i)
        windows = [
            window(rng, fault, share, requests, args.queue_miss, args.stray) for _ in range(args.windows)
        ]
        now = read_as_a_link(windows)
        with holding(rule_before):
            before = read_as_a_link(windows)
        rows.append(
            {"fault": fault, "share_p0": share, "requests": requests, "link_now": now, "link_before": before}
        )
        print(f"| {fault} | {requests} | {share:.2f} | {now:.1%} | {before:.1%} |", flush=True)
    summary = _worst(rows)
    worst_queue, worst_link = summary["queue_read_as_link_worst"], summary["link_found_worst"]
    print(f"worst: a queue read as a link {worst_queue}, a link found {worst_link}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"windows": args.windows, "seed": args.seed, "cases": rows, "summary": summary}, indent=2)
        + "\n"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
