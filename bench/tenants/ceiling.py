"""The proxy's per-core ceiling with the tenants section on against off: bench/proxy's measurement
(``bench.proxy.run``: its zero-latency 2 P + 2 D fleet on core 1, each proxy pinned to core 0, a closed
loop, ``ceiling = requests answered / the proxy's CPU seconds``), two pdscope proxies that differ only in
``tenants.enabled``, the load naming the scenario's tenants in turn (``bench.tenants.tagged_load``).
Rounds alternate the order; the figure is the median of each round's on/off ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.proxy.run import PY, REPO, Contender, _pin, _start_fleet, _stop, cpu_seconds, start_pdscope
from bench.tenants.scenarios import Scenario, tenants_section
from bench.tenants.tagged_load import TENANTS_ENV

WITHCONFIG = Path(__file__).with_name("withconfig.py")
TOKENS = 16  # output chunks per request, bench/proxy's default
ARMS = (("off", False), ("on", True))
MAX_ERRORS = 0.05  # a round with more of its requests failed in either arm is left out of the median


def closed_ceiling(c: Contender, tenants: list[str], concurrency: int, duration_s: float) -> dict[str, Any]:
    """One closed loop against ``c`` (the load on core 1): requests answered per CPU second of ``c``."""
    assert c.proc is not None
    cpu0 = cpu_seconds(c.proc.pid)
    cmd = [*_pin(1), PY, "-m", "bench.tenants.tagged_load", "--url", c.url, "--mode", "closed"]
    cmd += ["--concurrency", str(concurrency), "--duration", str(duration_s), "--tokens", str(TOKENS)]
    env = {**os.environ, TENANTS_ENV: ",".join(tenants)}
    out = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=duration_s + 60, check=True
    )
    res = json.loads(out.stdout.strip().splitlines()[-1])
    cpu = cpu_seconds(c.proc.pid) - cpu0
    return {"ceiling_rps": res["ok"] / cpu if cpu > 0 else None, "ok": res["ok"], "errors": res["errors"]}


def _start(scenario: Scenario, fleet: dict[str, Any], tmp: Path, tree: str | None) -> dict[str, Contender]:
    """The two proxies, tenants off and on, at bench/proxy's fleet-scale trace sample ratio."""
    out = {}
    for name, enabled in ARMS:
        wrap = [PY, str(WITHCONFIG), json.dumps(tenants_section(scenario, enabled))]
        out[name] = start_pdscope(
            fleet, tmp / f"tenants-{name}.log", tmp, ratio=0.05, name=f"tenants-{name}", wrap=wrap, tree=tree
        )
    return out


def measure_ceiling(
    scenario: Scenario, rounds: int, duration_s: float, concurrency: int = 32, tree: str | None = None
) -> dict[str, Any]:
    """``rounds`` rounds of both proxies' ceilings; the on/off ratio of each round and their median."""
    tmp = Path(tempfile.mkdtemp(prefix="tenants-ceiling-"))
    fleet_proc = _start_fleet(argparse.Namespace(tokens=TOKENS))
    procs: list[subprocess.Popen[Any]] = [fleet_proc]
    tenants = [t.id for t in scenario.tenants]
    per: list[dict[str, Any]] = []
    try:
        assert fleet_proc.stdout is not None
        proxies = _start(scenario, json.loads(fleet_proc.stdout.readline()), tmp, tree)
        procs += [c.proc for c in proxies.values() if c.proc is not None]
        for c in proxies.values():  # warm-up: connections, caches, lazy imports
            closed_ceiling(c, tenants, 8, 1.5)
        for r in range(rounds):
            order = list(proxies.items()) if r % 2 == 0 else list(proxies.items())[::-1]
            per.append({name: closed_ceiling(c, tenants, concurrency, duration_s) for name, c in order})
            print(f"  ceiling round {r + 1}/{rounds}: {_line(per[-1])}", file=sys.stderr, flush=True)
    finally:
        _stop(procs, fleet_proc)
        shutil.rmtree(tmp, ignore_errors=True)
    ratios = [p["on"]["ceiling_rps"] / p["off"]["ceiling_rps"] for p in per if _both(p)]
    return {
        "rounds": per,
        "ratio_on_vs_off": statistics.median(ratios) if ratios else None,
        "rounds_counted": len(ratios),
        "setup": f"bench/proxy's fleet and pinning; closed loop at {concurrency} for {duration_s:g} s, "
        f"{TOKENS} chunks a request, tenants {', '.join(tenants)} in turn",
    }


def _both(p: dict[str, Any]) -> bool:
    """Both arms of the round measured a ceiling, each with at most ``MAX_ERRORS`` of its requests failed
    (a starved fleet times out, the proxy ejects its instances, and the round measures that instead)."""
    return all(
        p[k]["ceiling_rps"] and p[k]["errors"] <= MAX_ERRORS * (p[k]["ok"] + p[k]["errors"])
        for k in ("on", "off")
    )


def _line(p: dict[str, Any]) -> str:
    return ", ".join(f"tenants {k} {v['ceiling_rps'] or 0:.0f} req/s per core" for k, v in p.items())
