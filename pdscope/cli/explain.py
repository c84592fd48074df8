"""``pdscope explain``: why the requests of a range missed their SLO, from the store.

Prints the top reasons (``analysis.attribution``: each stage's excess over the healthy
requests' median, grouped by stage, instance or P×D pair and cause), or with ``--json`` the same
JSON as ``GET /v1/slo/attribution``. When most TTFT misses of the range were mispredicted (the proxy's
predictor put them within their target, they were served late: ``analysis.prediction``), it says so
with the figures. The range is ``--since`` (a duration back from now, default
30m) or ``--from`` / ``--until`` (Unix seconds). With ``--tenant T``, one tenant's window instead
(``pdscope.cli.explain_tenant``). Exit codes: 0 an answer (misses or none), 1 no
request record in the range or the store cannot be read, 2 a bad range.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from pdscope.cli.bounds import WINDOW, fail, refuse
from pdscope.config import load_settings

if TYPE_CHECKING:  # the controller is imported when the command runs, not when the CLI starts
    from controller.attribution import WindowAttribution


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--since", help="a duration back from now: 90s, 30m, 2h, 1d (default 30m)")
    parser.add_argument("--from", dest="from_", type=float, help="start, Unix seconds (instead of --since)")
    parser.add_argument("--until", type=float, help="end, Unix seconds (default: now)")
    parser.add_argument("--json", action="store_true", help="print the JSON of GET /v1/slo/attribution")
    parser.add_argument("--misses", type=int, default=20, help="misses listed with --json (default 20)")
    parser.add_argument("--limit", type=int, help="records read at most, the newest (default 50000)")
    parser.add_argument("--store", help="store URL (default: store.url)")
    parser.add_argument(
        "--tenant",
        help="one declared tenant's window in plain words: demand, service, rejections, SLO, share",
    )


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


BOUNDS = {**WINDOW, "misses": (0, 1000), "limit": (1, 200_000)}


def run(args: argparse.Namespace) -> int:
    if (code := refuse("explain", args, BOUNDS)) is not None:
        return code
    from analysis.prediction import mispredicted_misses
    from controller.attribution import (
        DEFAULT_RECORDS,
        MAX_RECORDS,
        BadRange,
        resolve_range,
        window_attribution,
        window_prediction,
    )
    from store.db import StoreError, opened

    settings = load_settings(args)
    since = args.since if args.since is not None or args.from_ is not None else "30m"
    limit = DEFAULT_RECORDS if args.limit is None else args.limit
    try:
        lo, hi = resolve_range(time.time(), since=since, from_=args.from_, until=args.until)
        if not 1 <= limit <= MAX_RECORDS:
            raise BadRange("limit", f"must be 1 to {MAX_RECORDS}")
        if not 0 <= args.misses <= 1000:
            raise BadRange("misses", "must be 0 to 1000")
    except BadRange as exc:
        return fail("explain", f"--{exc.param}: {exc.reason}", 2)
    url = args.store or settings.store.url
    if args.tenant is not None:
        from pdscope.cli import explain_tenant

        return explain_tenant.run(args, settings, lo, hi, url, limit)
    try:
        with opened(url) as sessions:
            result = window_attribution(sessions, settings, lo, hi, limit=limit)
            figures = window_prediction(sessions, settings, lo, hi, limit=limit)
            predictor = mispredicted_misses(figures)
    except StoreError as exc:
        return fail("explain", f"the store cannot be read: {exc}")
    a = result.attribution
    if a.requests == 0:
        return fail("explain", f"no request records from {_when(lo)} to {_when(hi)}")
    if args.json:
        print(json.dumps(result.as_dict(max_misses=args.misses), indent=2, sort_keys=True))
        return 0
    _print_text(result, lo, hi, limit, predictor)
    return 0


def _print_text(result: WindowAttribution, lo: float, hi: float, limit: int, predictor: str | None) -> None:
    """The answer for a person: the summary, the top reasons, and what the predictor says, if anything."""
    a = result.attribution
    print(f"{_when(lo)} .. {_when(hi)}: {a.summary()}")
    if result.truncated:
        print(f"(only the newest {limit} records were read: raise --limit or narrow the range)")
    if a.top:
        print("The top reasons we missed:")
        for k, g in enumerate(a.top, 1):
            print(f"  {k}. {g.message}")
        rest = len(a.groups) - len(a.top)
        if rest > 0:
            print(f"  (and {rest} more group(s): --json lists them)")
    if predictor is not None:
        print(f"The predictor: {predictor}.")
