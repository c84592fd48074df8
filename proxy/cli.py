"""``pdscope proxy``: flags, then run the proxy under uvicorn (httptools, uvloop, no access log).

Import-light: only argparse and the config at module level.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from pdscope.config import Settings

if TYPE_CHECKING:
    from proxy.app import ProxyApp


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="bind address (default: proxy.host)")
    parser.add_argument("--port", type=int, help="port (default: proxy.port)")
    parser.add_argument(
        "--policy",
        choices=["weighted", "round-robin"],
        help="instance selection: weighted power-of-two-choices (default: proxy.policy) or "
        "round-robin like vLLM's toy proxy",
    )
    parser.add_argument("--controller-url", help="where GET /v1/routing is polled (default: from the config)")
    parser.add_argument("--otlp-endpoint", help="OTLP/HTTP traces endpoint (default: the collector)")
    parser.add_argument("--no-tracing", action="store_true", help="emit no spans")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="proxy processes on this port (SO_REUSEPORT), each its own proxy id <proxy.id>/w<i> "
        "with its own part of the limits (default 1: this process serves)",
    )
    parser.add_argument(
        "--worker-admin-port",
        type=int,
        help="with --workers: worker i also serves alone on this port + i (scrape each one's /metrics)",
    )
    parser.add_argument(
        "--upstream-client",
        choices=["lean", "httpx"],
        default="lean",
        help=(
            "HTTP client for P and D calls: pdscope's lean keep-alive client (default) "
            "or httpx (for comparison)"
        ),
    )


def apply_overrides(settings: Settings, args: argparse.Namespace) -> Settings:
    """The config with the command-line flags applied (still validated and frozen)."""
    update: dict[str, object] = {}
    for flag, key in (
        ("host", "host"),
        ("port", "port"),
        ("policy", "policy"),
        ("controller_url", "controller_url"),
        ("otlp_endpoint", "otlp_endpoint"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            update[key] = value
    if getattr(args, "no_tracing", False):
        update["tracing"] = False
    if not update:
        return settings
    proxy = settings.proxy.model_validate({**settings.proxy.model_dump(), **update})
    return settings.model_copy(update={"proxy": proxy})


def run(args: argparse.Namespace) -> int:
    from pdscope.config import load_settings

    settings = apply_overrides(load_settings(args), args)
    workers = getattr(args, "workers", 1) or 1
    admin_port = getattr(args, "worker_admin_port", None)
    if workers < 1 or workers > 256:
        raise SystemExit("--workers: between 1 and 256")
    if admin_port is not None and (workers == 1 or not 1 <= admin_port <= 65535 - workers):
        raise SystemExit("--worker-admin-port: needs --workers > 1 and room for one port per worker")
    if workers > 1:
        import logging

        from proxy.workers import supervise

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return supervise(settings, workers, args.upstream_client, admin_port)
    serve(settings, args.upstream_client)
    return 0


def serve(settings: Settings, upstream_client: str, sockets: list[Any] | None = None) -> None:
    """Run one proxy process until it is stopped (on ``sockets`` when given, else on host:port)."""
    from proxy.app import build

    if settings.proxy.tracing:
        import sys

        # The span exporter thread encodes batches while holding the GIL; a 1 ms switch
        # interval (Python's default: 5 ms) bounds how long a request waits behind it.
        sys.setswitchinterval(0.001)
    serve_app(build(settings, upstream_client=upstream_client), settings, sockets)


def serve_app(
    app: ProxyApp, settings: Settings, sockets: list[Any] | None = None, *, graceful_s: float = 10.0
) -> None:
    """Run a built proxy app until it is stopped, as ``pdscope proxy`` serves it (uvloop when built,
    httptools with the client read bound counted in the app's metrics, no access log); open streams
    get ``graceful_s`` at shutdown, then are closed. Blocks; raises what uvicorn raises."""
    import uvicorn

    from proxy.server import uvicorn_config

    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:  # uvloop is not built for every platform
        loop = "asyncio"
    config = uvicorn_config(
        app,
        settings.proxy.host,
        settings.proxy.port,
        loop=loop,
        read_timeout_s=settings.proxy.client_read_timeout_s,
        on_read_timeout=lambda phase: app.parts.metrics.client_read_timeouts.labels(phase).inc(),
        log_level="warning",
        timeout_keep_alive=30,
        timeout_graceful_shutdown=graceful_s,
    )
    uvicorn.Server(config).run(sockets=sockets)
