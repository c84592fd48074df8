"""A vLLM-compatible simulated prefill/decode fleet, fault injection and a load generator.

Modules: ``config`` (the ``simulator:`` section), ``model`` (requests, transfers,
seams), ``engine`` (the pure batching/KV/lease model), ``fabric`` (NIXL pulls between
engines), ``faults``, ``metrics`` (vLLM's /metrics), ``server`` (vLLM's HTTP API),
``instance``/``runner``/``fleet`` (running it on asyncio), ``admin`` (live faults, loop
lag), ``tracing`` (llm_request spans), ``testing`` (``running_fleet`` for other
components' tests), ``cli``/``runtime`` (``pdscope sim``), ``load``/``loadgen``/
``workload``/``httpclient`` (``pdscope load``). It imports nothing from proxy,
collector or controller.
"""
