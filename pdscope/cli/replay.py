"""``pdscope replay``: re-run the controller's policy over a stored window, as it was or changed.

It replays every tick under the config it was decided by and checks that the stored decisions come
out exactly (exit 3 when they do not: the replay itself is wrong, and so would be any comparison). With
``--candidate FILE`` (a pdscope config file: its controller, slo, admission and alerts settings) and/or
``--set name=value`` (a policy setting, e.g. ``min_weight=0.05``, on top of the stored config or the
file's) it says where the candidate's decisions part from the run's: the first divergence, the
ticks that differ, how long each instance would have been served at what weight, the pools' limits
and the alerts. The observations are the run's (an open-loop replay: see docs/policy.md).

The range is ``--since`` (a duration back from now, default 30m) or ``--from`` / ``--until`` (Unix
seconds). Exit codes: 0 replayed, 1 no tick recorded in the range or the store cannot be read, 2 a
bad range, a candidate that fails validation or a window that cannot be replayed (the message says
why), 3 the stored configs did not reproduce the stored decisions.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from typing import Any

from pdscope.cli.bounds import WINDOW, fail, refuse
from pdscope.config import ConfigError, load_config, load_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--since", help="a duration back from now: 90s, 30m, 2h, 1d (default 30m)")
    parser.add_argument("--from", dest="from_", type=float, help="start, Unix seconds (instead of --since)")
    parser.add_argument("--until", type=float, help="end, Unix seconds (default: now)")
    parser.add_argument("--candidate", help="a pdscope config file whose policy settings to replay under")
    parser.add_argument(
        "--set",
        dest="changes",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a policy setting to change (repeatable), e.g. --set min_weight=0.05",
    )
    parser.add_argument("--json", action="store_true", help="print the JSON of GET /v1/replay")
    parser.add_argument("--timeline", action="store_true", help="with --json: each instance's served weights")
    parser.add_argument("--store", help="store URL (default: store.url)")


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _candidate(args: argparse.Namespace) -> Any:
    from controller.policy import AlertConfig, PolicyConfig
    from controller.replay import Candidate, parse_changes

    changes = parse_changes(args.changes)
    if args.candidate is None:
        return Candidate(changes=changes) if changes else None
    cand = load_config(args.candidate)
    return Candidate(PolicyConfig.from_settings(cand), AlertConfig.from_settings(cand), changes)


def run(args: argparse.Namespace) -> int:
    if (code := refuse("replay", args, WINDOW)) is not None:
        return code
    from controller.attribution import BadRange, resolve_range
    from controller.replay import NoTicks, ReplayError, as_dict, replay_window
    from store.db import StoreError, opened, transaction

    settings = load_settings(args)
    since = args.since if args.since is not None or args.from_ is not None else "30m"
    try:
        lo, hi = resolve_range(time.time(), since=since, from_=args.from_, until=args.until)
    except BadRange as exc:
        return fail("replay", f"--{exc.param}: {exc.reason}", 2)
    try:
        candidate = _candidate(args)
    except ConfigError as exc:
        print("pdscope replay: the candidate config is not valid:", file=sys.stderr)
        for p in exc.problems:
            print(f"  {p}", file=sys.stderr)
        return 2
    except ReplayError as exc:
        return fail("replay", str(exc), 2)
    try:
        with opened(args.store or settings.store.url) as sessions, transaction(sessions) as session:
            result = replay_window(session, lo, hi, candidate)
    except NoTicks as exc:
        return fail("replay", f"{exc}, from {_when(lo)} to {_when(hi)}")
    except ReplayError as exc:
        return fail("replay", str(exc), 2)
    except StoreError as exc:
        return fail("replay", f"the store cannot be read: {exc}")
    if args.json:
        print(json.dumps(as_dict(result, timeline=args.timeline), indent=2, sort_keys=True))
    else:
        _print(result)
    return 0 if result.reproduced else 3


def _print(r: Any) -> None:
    under = "the stored config" if r.candidate is None else f"candidate {r.candidate}"
    print(
        f"replayed {r.ticks} ticks, {_when(r.since)} .. {_when(r.until)}, under {under} "
        f"(ran under {', '.join(r.policies)}; {r.restarts} restart(s))"
    )
    if r.reproduced:
        print("the stored decisions are reproduced exactly (every decision and every tick's state)")
    else:
        print(f"NOT REPRODUCED: {r.mismatch_count} mismatch(es) with what was stored; the first:")
        for d in r.mismatches[:5]:
            where = f"{_when(d.ts)} tick {d.tick}: {d.subject} {d.field}"
            print(f"  {where}: stored {d.actual}, replayed {d.replayed}")
        if r.candidate is not None:
            print("(the candidate is compared with the run as replayed: the comparison below does not hold)")
    if r.candidate is None:
        return
    if r.first_divergence is None:
        print("the candidate decides as the run did: nothing served or firing would have differed")
    else:
        d = r.first_divergence
        print(f"{r.divergent_ticks} of {r.ticks} ticks differ; the first at {_when(d.ts)} (tick {d.tick}):")
        print(f"  {d.what} {d.subject} {d.field}: run {d.actual}, candidate {d.replayed}")
    _print_weights(r)
    if r.alerts:
        print("alerts, seconds firing (times fired): run | candidate")
        for key, a in r.alerts.items():
            print(
                f"  {key}: {a.actual_firing_s:.0f}s ({a.actual_fired}x) | "
                f"{a.replayed_firing_s:.0f}s ({a.replayed_fired}x)"
            )
    if r.decisions:
        print("decisions by reason: run | candidate")
        for reason, (a, b) in r.decisions.items():
            print(f"  {reason}: {a} | {b}")


def _print_weights(r: Any) -> None:
    moved = {n: c for n, c in r.weights.items() if c.actual.seconds != c.replayed.seconds}
    if not moved:
        return
    print("served weight, mean and min over the window: run | candidate")
    for name, c in moved.items():
        print(
            f"  {name}: mean {c.actual.mean:.2f} | {c.replayed.mean:.2f}, "
            f"min {c.actual.low:.2f} | {c.replayed.low:.2f}"
        )
