"""``pdscope load``: the open-loop load generator's command line.

Import-light (argparse + pdscope.config); the client is imported in ``run``. Targets a
URL (``--url``, e.g. the proxy) or, with ``--direct``, the config's (or ``--prefill-url``/
``--decode-url``) P and D instances through the two-step protocol. Prints a summary
(goodput, SLO attainment, percentiles) and writes every request's record as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdscope.config import TENANT_ID, ConfigError, Settings, load_config, resolve_config_path

if TYPE_CHECKING:
    from simulator.loadgen import LoadTarget
    from simulator.workload import Planned, RequestResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument(
        "--url",
        help="OpenAI-compatible base URL, e.g. the proxy http://127.0.0.1:8000 (default: the config's proxy)",
    )
    target.add_argument(
        "--direct",
        action="store_true",
        help="no proxy: run the P/D two-step protocol against the pools (round-robin)",
    )
    target.add_argument("--prefill-url", action="append", default=[], help="with --direct (repeatable)")
    target.add_argument("--decode-url", action="append", default=[], help="with --direct (repeatable)")
    target.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    target.add_argument("--model", help="model name (default: the config's model.name)")
    target.add_argument(
        "--tenant",
        action="append",
        default=[],
        help="send requests as this tenant, in the config's tenants.header (repeatable: in turn)",
    )
    shape = parser.add_argument_group("workload")
    shape.add_argument("--rate", type=float, default=5.0, help="mean arrivals per second (default 5)")
    shape.add_argument("--arrival", choices=("poisson", "bursty", "constant"), default="poisson")
    shape.add_argument("--burst", type=int, default=10, help="requests per burst with --arrival bursty")
    shape.add_argument("--num-requests", "-n", type=int, default=100, help="at most this many requests")
    shape.add_argument("--duration", type=float, default=60.0, help="send for at most this many seconds")
    shape.add_argument(
        "--prompt-len", default="fixed:256", help="fixed:N | uniform:LO,HI | lognormal:MEDIAN,SIGMA (tokens)"
    )
    shape.add_argument("--output-len", default="fixed:64", help="as --prompt-len")
    shape.add_argument("--trace", help="JSONL to replay: prompt_tokens, output_tokens[, at]")
    shape.add_argument("--seed", type=int, default=0)
    run_g = parser.add_argument_group("run")
    run_g.add_argument("--timeout", type=float, default=60.0, help="per-request timeout in seconds")
    run_g.add_argument("--max-inflight", type=int, default=1024)
    run_g.add_argument("--slo-ttft-ms", type=float, help="default: the config's slo.ttft.target_ms (2000)")
    run_g.add_argument("--slo-tpot-ms", type=float, help="default: the config's slo.tpot.target_ms (100)")
    run_g.add_argument("--sim-admin", help="simulator admin URL: record its event-loop lag with the results")
    run_g.add_argument("--output", "-o", default="load-results.json", help="JSON results file")
    run_g.add_argument("--no-progress", action="store_true")


def _settings(args: argparse.Namespace) -> Settings | None:
    path = resolve_config_path(getattr(args, "config", None))
    if getattr(args, "config", None) or path.exists():
        return load_config(path)
    return None


def _target(args: argparse.Namespace, settings: Settings | None, model: str) -> LoadTarget:
    from simulator.loadgen import LoadTarget

    chat = args.endpoint == "chat"
    bad = [t for t in args.tenant if not TENANT_ID.fullmatch(t)]
    if bad or (args.tenant and args.direct):
        why = f"{bad[0]!r} is not a tenant id" if bad else "tenants are the proxy's: not with --direct"
        raise ConfigError([f"pdscope load --tenant: {why}"])
    if args.direct:
        p_urls = list(args.prefill_url) or (
            [i.url for _, i in settings.instances("prefill")] if settings else []
        )
        d_urls = list(args.decode_url) or (
            [i.url for _, i in settings.instances("decode")] if settings else []
        )
        if not p_urls or not d_urls:
            raise ConfigError(["pdscope load --direct: need prefill and decode URLs (config pools or flags)"])
        return LoadTarget(chat, model, None, tuple(p_urls), tuple(d_urls))
    url = args.url or (f"http://{settings.proxy.host}:{settings.proxy.port}" if settings else None)
    if not url:
        raise ConfigError(["pdscope load: give --url, --direct, or a config with a proxy section"])
    header = settings.tenants.header if settings else "x-pdscope-tenant"
    return LoadTarget(chat, model, url, tenants=tuple(args.tenant), tenant_header=header)


def _planned(args: argparse.Namespace) -> list[Planned]:
    from simulator.workload import LengthDist, load_trace, plan

    try:
        if args.trace:
            return load_trace(args.trace, args.rate, args.num_requests, args.duration, args.seed)
        return plan(
            args.arrival,
            args.rate,
            args.num_requests,
            args.duration,
            LengthDist.parse(args.prompt_len),
            LengthDist.parse(args.output_len),
            args.seed,
            args.burst,
        )
    except (ValueError, OSError) as exc:
        raise ConfigError([f"pdscope load: {exc}"]) from exc


def _sim_stats(args: argparse.Namespace, reset: bool) -> dict[str, Any] | None:
    """The simulator's event-loop lag stats (``--sim-admin``), reset first; None without it or on error."""
    import httpx

    if not args.sim_admin:
        return None
    try:
        base = args.sim_admin.rstrip("/")
        r = httpx.post(f"{base}/stats/reset", timeout=5) if reset else httpx.get(f"{base}/stats", timeout=5)
        return dict(r.json())
    except (httpx.HTTPError, ValueError):
        return None


