"""Several proxy processes on one host and one port (``pdscope proxy --workers N``).

One Python process is one core's worth of proxy. ``--workers N`` starts N processes that
each bind the same address with ``SO_REUSEPORT`` (the kernel spreads new connections over
them) and each poll the controller as their own proxy, id ``<proxy.id>/w<i>``: the controller
counts them as N proxies, so together they hold this host's part of every pool's limit, and
a busier worker gets a bigger part. Set ``proxy.expected_replicas`` to the number of proxy
processes in the fleet (hosts x workers), the divisor a process uses while it has no part.

``/metrics`` and ``/healthz`` on the shared port reach whichever worker the kernel picks;
``--worker-admin-port BASE`` also serves worker *i* alone on ``BASE + i``, for Prometheus to
scrape each one.

The parent only supervises: a worker that exits is started again (at most
``RESTARTS_PER_MINUTE`` times a minute, then the parent stops all and exits 1, so the
orchestrator sees the crash loop); SIGTERM or SIGINT stops every worker and the parent
returns when they have.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
import time
from collections import deque
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import Any

from pdscope.config import Settings

log = logging.getLogger(__name__)

RESTARTS_PER_MINUTE = 5
STOP_GRACE_S = 15.0


def worker_id(settings: Settings, index: int) -> str:
    base = settings.proxy.id or f"{socket.gethostname()}:{settings.proxy.port}"
    return f"{base}/w{index}"


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket that other processes may bind too (``SO_REUSEPORT``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _worker(settings: Settings, index: int, upstream_client: str, admin_port: int | None) -> None:
    from proxy.cli import serve

    proxy = settings.proxy.model_copy(update={"id": worker_id(settings, index)})
    mine = settings.model_copy(update={"proxy": proxy})
    sockets = [reuseport_socket(proxy.host, proxy.port)]
    if admin_port is not None:
        sockets.append(reuseport_socket(proxy.host, admin_port + index))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us with SIGTERM
    serve(mine, upstream_client, sockets)


def supervise(settings: Settings, n: int, upstream_client: str, admin_port: int | None = None) -> int:
    """Run ``n`` workers until SIGTERM/SIGINT (0) or a crash loop (1)."""
    ctx = multiprocessing.get_context("spawn")
    stopping = False

    def stop(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def start(i: int) -> BaseProcess:
        p = ctx.Process(
            target=_worker, args=(settings, i, upstream_client, admin_port), name=f"proxy-w{i}", daemon=False
        )
        p.start()
        log.info("proxy worker %s started (pid %s)", worker_id(settings, i), p.pid)
        return p

    workers = {i: start(i) for i in range(n)}
    restarts: deque[float] = deque()
    rc = 0
    while not stopping:
        wait([p.sentinel for p in workers.values()], timeout=0.5)
        for i, p in list(workers.items()):
            if p.is_alive() or stopping:
                continue
            now = time.monotonic()
            while restarts and now - restarts[0] > 60:
                restarts.popleft()
            if len(restarts) >= RESTARTS_PER_MINUTE:
                log.error(
                    "proxy worker %s exited (code %s), the %dth restart within a minute: stopping",
                    worker_id(settings, i),
                    p.exitcode,
                    len(restarts) + 1,
                )
                stopping, rc = True, 1
                break
            log.warning(
                "proxy worker %s exited (code %s): starting it again", worker_id(settings, i), p.exitcode
            )
            restarts.append(now)
            workers[i] = start(i)
    for p in workers.values():
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in workers.values():
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    return rc
