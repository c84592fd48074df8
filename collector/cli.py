"""``pdscope collect``: run the scraper, the OTLP receiver and retention in one process.

Refuses to start on a non-loopback ``collector.host`` without OTLP tokens
(``collector.otlp_tokens_env``), before touching the store.

Import-light on purpose: the service (httpx, uvicorn, SQLAlchemy) is imported in ``run``.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdscope.config import Settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="receiver address (default: collector.host)")
    parser.add_argument(
        "--port", type=int, help="receiver port, 0 for any free one (default: collector.port)"
    )
    parser.add_argument("--store-url", help="store URL (default: store.url)")
    parser.add_argument(
        "--prometheus-url",
        help=(
            "read vLLM's series from this Prometheus instead of scraping (default: collector.prometheus_url)"
        ),
    )
    parser.add_argument(
        "--no-migrate",
        action="store_true",
        help="do not apply the store's migrations at start (default: apply them)",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help="stop after this many seconds (default: run until Ctrl-C)",
    )


def run(args: argparse.Namespace) -> int:
    import sys

    from collector.service import InsecureBind, check_bind
    from pdscope.config import ConfigError

    settings = _settings(args)
    try:
        tokens = settings.collector.otlp_tokens()
        check_bind(settings.collector.host, tokens, settings.collector.otlp_tokens_env)
    except (ConfigError, InsecureBind) as exc:
        print(f"pdscope collect: {exc}", file=sys.stderr)
        return 1
    if not args.no_migrate and not _migrate(settings.store.url):
        return 1
    return _serve(args, settings, tokens)


def _settings(args: argparse.Namespace) -> Settings:
    """The config file's settings with the command line's overrides."""
    from pdscope.config import load_settings

    settings = load_settings(args)
    if args.host is not None:
        settings = settings.model_copy(
            update={"collector": settings.collector.model_copy(update={"host": args.host})}
        )
    if args.prometheus_url:
        collector = settings.collector.model_copy(update={"prometheus_url": args.prometheus_url.rstrip("/")})
        settings = settings.model_copy(update={"collector": collector})
    if args.store_url:
        settings = settings.model_copy(
            update={"store": settings.store.model_copy(update={"url": args.store_url})}
        )
    return settings


def _migrate(url: str) -> bool:
    """Apply the store's migrations; False (said on stderr) when the store cannot be prepared."""
    import sys
    import time

    from store import migrate
    from store.db import StoreError

    # Another service (the controller) may be migrating the same store at this moment:
    # a second try finds it at head.
    for attempt in range(3):
        try:
            migrate.upgrade(url)
            break
        except StoreError as exc:
            if attempt == 2:
                print(f"pdscope collect: cannot prepare the store: {exc}", file=sys.stderr)
                return False
            time.sleep(1.0)
    return True


def _serve(args: argparse.Namespace, settings: Settings, tokens: Mapping[str, str]) -> int:
    """Run the collector until Ctrl-C, SIGTERM or ``--duration``; 1 when its socket fails."""
    import asyncio
    import logging

    from collector.service import CollectorService
    from pdscope.runmain import run_main, stop_on_signals

    log = logging.getLogger("collector")

    async def main() -> None:
        stop = asyncio.Event()
        stop_on_signals(stop)
        if args.duration is not None:
            asyncio.get_running_loop().call_later(args.duration, stop.set)
        service = CollectorService(settings, port=args.port, otlp_tokens=tokens)
        log.info("pdscope collect: receiver on http://%s:%d", settings.collector.host, service.port)
        await service.run(stop)

    return run_main(main, "pdscope collect")
