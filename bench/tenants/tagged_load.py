"""bench/proxy's load generator (``bench.proxy.loadgen``, its flags and its JSON line), each request
with a tenant header in turn: the tenants named in ``$PDSCOPE_BENCH_TENANTS`` (comma-separated), so that
the ceiling with tenants on pays for identity and the fair queue over several tenants.

Run: ``PDSCOPE_BENCH_TENANTS=a,b python -m bench.tenants.tagged_load --url URL --mode closed ...``.
"""

from __future__ import annotations

import itertools
import os
import runpy

import proxy.upstream as upstream
from bench.tenants.scenarios import HEADER

TENANTS_ENV = "PDSCOPE_BENCH_TENANTS"


class TaggedUpstream(upstream.Upstream):
    """pdscope's lean upstream client, adding the next tenant's header to every POST."""

    tenants = itertools.cycle([t for t in os.environ.get(TENANTS_ENV, "default").split(",") if t])

    async def post(
        self, base_url: str, path: str, body: bytes, headers: upstream.HeaderPairs = (), *, within_s: float
    ) -> upstream.Response:
        tagged = (*headers, (HEADER, next(self.tenants)))
        return await super().post(base_url, path, body, tagged, within_s=within_s)


if __name__ == "__main__":
    upstream.Upstream = TaggedUpstream  # type: ignore[misc]  # what bench.proxy.loadgen imports
    runpy.run_module("bench.proxy.loadgen", run_name="__main__")
