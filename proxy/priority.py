"""The ``priority`` a request carries into the priority-scheduled instances (vLLM ``--scheduling-policy
priority``), with tenants on.

vLLM's priority policy orders its waiting queue by (priority, arrival), the lower priority first, and under
a KV shortage preempts the running request of the largest (priority, arrival). Its fcfs policy (the
default) takes a request's ``priority`` and ignores it (0.32.0; older versions refused one other than 0).
So the proxy sends ``priority`` only to the instances the config declares priority-scheduled
(``pools.<pool>.scheduling``, an instance's own ``scheduling``), on P's leg and D's alike.

**The value** is ``CLASS_STEP x rank + over``: the tenant's class rank (0 for ``tenants.classes``' first)
and, within the class, 1 when the tenant was served past its weight's share among the busy tenants of its
class lately (:meth:`proxy.fairqueue.FairQueue.over_share`, the test of the reserve line), else 0. So
every class goes before the next, and within a class a tenant within its share goes before one past it;
arrival decides the rest, as vLLM does. Taken at each try at admission, kept for the request's legs and
retries. Bounded to vLLM's int64 (:data:`INT64_MAX`), which a class rank of at most 64 never reaches.

**Never the client's.** With tenants on a client must not choose its own place in P's queue (a
``priority`` of -1000 would pass every class): the body's ``priority`` is removed before anything is sent
(``pdscope_proxy_tenant_client_priority_total{tenant}`` counts them), and only the proxy's goes to
priority-scheduled instances. With tenants off the body goes as it came.
"""

from __future__ import annotations

import json
from typing import Any

INT64_MAX = 2**63 - 1  # vLLM's bound of a request's priority
CLASS_STEP = 2  # priorities per class: within its share, past it
FIELD = "priority"


def request_priority(rank: int, over_share: bool) -> int:
    """The priority of a request of a tenant of class ``rank`` (0: the highest), past its share or not."""
    return min(max(rank, 0) * CLASS_STEP + int(over_share), INT64_MAX)


def without_client_priority(body: dict[str, Any], raw: bytes) -> tuple[bytes, bool]:
    """Remove the client's ``priority`` from ``body`` (in place); the bytes D gets as they came (``raw``),
    re-encoded only when there was one; and whether there was."""
    if FIELD not in body:
        return raw, False
    del body[FIELD]
    return json.dumps(body).encode(), True


def with_priority(body: bytes, priority: int) -> bytes:
    """A JSON object's bytes (without a ``priority``: :func:`without_client_priority`) with ``priority``
    added, without decoding it: the proxy's own integer before the closing brace."""
    body = body.rstrip()
    head = body[:-1].rstrip()
    sep = b"" if head.endswith(b"{") else b", "
    return b"".join((head, sep, b'"priority": ', str(priority).encode(), b"}"))
