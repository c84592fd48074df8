"""pdscope: observe and steer vLLM prefill/decode (P/D) disaggregated fleets.

This package holds what every service shares and nothing service-specific: the
config file (``pdscope.config``), the CLI, and the wire contracts that let the proxy,
the collector and the controller agree without importing each other
(``pdscope.routing``, ``pdscope.semconv``).
"""

__version__ = "0.1.0"
