"""A quick ceiling probe for working on the proxy's per-request CPU (not the benchmark of record).

Starts the zero-latency fleet, pdscope's proxy at each ``--ratio`` (and, with
``--vllm-router``, vLLM's Rust router) pinned like ``bench.proxy.run`` does, and prints each
contender's ceiling (requests per CPU-second of the proxy process) for ``--rounds`` closed-loop
runs of ``--duration`` s. ``--py-spy FILE`` records pdscope's first contender with py-spy
(when it is installed; a flame graph, or ``--py-spy-format raw`` for collapsed stacks).

Run: ``.venv/bin/python -m bench.proxy.probe --ratio 1.0 --ratio 0.05 --rounds 3``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.proxy.run import (
    PY,
    REPO,
    Contender,
    _pin,
    closed_loop,
    loadgen,
    start_pdscope,
    start_vllm_router,
    vllm_router_binary,
)


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ratio", type=float, action="append", help="trace_sample_ratio (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--vllm-router", action="store_true")
    ap.add_argument("--py-spy", default=None, help="record the first pdscope contender to this file")
    ap.add_argument("--py-spy-format", default="raw")
    return ap.parse_args()


def _start_contenders(
    a: argparse.Namespace, fleet: dict[str, Any], tmp: Path, procs: list[subprocess.Popen[Any]]
) -> list[Contender]:
    """pdscope's proxy at each ``--ratio`` (and vLLM's router with ``--vllm-router``, when installed);
    each process goes into ``procs`` as it starts, so that a later failure stops it."""
    contenders: list[Contender] = []
    for r in a.ratio or [1.0]:
        c = start_pdscope(fleet, tmp / f"pdscope-{r}.log", tmp, ratio=r, name=f"pdscope@{r:g}")
        procs.append(c.proc)
        contenders.append(c)
    if a.vllm_router and (binary := vllm_router_binary()) is not None:
        vr = start_vllm_router(fleet, tmp / "vllm-router.log", binary)
        procs.append(vr.proc)
        contenders.append(vr)
    return contenders


def _warm_up(contenders: list[Contender], common: dict[str, Any]) -> None:
    """One second of closed-loop load on each contender before the measured rounds."""
    for c in contenders:
        loadgen(
            c.url,
            "/v1/completions",
            mode="closed",
            core=1,
            timeout_s=60,
            concurrency=8,
            duration=1.0,
            **common,
        )


def _py_spy(a: argparse.Namespace, contenders: list[Contender]) -> subprocess.Popen[Any] | None:
    """With ``--py-spy`` (and py-spy beside this interpreter): a recording of the first contender over
    all the rounds."""
    if not (a.py_spy and shutil.which("py-spy", path=str(Path(PY).parent))):
        return None
    first = contenders[0]
    assert first.proc is not None
    return subprocess.Popen(
        [
            str(Path(PY).with_name("py-spy")),
            "record",
            "--pid",
            str(first.proc.pid),
            "--rate",
            "250",
            "--format",
            a.py_spy_format,
            "--output",
            a.py_spy,
            "--nonblocking",
            "--duration",
            str(int(a.rounds * len(contenders) * a.duration)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _rounds(
    a: argparse.Namespace, contenders: list[Contender], common: dict[str, Any]
) -> dict[str, list[float]]:
    """Each contender's ceiling per round (requests per CPU-second), the order reversed every other round."""
    per: dict[str, list[float]] = {c.name: [] for c in contenders}
    for rnd in range(a.rounds):
        for c in contenders if rnd % 2 == 0 else contenders[::-1]:
            res, cpu = closed_loop(c, "/v1/completions", a, common)
            per[c.name].append(res["ok"] / cpu if cpu > 0 else 0.0)
            if res["errors"]:
                print(f"{c.name}: {res['errors']} errors", file=sys.stderr)
        print(
            f"round {rnd + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in per.items()),
            file=sys.stderr,
            flush=True,
        )
    return per


def main() -> int:
    a = _parse()
    tmp = Path(tempfile.mkdtemp(prefix="pdscope-probe-"))
    fleet_proc = subprocess.Popen(
        [*_pin(1), PY, "-m", "bench.proxy.fleet", "--chunks", str(a.tokens)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    procs: list[subprocess.Popen[Any]] = []
    try:
        assert fleet_proc.stdout is not None
        fleet = json.loads(fleet_proc.stdout.readline())
        contenders = _start_contenders(a, fleet, tmp, procs)
        common = {"tokens": a.tokens, "request_timeout": 10}
        _warm_up(contenders, common)
        spy = _py_spy(a, contenders)
        per = _rounds(a, contenders, common)
        if spy is not None:
            spy.wait(timeout=120)
        print(json.dumps({k: sorted(v)[len(v) // 2] for k, v in per.items()}))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)
        assert fleet_proc.stdin is not None
        fleet_proc.stdin.close()
        fleet_proc.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
