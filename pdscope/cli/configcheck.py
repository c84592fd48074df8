"""``pdscope config check FILE``: validate a config file, one line per problem."""

from __future__ import annotations

import argparse
import sys

from pdscope.config import ConfigError, Settings, load_config, resolve_config_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = sub.add_parser("check", help="validate a config file")
    check.add_argument("file", nargs="?", help="defaults to --config, $PDSCOPE_CONFIG or ./pdscope.yaml")


def run(args: argparse.Namespace) -> int:
    path = args.file or str(resolve_config_path(args.config))
    try:
        settings = load_config(path)
        _policy_checks(settings, path)
    except ConfigError as exc:
        for line in exc.problems:
            print(line, file=sys.stderr)
        print(f"{path}: {len(exc.problems)} problem(s)", file=sys.stderr)
        return 1
    n_p = sum(1 for _ in settings.instances("prefill"))
    n_d = sum(1 for _ in settings.instances("decode"))
    print(f"{path}: ok ({len(settings.pools)} pools, {n_p} prefill and {n_d} decode instances)")
    return 0


def _policy_checks(settings: Settings, path: str) -> None:
    """What only the controller's policy can check: the names and values of ``controller.shadow``."""
    from controller.policy import PolicyConfig
    from controller.shadow import shadow_config

    try:
        shadow_config(PolicyConfig.from_settings(settings), settings.controller.shadow)
    except ConfigError as exc:
        raise ConfigError([f"{path}: {p}" for p in exc.problems]) from None
