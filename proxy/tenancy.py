"""Tenants in the request flow (``tenants.enabled``): identity, limits, the fair queue and their metrics.

:class:`Tenancy` is what :class:`proxy.flow.Flow` calls on its way: :meth:`resolve` (the tenant, or
a 400), :meth:`check_limits` (a 429 ``tenant_rate`` / ``tenant_quota`` with ``Retry-After``), then
admission through the fair queue (``proxy.fairqueue``, inside :class:`proxy.admission.Admission`),
and the counts of what became of each request. ``demand`` counts each tenant's requests since start:
the proxy's report to the controller (``pdscope.routing.ProxyReport.tenants``), which answers with
the scale of each tenant's weight here (:meth:`proxy.fairqueue.FairQueue.scale`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from pdscope import semconv as sc
from pdscope.config.tenants import TenantSettings
from proxy.context import requested_tokens
from proxy.fairqueue import REASON_RESERVE, REASON_SHED, REASON_TENANT_QUEUE_FULL, FairQueue
from proxy.request import RequestState, client_error
from proxy.tenantlimits import REASON_TENANT_QUOTA, TenantLimits
from proxy.tenantmetrics import TenantMetrics
from proxy.tenants import Identify

DEFAULT_DECODE_CHARGE = 256  # decode tokens charged to a request without max_tokens (until it ends)
TENANT_REASONS = ("tenant_rate", REASON_TENANT_QUOTA, REASON_TENANT_QUEUE_FULL, REASON_SHED, REASON_RESERVE)


def decode_tokens(endpoint: str, body: Mapping[str, Any]) -> int:
    """The decode tokens a request is charged at admission: its ``max_tokens``, else the default."""
    asked = requested_tokens(endpoint, body)
    return DEFAULT_DECODE_CHARGE if asked is None else asked[1]


class Tenancy:
    def __init__(
        self, ts: TenantSettings, fair: FairQueue, registry: CollectorRegistry, clock: Callable[[], float]
    ) -> None:
        self.settings = ts
        self.identify = Identify(ts)
        self.limits = TenantLimits(ts, clock)
        self.fair = fair
        self.metrics = TenantMetrics(registry, fair)
        self.demand: Counter[str] = Counter()
        m = self.metrics  # children bound once per declared tenant: the request path only looks them up
        self._admitted = {t: m.admitted.labels(t) for t in ts.tenants}
        self._queued = {t: m.queued.labels(t) for t in ts.tenants}
        self._prompt = {t: m.tokens.labels(t, "prompt") for t in ts.tenants}
        self._output = {t: m.tokens.labels(t, "output") for t in ts.tenants}

    def resolve(self, headers: Mapping[bytes, bytes]) -> str:
        """The request's tenant; raises a 400 ClientError for a problem with ``unknown: refuse``."""
        ident = self.identify(headers.get(self.identify.header))
        if ident.problem is not None:
            self.metrics.unresolved.labels(ident.problem).inc()
            if self.identify.refuse:
                raise client_error(
                    400,
                    self.identify.message(ident.problem),
                    "invalid_request_error",
                    sc.OUTCOME_CLIENT_ERROR,
                    "invalid_tenant",
                    param=self.settings.header if not self.identify.by_key else "authorization",
                )
        self.demand[ident.tenant] += 1
        return ident.tenant

    def check_limits(self, req: RequestState) -> None:
        """Take the request from its tenant's rate and quota, or raise their 429."""
        refusal = self.limits.check(req.tenant, req.tokens + req.decode_tokens)
        if refusal is None:
            return
        self.rejected(req.tenant, refusal.reason)
        wait = min(max(math.ceil(refusal.retry_after_s), 1), 3600)
        what = "requests per second" if refusal.reason != REASON_TENANT_QUOTA else "tokens per minute"
        raise client_error(
            429,
            f"tenant {req.tenant!r} is over its {what}; retry in {wait} s",
            "rate_limit_error",
            "rejected",
            refusal.reason,
            [(b"retry-after", str(wait).encode())],
        )

    def admitted(self, req: RequestState, queued_s: float) -> None:
        self._admitted[req.tenant].inc()
        self._queued[req.tenant].observe(max(0.0, queued_s))
        self._prompt[req.tenant].inc(req.tokens)

    def client_priority(self, tenant: str) -> None:
        """A request of ``tenant`` came with its own ``priority``, removed (``proxy.priority``)."""
        self.metrics.client_priority.labels(tenant).inc()

    def rejected(self, tenant: str, reason: str) -> None:
        self.metrics.rejections.labels(tenant, reason).inc()

    def ended(self, req: RequestState) -> None:
        """An admitted request's output tokens (when its answer's usage said)."""
        if req.charged is not None and req.completion_tokens:
            self._output[req.tenant].inc(req.completion_tokens)

    def scale(self, scales: Mapping[str, float]) -> None:
        self.fair.scale(scales)
        self.limits.scale(scales)


def tenant_message(reason: str, tenant: str) -> str | None:
    """A tenant reason's 429 text, None for the pools' reasons."""
    if reason == REASON_TENANT_QUEUE_FULL:
        return f"tenant {tenant!r} has as many requests waiting as its queue holds; retry later"
    if reason == REASON_SHED:
        return "this request waited and gave way to a request of a higher priority class; retry later"
    if reason == REASON_RESERVE:
        return (
            f"tenant {tenant!r} fills the prefill queues as deep as it may while others are served "
            "(tenants.reserve); retry later"
        )
    return None
