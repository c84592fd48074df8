"""What a request costs its tenant, in tokens: the one home of the fair queue's charge
(``proxy.fairqueue``) and of the service figures read from the records (``analysis.tenants``).

P's part is the prompt tokens it computes. D's part is its decode steps, ``decode`` each
(``tenants.cost_per_decode_token``), and the KV it holds times the steps it holds it, ``kv`` per
token-step (``tenants.cost_per_kv_token_step``): a request of ``L`` tokens of context decoding ``D``
tokens holds ``L`` before its first step and one more after each, ``D x L + D (D + 1) / 2`` in all.
"""

from __future__ import annotations

from typing import NamedTuple

from pdscope.config.tenants import TenantSettings


def kv_token_steps(context: int, decode: int) -> int:
    """The KV a request holds in D times the decode steps it holds it, in token-steps."""
    decode = max(0, decode)
    return decode * max(0, context) + decode * (decode + 1) // 2


class Costs(NamedTuple):
    decode: float = 1.0  # a decode step, against a prompt token
    kv: float = 1 / 2048  # a token of KV held for one decode step

    @classmethod
    def of(cls, ts: TenantSettings) -> Costs:
        return cls(ts.cost_per_decode_token, ts.cost_per_kv_token_step)

    def d(self, context: int, decode: int) -> float:
        """D's part of a request's cost (without a prefill D computes itself)."""
        return self.decode * max(0, decode) + self.kv * kv_token_steps(context, decode)


DEFAULT_COSTS = Costs()
