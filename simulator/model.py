"""The simulator engine's values and seams: requests, KV transfers and the protocols
the engine talks through (fabric, faults, observer), with null implementations.

Values only, plus ``RemoteKV.from_params`` which validates P's ``kv_transfer_params`` as
vLLM's D does. No clock, no I/O; the behaviour lives in engine.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

logger = logging.getLogger(__name__)

STAGES = ("waiting_to_start", "in_progress", "completed_waiting")
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
_REQUIRED_REMOTE_KEYS = (
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
)
PUSH_REGISTRATION = "push_registration"  # a Transfer's reason: D's registration failed or timed out
# what vLLM's push-mode D reads from the params when it registers its blocks with P (without
# remote_request_id, vLLM 0.32.0's D engine dies of a KeyError; here the params are refused)
_REQUIRED_PUSH_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size")


@dataclass(frozen=True)
class RemoteKV:
    """What D needs to pull a request's KV from P (taken from P's kv_transfer_params)."""

    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int
    num_tokens: int | None = None
    tp_size: int = 1
    # pull: D reads P's blocks; push: D registers its blocks with P, which writes into them (and
    # ``request_id`` is P's, once the fabric matched the registration to P's finished request)
    mode: str = "pull"

    @classmethod
    def from_params(cls, params: dict[str, Any] | None, mode: str = "pull") -> RemoteKV | None:
        """None unless the params ask for a remote prefill with every key vLLM's D requires (push
        mode: P's coordinates only; P's block and request ids are learned when P writes)."""
        if not params or not params.get("do_remote_prefill"):
            return None
        if mode == "push":
            return cls._push(params)
        if any(params.get(key) is None for key in _REQUIRED_REMOTE_KEYS):
            logger.warning("Got invalid KVTransferParams: %s", sorted(params))
            return None
        groups = params["remote_block_ids"]
        blocks: list[int] = []
        for group in groups if isinstance(groups, list) else []:
            if isinstance(group, list):
                blocks.extend(int(b) for b in group)
            else:
                blocks.append(int(group))
        return cls(
            engine_id=str(params["remote_engine_id"]),
            request_id=str(params["remote_request_id"]),
            block_ids=tuple(blocks),
            host=str(params["remote_host"]),
            port=int(params["remote_port"]),
            num_tokens=params.get("remote_num_tokens"),
            tp_size=int(params.get("tp_size") or 1),
        )

    @classmethod
    def _push(cls, params: dict[str, Any]) -> RemoteKV | None:
        if any(params.get(key) is None for key in _REQUIRED_PUSH_KEYS):
            logger.warning("Got invalid KVTransferParams: %s", sorted(params))
            return None
        return cls(
            engine_id=str(params["remote_engine_id"]),
            request_id=str(params["remote_request_id"]),
            block_ids=(),
            host=str(params["remote_host"]),
            port=int(params["remote_port"]),
            tp_size=int(params["tp_size"]),
            mode="push",
        )


@dataclass(frozen=True)
class Transfer:
    """One planned NIXL READ: ``ok`` is decided when it is posted, known at ``done_at``."""

    ok: bool
    done_at: float
    xfer_s: float
    post_s: float
    nbytes: int
    descriptors: int
    reason: str = ""


class KVFabric(Protocol):
    """How a D engine reaches P engines (the simulated NIXL + side channel)."""

    def start_pull(self, d_name: str, remote: RemoteKV, num_blocks: int, now: float) -> Transfer: ...

    def finish_pull(self, remote: RemoteKV, now: float) -> None: ...

    def heartbeat(self, remotes: Iterable[RemoteKV], now: float) -> None: ...

    def register_push(self, d: Any, req: SimRequest, num_blocks: int, now: float) -> Transfer | None: ...

    def push_ready(self, p: Any, req: SimRequest, now: float) -> None: ...

    def push_written(self, remote: RemoteKV, t: Transfer, now: float) -> None: ...

    def push_forget(self, p: Any, internal_id: str) -> None: ...


class FaultView(Protocol):
    def compute_factor(self, name: str) -> float: ...

    def kv_capacity(self, name: str, default: int) -> int: ...

    def stops_pulling(self, name: str) -> bool: ...

    def leases_stalled(self, name: str) -> bool: ...


class EngineObserver(Protocol):
    """Receives the engine's events; the Prometheus side lives in metrics.py."""

    def admitted(self, req: SimRequest) -> None: ...

    def first_token(self, req: SimRequest, now: float) -> None: ...

    def inter_token(self, seconds: float) -> None: ...

    def step(self, num_tokens: int, generated: int) -> None: ...

    def finished(self, req: SimRequest, now: float) -> None: ...

    def preempted(self) -> None: ...

    def transfer_done(self, t: Transfer) -> None: ...

    def transfer_failed(self) -> None: ...

    def kv_expired(self) -> None: ...

    def notification_after_expiry(self) -> None: ...


class NullObserver:
    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


class NoFaults:
    def compute_factor(self, name: str) -> float:
        return 1.0

    def kv_capacity(self, name: str, default: int) -> int:
        return default

    def stops_pulling(self, name: str) -> bool:
        return False

    def leases_stalled(self, name: str) -> bool:
        return False


@dataclass(eq=False)
class SimRequest:
    """One request inside an engine. Mutable; only the engine changes its state."""

    request_id: str  # external id (gen_ai.request.id)
    internal_id: str  # engine id: external id + "-<8 hex>"; P returns it as remote_request_id
    prompt_tokens: int
    max_tokens: int
    arrival: float
    params_max_tokens: int | None = None
    n: int = 1
    stop_at_max: bool = False  # no max_tokens given: the output ends with "stop"
    do_remote_decode: bool = False
    remote: RemoteKV | None = None
    token_ids: tuple[int, ...] | None = None  # the prompt's ids; None: unknown, nothing cached for it
    lora: str | None = None
    priority: int = 0  # the body's priority (vLLM: lower first; read only under the priority policy)
    notify: Callable[[SimRequest], None] | None = None
    # state
    kv_stage: str | None = None
    computed: int = 0
    target: int = 0
    generated: int = 0
    blocks: list[int] = field(default_factory=list)
    queued_ts: float = 0.0
    scheduled_ts: float | None = None
    first_token_ts: float | None = None
    last_token_ts: float | None = None
    finished_ts: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    external_tokens: int = 0  # D: prompt tokens pulled from P
    local_cached_tokens: int = 0  # prompt tokens found in this engine's own prefix cache at admission
    block_hashes: list[int] | None = None  # chain hashes of the prompt's full blocks (the engine fills it)
    stored_blocks: int = 0  # how many of ``blocks`` from the first are cached (hits or stored)
    transfer: Transfer | None = None
    leased_block_ids: tuple[int, ...] = ()  # P: the blocks held for D under the lease

    def __post_init__(self) -> None:
        self.target = self.prompt_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cached_tokens(self) -> int:
        """What vLLM reports as ``num_cached_tokens`` (usage ``prompt_tokens_details.cached_tokens``): the
        tokens computed before the first step, local hits plus, on D, the tokens pulled from P."""
        return self.local_cached_tokens + self.external_tokens
