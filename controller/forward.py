"""A standby hands an operator change to the leader (``controller.forward_changes``).

Every replica authenticates a change first (the guard). A standby then sends it on, once, to
the leader's API address, which the leader keeps with its leadership in the store
(:func:`controller.leader.leader_url`): the same method, path, query, body, ``Authorization``
and ``X-Actor``, marked ``X-Pdscope-Forwarded-By`` so that it is never forwarded again (a
leader that has just lost its lock answers 409 itself). The leader's answer is relayed as it
is, with ``X-Pdscope-Forwarded-To``. When the leader cannot be reached within the timeout the
standby answers its own 409 naming the leader, saying the forward failed.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterator

import httpx
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

log = logging.getLogger(__name__)

FORWARDED_BY = "x-pdscope-forwarded-by"
FORWARDED_TO = "x-pdscope-forwarded-to"
_PASSED = ("authorization", "x-actor", "content-type", "accept")
MUTATIONS = ("POST", "PUT", "PATCH", "DELETE")


class Forwarder(Collector):
    def __init__(self, me: str | None, timeout_s: float = 5.0) -> None:
        self.me = me
        self.timeout_s = timeout_s
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def wanted(self, request: Request, leader: str | None) -> bool:
        return (
            leader is not None
            and leader != self.me
            and request.method in MUTATIONS
            and FORWARDED_BY not in request.headers
        )

    async def forward(self, request: Request, leader: str) -> Response | str:
        """The leader's answer, or why it could not be had."""
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k in _PASSED}
        headers[FORWARDED_BY] = self.me or "a standby"
        url = leader.rstrip("/") + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                resp = await client.request(request.method, url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            self._count("failed")
            log.warning(
                "forwarding %s %s to the leader at %s failed: %s",
                request.method,
                request.url.path,
                leader,
                exc,
            )
            return f"forwarding to the leader at {leader} failed ({type(exc).__name__})"
        self._count("forwarded")
        log.info(
            "forwarded %s %s to the leader at %s: %s",
            request.method,
            request.url.path,
            leader,
            resp.status_code,
        )
        out = {
            k: v for k, v in resp.headers.items() if k in ("content-type", "retry-after", "www-authenticate")
        }
        out[FORWARDED_TO] = leader
        return Response(resp.content, status_code=resp.status_code, headers=out)

    def _count(self, outcome: str) -> None:
        with self._lock:
            self.counts[outcome] += 1

    def collect(self) -> Iterator[Metric]:
        m = CounterMetricFamily(
            "pdscope_controller_changes_forwarded",
            "Operator changes a standby sent on to the leader, by outcome "
            "(forwarded; failed: it answered 409).",
            labels=["outcome"],
        )
        for outcome in ("forwarded", "failed"):
            m.add_metric([outcome], float(self.counts.get(outcome, 0)))
        yield m
