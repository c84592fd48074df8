"""``pdscope bundle``: write the incident bundle of a range, from the store.

One archive (``controller.bundle``): the range's request records, snapshots, decisions, alerts and
overrides, the policy configs and the Settings in force, the SLO-miss attribution and a
self-contained HTML report, bounded by ``controller.bundles.max_records`` / ``max_bytes`` (or
``--max-records`` / ``--max-bytes``). The range is ``--since`` (a duration back from ``--until`` or
now, default ``controller.bundles.window_s``) or ``--from`` / ``--until`` (Unix seconds), as in
``pdscope explain``. Written atomically to ``--out`` (default ``controller.bundles.dir``). Exit codes:
0 written (its path printed), 1 nothing stored in the range, the store cannot be read or the folder
cannot be written (nothing is left behind), 2 a bad range or limit.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pdscope.cli.bounds import WINDOW, fail, refuse
from pdscope.config import BundleSettings, load_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--since", help="a duration back from --until or now: 90s, 30m, 2h, 1d")
    parser.add_argument("--from", dest="from_", type=float, help="start, Unix seconds (instead of --since)")
    parser.add_argument("--until", type=float, help="end, Unix seconds (default: now)")
    parser.add_argument("--out", help="folder to write the bundle to (default: controller.bundles.dir)")
    parser.add_argument("--max-records", type=int, help="rows per table at most (default: the config's)")
    parser.add_argument("--max-bytes", type=int, help="content bytes at most (default: the config's)")
    parser.add_argument("--store", help="store URL (default: store.url)")


def _limits(args: argparse.Namespace, current: BundleSettings) -> BundleSettings:
    """The config's bundle limits with the flags given, validated (pydantic names the field)."""
    from pydantic import ValidationError

    from controller.attribution import BadRange

    update = {
        k: v for k, v in (("max_records", args.max_records), ("max_bytes", args.max_bytes)) if v is not None
    }
    try:
        return BundleSettings.model_validate({**current.model_dump(), **update})
    except ValidationError as exc:
        e = exc.errors()[0]
        field = str(e["loc"][0]).replace("_", "-") if e.get("loc") else "max-records"
        raise BadRange(field, e.get("msg", "invalid")) from exc


BOUNDS = {**WINDOW, "max_records": (1, 1_000_000), "max_bytes": (2**20, 2**31)}


def run(args: argparse.Namespace) -> int:
    if (code := refuse("bundle", args, BOUNDS)) is not None:
        return code
    from controller.attribution import BadRange, resolve_range
    from controller.bundle import BundleError, NoData, write_bundle
    from controller.bundlepack import range_bundle_name
    from pdscope.cli.explain import _when
    from store.db import StoreError, opened

    settings = load_settings(args)
    cfg = settings.controller.bundles
    since = args.since
    if since is None and args.from_ is None:
        since = f"{cfg.window_s:g}s"
    try:
        lo, hi = resolve_range(time.time(), since=since, from_=args.from_, until=args.until)
        limits = _limits(args, cfg)
    except BadRange as exc:
        return fail("bundle", f"--{exc.param}: {exc.reason}", 2)
    out = Path(args.out or cfg.dir)
    url = args.store or settings.store.url
    try:
        with opened(url) as sessions:
            w = write_bundle(
                sessions,
                settings,
                lo,
                hi,
                out,
                name=range_bundle_name(lo, hi),
                limits=limits,
                require_data=True,
            )
    except NoData:
        return fail("bundle", f"nothing stored from {_when(lo)} to {_when(hi)}")
    except BundleError as exc:
        return fail("bundle", str(exc))
    except StoreError as exc:
        return fail("bundle", f"the store cannot be read: {exc}")
    print(w.path)
    for note in w.manifest.get("notes", []):
        print(f"  note: {note}", file=sys.stderr)
    return 0
