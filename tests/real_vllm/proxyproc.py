"""``pdscope proxy`` as a process in front of a real pair (no controller: equal weights)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pdscope.stack import Child
from tests.real_vllm.pair import RealPair
from tests.support.sockets import free_port

TIMEOUTS = {"connect_s": 5, "prefill_s": 60, "decode_first_token_s": 60, "decode_total_s": 120}


@contextmanager
def running_proxy(pair: RealPair, tmp: Path, otlp_url: str | None = None) -> Iterator[str]:
    """The proxy's base URL while it runs; its log is ``tmp/proxy.log``."""
    port = free_port()
    proxy: dict[str, object] = {
        "port": port,
        "controller_url": f"http://127.0.0.1:{free_port()}",  # no controller: equal weights
        "timeouts": TIMEOUTS,
    }
    if otlp_url is not None:
        proxy.update(otlp_endpoint=otlp_url, tracing=True)
    config = pair.write_config(tmp / "pdscope.yaml", proxy=proxy)
    pdscope = str(Path(sys.executable).with_name("pdscope"))
    url = f"http://127.0.0.1:{port}"
    child = Child(
        "pdscope proxy",
        [pdscope, "--config", str(config), "--log-level", "WARNING", "proxy"],
        tmp / "proxy.log",
        ready_url=url + "/healthz",
    )
    child.start()
    try:
        child.wait_ready(30, ready=lambda r: r.status_code == 200)
        yield url
    finally:
        child.stop(grace_s=15)
