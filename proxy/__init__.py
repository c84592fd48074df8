"""pdscope's proxy: the P/D data plane (prefill -> KV handoff -> decode) in front of vLLM pools.

Modules: ``app`` (pure ASGI app and assembly), ``flow`` (one request's life, failure rules)
and ``request`` (its state), ``protocol`` (vLLM's NIXL pull protocol bodies), ``upstream``
(the shared keep-alive HTTP client; ``httpx_upstream`` for comparison), ``routing`` (the
controller's table, fail-static), ``selection`` (weighted power-of-two-choices, round-robin,
retry budget), ``admission`` (per-pool backpressure), ``tracing`` (spans, bounded export),
``metrics`` (own Prometheus registry), ``cli`` (``pdscope proxy``); tenants (``tenants.enabled``):
``tenants`` (identity), ``fairqueue`` (the fair queue), ``tenantlimits`` (rate, quota),
``tenantmetrics`` and ``tenancy`` (the flow's tenant steps). Never imports the
collector or the controller; meets them in ``pdscope.routing`` and ``pdscope.semconv``.
"""
