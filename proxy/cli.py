"""``pdscope proxy``: flags, then run the proxy under uvicorn (httptools, uvloop, no access log).

Import-light: only argparse and the config at module level.
"""

from __future__ import annotations

import argparse

from pdscope.config import Settings


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
    import uvicorn

    from pdscope.config import load_settings
    from proxy.app import build
    from proxy.server import uvicorn_config

    settings = apply_overrides(load_settings(args), args)
    if settings.proxy.tracing:
        import sys

        # The span exporter thread encodes batches while holding the GIL; a 1 ms switch
        # interval (Python's default: 5 ms) bounds how long a request waits behind it.
        sys.setswitchinterval(0.001)
    app = build(settings, upstream_client=args.upstream_client)
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
        timeout_graceful_shutdown=10,  # open streams get this long at shutdown, then are closed
    )
    uvicorn.Server(config).run()
    return 0
