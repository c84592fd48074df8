"""What ``pdscope load`` sends and how it sums up the results (pure, seeded, no I/O).

* ``LengthDist``: ``fixed:N``, ``uniform:LO,HI``, ``lognormal:MEDIAN,SIGMA``.
* ``arrival_times``: open-loop schedules: ``poisson`` (exponential gaps at ``rate``),
  ``bursty`` (bursts of ``burst`` requests, bursts Poisson at ``rate / burst``) and
  ``constant``; bounded by count and duration.
* ``load_trace``: JSONL replay, one object per line with ``prompt_tokens``,
  ``output_tokens`` and optionally ``at`` (seconds from start).
* ``RequestResult`` and ``summarize``: client-side TTFT, TPOT, e2e per request;
  goodput (requests meeting every SLO per second), SLO attainment, percentiles
  (``pdscope.stats.percentile``, the definition the controller uses).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pdscope.stats import percentile


@dataclass(frozen=True)
class LengthDist:
    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        kind, _, rest = text.partition(":")
        try:
            nums = [float(x) for x in rest.split(",") if x.strip()]
        except ValueError as exc:
            raise ValueError(f"bad length distribution {text!r}") from exc
        if kind == "fixed" and len(nums) == 1 and nums[0] >= 1:
            return cls("fixed", nums[0])
        if kind == "uniform" and len(nums) == 2 and 1 <= nums[0] <= nums[1]:
            return cls("uniform", nums[0], nums[1])
        if kind == "lognormal" and len(nums) == 2 and nums[0] >= 1 and nums[1] >= 0:
            return cls("lognormal", nums[0], nums[1])
        raise ValueError(
            f"bad length distribution {text!r}: use fixed:N, uniform:LO,HI or lognormal:MEDIAN,SIGMA"
        )

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(math.exp(rng.gauss(math.log(self.a), self.b))))


@dataclass(frozen=True)
class Planned:
    at: float
    prompt_tokens: int
    output_tokens: int


def arrival_times(
    pattern: str, rate: float, n: int, duration_s: float, rng: random.Random, burst: int = 10
) -> list[float]:
    """Send times (seconds from start), at most ``n`` and all before ``duration_s``."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    out: list[float] = []
    t = 0.0
    while len(out) < n:
        if pattern == "constant":
            t = len(out) / rate
            batch = 1
        elif pattern == "poisson":
            t += rng.expovariate(rate)
            batch = 1
        elif pattern == "bursty":
            t += rng.expovariate(rate / burst) if out else 0.0
            batch = burst
        else:
            raise ValueError(f"unknown arrival pattern {pattern!r}")
        if t >= duration_s:
            break
        out.extend([t] * min(batch, n - len(out)))
    return out


def plan(
    pattern: str,
    rate: float,
    n: int,
    duration_s: float,
    prompt: LengthDist,
    output: LengthDist,
    seed: int,
    burst: int = 10,
) -> list[Planned]:
    rng = random.Random(seed)
    times = arrival_times(pattern, rate, n, duration_s, rng, burst)
    return [Planned(t, prompt.sample(rng), output.sample(rng)) for t in times]


def load_trace(path: str | Path, rate: float | None, n: int, duration_s: float, seed: int) -> list[Planned]:
    """Replay a JSONL trace; lines without ``at`` get Poisson times at ``rate``."""
    rng = random.Random(seed)
    out: list[Planned] = []
    t = 0.0
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, output = int(row["prompt_tokens"]), int(row["output_tokens"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{lineno}: need prompt_tokens and output_tokens ({exc})") from exc
        if "at" in row:
            t = float(row["at"])
        elif rate:
            t += rng.expovariate(rate)
        if t >= duration_s or len(out) >= n:
            break
        out.append(Planned(t, max(1, prompt), max(1, output)))
    return out


@dataclass
class RequestResult:
    index: int
    request_id: str
    scheduled_s: float
    sent_s: float
    prompt_tokens: int
    max_tokens: int
    ok: bool = False
    status: int | None = None
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_s": self.tpot_s}


def summarize(
    results: list[RequestResult], wall_s: float, slo_ttft_s: float, slo_tpot_s: float
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    meets = [
        r
        for r in ok
        if r.ttft_s is not None and r.ttft_s <= slo_ttft_s and (r.tpot_s is None or r.tpot_s <= slo_tpot_s)
    ]
    wall = max(wall_s, 1e-9)

    def pcts(values: list[float]) -> dict[str, float | None]:
        return {f"p{q:g}": percentile(values, q) for q in (50, 90, 95, 99)} | {
            "mean": (sum(values) / len(values)) if values else None
        }

    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = r.error or f"HTTP {r.status}"
            errors[key] = errors.get(key, 0) + 1
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "wall_s": wall_s,
        "throughput_rps": len(ok) / wall,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / wall,
        "goodput_rps": len(meets) / wall,
        "slo_attainment": (len(meets) / len(ok)) if ok else 0.0,
        "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s},
        "ttft_s": pcts([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": pcts([t for r in ok if (t := r.tpot_s) is not None]),
        "e2e_s": pcts([r.e2e_s for r in ok if r.e2e_s is not None]),
        "send_lag_s": pcts([max(0.0, r.sent_s - r.scheduled_s) for r in results]),
    }


def format_summary(s: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"

    lines = [
        f"requests {s['requests']}  completed {s['completed']}  failed {s['failed']}  in {s['wall_s']:.2f} s",
        f"throughput {s['throughput_rps']:.2f} req/s  output {s['output_tokens_per_s']:.1f} tok/s",
        f"goodput {s['goodput_rps']:.2f} req/s  SLO attainment {s['slo_attainment'] * 100:.1f}% "
        f"(TTFT <= {s['slo']['ttft_s'] * 1000:.0f} ms, TPOT <= {s['slo']['tpot_s'] * 1000:.0f} ms)",
        f"{'ms':8s} {'p50':>9s} {'p90':>9s} {'p95':>9s} {'p99':>9s} {'mean':>9s}",
    ]
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "e2e")):
        p = s[key]
        lines.append(
            f"{label:8s} {ms(p['p50']):>9s} {ms(p['p90']):>9s} {ms(p['p95']):>9s} {ms(p['p99']):>9s} "
            f"{ms(p['mean']):>9s}"
        )
    if s["errors"]:
        lines.append("errors: " + ", ".join(f"{k} x{v}" for k, v in sorted(s["errors"].items())))
    return "\n".join(lines)