def _results_doc(
    args: argparse.Namespace,
    target: LoadTarget,
    model: str,
    summary: dict[str, Any],
    results: list[RequestResult],
) -> dict[str, Any]:
    """The JSON results file: target, workload, summary and every request's record."""
    return {
        "target": {
            "url": target.url,
            "prefill_urls": target.prefill_urls,
            "decode_urls": target.decode_urls,
            "endpoint": target.path,
            "model": model,
        },
        "workload": {
            "arrival": args.arrival,
            "rate": args.rate,
            "num_requests": args.num_requests,
            "duration_s": args.duration,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "trace": args.trace,
            "seed": args.seed,
        },
        "summary": summary,
        "requests": [r.to_dict() for r in results],
    }


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from simulator.loadgen import Progress, run_load
    from simulator.workload import format_summary, summarize

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the summary
    settings = _settings(args)
    model = args.model or (settings.model.name if settings else "sim-llama-70b")
    target = _target(args, settings, model)
    planned = _planned(args)
    slo_ttft = (args.slo_ttft_ms or (settings.slo.ttft.target_ms if settings else 2000.0)) / 1000.0
    slo_tpot = (args.slo_tpot_ms or (settings.slo.tpot.target_ms if settings else 100.0)) / 1000.0
    progress = None if args.no_progress else Progress(len(planned))
    where = target.url or f"{len(target.prefill_urls)} P + {len(target.decode_urls)} D (direct)"
    shape = f"replayed from {args.trace}" if args.trace else f"{args.arrival} at {args.rate:g}/s"
    print(f"pdscope load: {len(planned)} requests, {shape}, to {where}", file=sys.stderr)
    _sim_stats(args, reset=True)
    results, wall = asyncio.run(
        run_load(
            target,
            planned,
            timeout_s=args.timeout,
            max_inflight=args.max_inflight,
            seed=args.seed,
            progress=progress,
        )
    )
    summary = summarize(results, wall, slo_ttft, slo_tpot)
    sim = _sim_stats(args, reset=False)
    if sim is not None:
        summary["simulator"] = sim
    print(format_summary(summary))
    if sim is not None and not sim.get("trustworthy", True):
        print(
            f"WARNING: the simulator's event loop lagged {sim['loop_lag_max_s'] * 1000:.0f} ms "
            f"(threshold {sim['loop_lag_threshold_s'] * 1000:.0f} ms): timings are untrustworthy"
        )
    Path(args.output).write_text(
        json.dumps(_results_doc(args, target, model, summary, results), indent=1), encoding="utf-8"
    )
    print(f"results written to {args.output}")
    return 0 if summary["completed"] > 0 or not results else 1
