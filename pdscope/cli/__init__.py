"""The ``pdscope`` command line: the roof over every service.

Each subcommand reads the config once (``--config`` or ``$PDSCOPE_CONFIG``, through
``pdscope.config.load_settings``), then hands the validated settings to its service.
Services are imported lazily, by name, so that ``pdscope --help`` and ``pdscope config
check`` stay fast and need nothing running. Exit codes: 0 ok, 1 invalid input (config,
store), 2 usage errors.

This package sits above everything: it may import any service, the store and the kernel
(``pdscope.config``, ``pdscope.routing``, ...), and nothing outside it imports it (an
import-linter contract in pyproject.toml). Its own commands live beside it:
``pdscope.cli.demo``, ``pdscope.cli.db``, ``pdscope.cli.configcheck``, ``pdscope.cli.explain``,
``pdscope.cli.replay``, ``pdscope.cli.bundle`` and ``pdscope.cli.whatif``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence

from pdscope.config import ConfigError

# subcommand -> (module, one-line help, longer description)
# The module's ``run(args)`` returns an exit code; it registers its own flags through
# ``add_arguments(parser)`` when present.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": (
        "pdscope.cli.demo",
        "run the whole stack on a simulated fleet (or --real-vllm) and inject a fault",
        "Starts a simulated 2P+3D fleet, the proxy, the collector, the controller (enforcing) and "
        "the dashboard, drives a steady load and after a minute degrades one decode link so you "
        "can watch the controller react. Ctrl-C stops everything.",
    ),
    "sim": (
        "simulator.cli",
        "run a simulated vLLM P/D fleet (same HTTP API and /metrics as vLLM) with fault injection",
        "Runs N prefill and M decode simulated vLLM instances in one process, one port each on "
        "127.0.0.1, from flags or the config's simulator section. Faults can be scheduled from a "
        "scenario file or injected live with 'pdscope sim fault ...'.",
    ),
    "load": (
        "simulator.load",
        "open-loop load generator that reports TTFT, TPOT, goodput and SLO attainment",
        "Sends Poisson or bursty arrivals at a set rate to a proxy (or any OpenAI endpoint), "
        "streaming, bounded in time and count, with a progress bar; prints percentiles, goodput "
        "and SLO attainment and writes JSON.",
    ),
    "proxy": (
        "proxy.cli",
        "run the P/D proxy: prefill -> KV handoff -> decode, with routing weights and backpressure",
        "Serves /v1/completions and /v1/chat/completions, runs vLLM's NIXL pull protocol against "
        "the configured pools, follows the controller's routing table (fail-static when it is "
        "down), applies admission limits and emits OpenTelemetry spans.",
    ),
    "collect": (
        "collector.cli",
        "scrape every P and D instance's /metrics, receive OTLP spans, build request records",
        "Scrapes vLLM and NIXL metrics from every configured instance concurrently, stores one "
        "snapshot per instance per scrape, receives OTLP/HTTP traces and assembles one request "
        "record per trace (proxy -> P -> handoff -> D).",
    ),
    "control": (
        "controller.cli",
        "run the controller: reconcile loop, routing weights, admission limits, SLO alerts, API",
        "A level-triggered loop that reads a recent window from the store, computes instance "
        "weights, pool admission limits and alert states with a pure policy, stores each decision "
        "with its reasons and serves the routing table and the control API.",
    ),
    "dashboard": (
        "dashboard.cli",
        "start the Streamlit dashboard for SREs",
        "Fleet, requests (waterfalls), KV transfer, SLOs and alerts, controller decisions and "
        "capacity pages; read-only on the store, writes only through the controller API.",
    ),
    "db": (
        "pdscope.cli.db",
        "manage the store: upgrade, downgrade, check, current",
        "Applies pdscope's Alembic migrations to the configured store (SQLite or PostgreSQL).",
    ),
    "explain": (
        "pdscope.cli.explain",
        "why the requests of a range missed their SLO: the top three reasons, from the store",
        "Splits every SLO miss of the range over its stages (admission wait, P queue, prefill, handoff "
        "incl. the KV pull, D queue, decode) against the healthy requests' medians and groups the excess "
        "by stage, instance or P x D pair and cause; --json prints GET /v1/slo/attribution's JSON. "
        "--tenant T: one declared tenant's range in plain words (demand, served, rejected by reason, "
        "attainment against its own targets, fair share against what it got, where its misses went).",
    ),
    "replay": (
        "pdscope.cli.replay",
        "re-run the controller's policy over a stored window, as it was (exactly) or under a candidate",
        "Replays every recorded tick of the range through the policy. With the stored config it checks "
        "that the stored decisions come out exactly; with --candidate FILE or --set name=value it says "
        "where the candidate's decisions part from the run's: the first divergence, how long each "
        "instance would have been at what weight, the pools' limits and the alerts.",
    ),
    "bundle": (
        "pdscope.cli.bundle",
        "write an incident bundle of a range: records, snapshots, decisions, alerts, config, report",
        "One .tar.gz with the range's request records, snapshots, decisions, alerts and overrides, the "
        "policy config and settings in force, the SLO-miss attribution and a self-contained HTML report; "
        "bounded by controller.bundles.max_records / max_bytes and written atomically (the controller "
        "writes one by itself when an SLO or P/D-health alert starts firing).",
    ),
    "whatif": (
        "pdscope.cli.whatif",
        "what a candidate policy config would have done to a stored window, on the fitted simulator",
        "Fits the simulator to the fleet that ran in the range (workload, per-instance rates, link "
        "bandwidth, degradations as faults), replays it under the policy config that ran and under "
        "--candidate, and prints goodput, SLO attainment and p99 TTFT beside the observed ones with "
        "the fit's error; a candidate that would have cut goodput gets a WORSE line and exit code 3.",
    ),
    "config": (
        "pdscope.cli.configcheck",
        "check a config file",
        "Validates a pdscope.yaml and prints one line per problem, naming the file, line and field.",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdscope",
        description="Observe and steer vLLM prefill/decode disaggregated fleets.",
    )
    parser.add_argument("--config", help="config file (default: $PDSCOPE_CONFIG or ./pdscope.yaml)")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, summary, description) in COMMANDS.items():
        sp = sub.add_parser(name, help=summary, description=description)
        sp.set_defaults(_module=module)
        add = _optional_attr(module, "add_arguments")
        if add is not None:
            add(sp)
    return parser


def _optional_attr(module: str, attr: str) -> Callable[..., object] | None:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return None
        raise
    fn = getattr(mod, attr, None)
    return fn if callable(fn) else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    run = _optional_attr(args._module, "run")
    if run is None:
        print(f"pdscope {args.command}: not available in this build", file=sys.stderr)
        return 2
    try:
        code = run(args)
    except ConfigError as exc:
        for line in exc.problems:
            print(line, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return code if isinstance(code, int) else 0
