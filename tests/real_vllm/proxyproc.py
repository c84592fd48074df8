"""``pdscope proxy`` as a process in front of a real pair (no controller: equal weights)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.real_vllm.pair import RealPair
from tests.support.sockets import free_port
from tests.support.waiting import wait_until

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
    log = (tmp / "proxy.log").open("wb")
    pdscope = str(Path(sys.executable).with_name("pdscope"))
    proc = subprocess.Popen(
        [pdscope, "--config", str(config), "--log-level", "WARNING", "proxy"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def healthz() -> int:
            assert proc.poll() is None, (tmp / "proxy.log").read_text()
            return httpx.get(url + "/healthz", timeout=1).status_code

        wait_until(
            "pdscope proxy to come up",
            healthz,
            done=lambda code: code == 200,
            timeout_s=30,
            every_s=0.2,
            ignore=(httpx.HTTPError,),
        )
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        log.close()
