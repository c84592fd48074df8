"""``pdscope db upgrade|downgrade|check|current``: manage the store's schema."""

from __future__ import annotations

import argparse
import sys

from pdscope.config import load_settings
from store import migrate
from store.db import StoreError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="store URL (default: store.url from the config)")
    sub = parser.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    up = sub.add_parser("upgrade", help="apply migrations up to a revision (default head)")
    up.add_argument("revision", nargs="?", default="head")
    down = sub.add_parser("downgrade", help="revert migrations down to a revision (default base)")
    down.add_argument("revision", nargs="?", default="base")
    sub.add_parser("check", help="fail if the models and the migrations differ")
    sub.add_parser("current", help="show the store's current revision")


def run(args: argparse.Namespace) -> int:
    url = args.url or load_settings(args).store.url
    try:
        if args.db_command == "upgrade":
            migrate.upgrade(url, args.revision)
        elif args.db_command == "downgrade":
            migrate.downgrade(url, args.revision)
        elif args.db_command == "check":
            migrate.check(url)
        else:
            migrate.current(url)
    except StoreError as exc:
        print(f"pdscope db {args.db_command}: {exc}", file=sys.stderr)
        return 1
    if args.db_command in ("upgrade", "downgrade", "check"):
        print(f"pdscope db {args.db_command}: ok")
    return 0
