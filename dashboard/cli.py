"""``pdscope dashboard``: start the Streamlit app on ``dashboard.host:port``, headless.

It runs ``python -m streamlit run dashboard/app.py -- --config <path>`` as a child
process and waits for it; Ctrl-C or SIGTERM stops the child. The config is validated here first
so a bad file fails fast with the usual one-line-per-problem message. Like the controller, it
refuses a non-loopback address unless ``dashboard.auth`` identifies users (login or header).
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
from pathlib import Path

from pdscope.config import is_loopback, resolve_config_path

log = logging.getLogger(__name__)
APP = Path(__file__).resolve().parent / "app.py"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="bind address (default: dashboard.host from the config)")
    parser.add_argument("--port", type=int, help="port (default: dashboard.port from the config)")


def streamlit_command(config_path: Path, host: str, port: int, python: str = sys.executable) -> list[str]:
    """The child command line (exposed for tests)."""
    return [
        python,
        "-m",
        "streamlit",
        "run",
        str(APP),
        "--server.address",
        host,
        "--server.port",
        str(port),
        "--server.headless",
        "true",
        "--server.fileWatcherType",
        "none",
        "--browser.gatherUsageStats",
        "false",
        "--",
        "--config",
        str(config_path),
    ]


def check_listen(host: str, auth: str) -> str | None:
    """A reason to refuse to start, or None: off loopback, every user must be identified."""
    if not is_loopback(host) and auth not in ("login", "header"):
        return (
            f"refusing to listen on {host} (not loopback) with dashboard.auth: {auth}: set dashboard.auth "
            "to login (each user signs in with their controller API token) or header (behind an auth "
            "proxy that sets dashboard.identity_header), or bind 127.0.0.1"
        )
    return None


def run(args: argparse.Namespace) -> int:
    from pdscope.config import load_settings

    settings = load_settings(args)  # raises ConfigError: reported by pdscope.cli
    config_path = resolve_config_path(args.config).resolve()
    host = args.host or settings.dashboard.host
    port = args.port or settings.dashboard.port
    refusal = check_listen(host, settings.dashboard.auth)
    if refusal:
        print(f"pdscope dashboard: {refusal}", file=sys.stderr)
        return 1
    cmd = streamlit_command(config_path, host, port)
    log.info("dashboard on http://%s:%s (config %s)", host, port, config_path)
    proc = subprocess.Popen(cmd)
    # A SIGTERM to us (a supervisor, `pdscope demo`) stops the child too.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: proc.terminate())
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return 130
