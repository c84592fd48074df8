"""pdscope: observe and steer vLLM prefill/decode (P/D) disaggregated fleets.

This package is two floors. The kernel, imported by every service: the config file
(``pdscope.config``) and the wire contracts that let the proxy, the collector and the
controller agree without importing each other (``pdscope.routing``, ``pdscope.semconv``),
plus small shared helpers (``pdscope.generated``); it imports no service and no store.
The roof, ``pdscope.cli``: the command line, the demo and the db and config commands,
which sit above every service and which nothing else imports.
"""

__version__ = "0.1.0"
