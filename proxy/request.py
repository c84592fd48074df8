"""One request's values as it moves through the proxy, and the errors that end it.

:class:`RequestState` is the mutable record the flow fills in (chosen instances, the pool
slots and handoff KV bytes it holds, stage, outcome, and with KV-aware routing its prompt as
the cache view keyed it and the cost model's decision); :class:`ClientError` is an answer
that ends the request; :class:`NeedsPrefill` says a retry must start from a new prefill.
No I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pdscope.config import DEFAULT_TENANT, PredictSettings, Settings
from proxy import protocol
from proxy.fairqueue import Work
from proxy.kvaware import Decision
from proxy.predict import HandoffX
from proxy.prefixview import Prompt
from proxy.protocol import PrefillAnswer
from proxy.routing import PoolLimits, Target, fallback_limits

JSON = b"application/json"
DEFAULT_PREDICT = PredictSettings()


@dataclass(frozen=True, slots=True)
class FlowSettings:
    prefill_s: float
    decode_first_token_s: float
    decode_total_s: float
    kv_bytes_per_token: int
    queue_timeout_s: float
    retry_after_s: int
    default_limits: PoolLimits
    max_prefill_attempts: int = 3
    max_decode_attempts: int = 3
    max_full_retries: int = 1
    max_model_len: int | None = None
    trace_sample_ratio: float = 1.0
    ttft_slo_s: float | None = None  # slo.ttft.target_ms in seconds: an unsampled trace over it is kept
    predict: PredictSettings = DEFAULT_PREDICT
    prefill_tokens_per_s: float = 16000.0  # the predictor's prior rate (proxy.kv_aware.prefill_tokens_per_s)
    pair_probe_s: float = 10.0  # proxy.pair_probe_s: a probe through an avoided pair at most this often
    handoff: str = "pull"  # the fleet's KV handoff mode (pools' handoff): pull or push
    push_early: bool = False  # proxy.push_early: D's leg with P's, in push mode
    priority_ps: frozenset[str] = frozenset()  # the instances vLLM schedules by priority (proxy.priority)

    @classmethod
    def from_settings(cls, s: Settings) -> FlowSettings:
        t, a = s.proxy.timeouts, s.proxy.admission
        return cls(
            prefill_s=t.prefill_s,
            decode_first_token_s=t.decode_first_token_s,
            decode_total_s=t.decode_total_s,
            kv_bytes_per_token=s.model.kv_bytes_per_token,
            queue_timeout_s=a.queue_timeout_s,
            retry_after_s=a.retry_after_s,
            default_limits=fallback_limits(s),
            max_model_len=s.proxy.max_model_len,
            trace_sample_ratio=s.proxy.trace_sample_ratio,
            ttft_slo_s=s.slo.ttft.target_ms / 1000.0,
            pair_probe_s=s.proxy.pair_probe_s,
            predict=s.proxy.predict,
            prefill_tokens_per_s=s.proxy.kv_aware.prefill_tokens_per_s,
            handoff=s.handoff,
            push_early=s.proxy.push_early,
            priority_ps=s.priority_scheduled(),
        )


class Reply(Protocol):
    """Where the answer goes (the ASGI app's ``send``)."""

    started: bool
    status: int | None  # what start() sent, None before

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    async def body(self, data: bytes, more: bool) -> None: ...


class ClientError(Exception):
    """Ends the request with this answer (when nothing was sent yet)."""

    def __init__(
        self,
        status: int,
        body: bytes,
        outcome: str,
        headers: list[tuple[bytes, bytes]] | None = None,
        content_type: bytes = JSON,
    ) -> None:
        super().__init__(body[:200].decode("utf-8", "replace"))
        self.status = status
        self.body = body
        self.outcome = outcome
        self.headers = headers or []
        self.content_type = content_type


class NeedsPrefill(Exception):
    """D failed after it may have read P's blocks: only a new prefill can retry."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class DecodeRefused(Exception):
    """D refused the request before scheduling it (HTTP 503): P's blocks are still unread."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class Gone:
    """Set by the app when the client disconnects, before it cancels the request task."""

    __slots__ = ("disconnected",)

    def __init__(self) -> None:
        self.disconnected = False


class RequestState:
    """Tenants (``proxy.tenancy``): ``tenant`` whose it is, ``decode_tokens`` the decode tokens it asks for
    (max_tokens, or the default charge), ``charged`` the work charged to its tenant while it is
    admitted (``proxy.fairqueue.Work``; None: nothing charged), ``priority`` what its legs carry to
    priority-scheduled instances (``proxy.priority``; None: tenants off)."""

    charged: Work | None
    priority: int | None
    __slots__ = (
        "admitted",
        "backlog",
        "charged",
        "completion_tokens",
        "d",
        "d_backlog",
        "d_cached_tokens",
        "d_prompt_tokens",
        "d_sent_ns",
        "d_slot",
        "decode_tokens",
        "endpoint",
        "first_token_ns",
        "handoff",
        "handoff_flying",
        "handoff_s",
        "handoff_x",
        "kv_held",
        "outcome",
        "p",
        "p_done_ns",
        "p_sent_ns",
        "p_slot",
        "predicted",
        "predicted_source",
        "predicted_sure",
        "predicted_x",
        "prefill",
        "priority",
        "prompt",
        "retries",
        "rid",
        "route",
        "route_reason",
        "sampled",
        "stage",
        "started",
        "started_ns",
        "stream",
        "target_s",
        "tenant",
        "tokens",
        "tokens_ahead",
    )

    def __init__(self, endpoint: str, rid: str) -> None:
        self.endpoint = endpoint
        self.rid = rid
        self.stream = False
        self.stage = "admission"
        self.outcome = "error"
        self.p: Target | None = None
        self.d: Target | None = None
        self.p_slot: str | None = None
        self.d_slot: str | None = None
        self.kv_held: tuple[str, str, int] | None = None
        self.retries = 0
        self.prefill: PrefillAnswer | None = None
        self.completion_tokens: int | None = None
        # KV-aware routing (proxy.gate): the prompt as the view keyed it, the cost model's decision
        # (its p None: D alone), or why the request was routed on load alone; the prefill tokens it
        # added to its P's backlog; what D's usage reported
        self.prompt: Prompt | None = None
        self.route: Decision | None = None
        self.route_reason: str | None = None
        self.backlog: tuple[str, int, int] | None = None  # (P, its ticket there, tokens): until P answers
        self.d_backlog: tuple[str, str, int] | None = None  # (P, D, tokens): pending until its first token
        self.handoff_x = HandoffX(0, 0)  # the tokens of KV its handoff was predicted with (own and ahead)
        self.handoff_s: float | None = None  # its handoff as predicted at admission
        self.handoff_flying: tuple[str, str, int] | None = None  # (P, D, ticket): P answered, no first token
        self.d_cached_tokens: int | None = None
        self.d_prompt_tokens: int | None = None
        # the TTFT predictor (proxy.predict): the target it is held against, its own prompt tokens (the
        # best count known before P), and at admission the predicted TTFT of the chosen P and D (from
        # ``started``), the tokens ahead of it on that P, ahead + own uncached (what P's fit learns from)
        # and where the rates came from, and whether that P's fit was confident (may reject)
        self.target_s = 0.0
        self.tokens = 0
        self.predicted: float | None = None
        self.tokens_ahead = 0
        self.predicted_x = 0
        self.predicted_source: str | None = None
        self.predicted_sure = False
        self.started = 0.0
        self.admitted = 0.0  # when admission let it in (the adaptive limit's D sample starts here)
        # the trace: the head-sampling decision and the stage timestamps (Unix ns) the root carries
        self.sampled = True
        self.started_ns = 0
        self.p_sent_ns: int | None = None
        self.p_done_ns: int | None = None
        self.d_sent_ns: int | None = None
        self.first_token_ns: int | None = None
        # the handoff that served it (``semconv.HANDOFFS``: pull, push, push_early); None: the fleet's mode
        self.handoff: str | None = None
        self.tenant, self.decode_tokens, self.charged, self.priority = DEFAULT_TENANT, 0, None, None


def client_error(
    status: int,
    message: str,
    err_type: str,
    outcome: str,
    code: str | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
    param: str | None = None,
) -> ClientError:
    return ClientError(status, protocol.error_body(message, err_type, code, param), outcome, headers)
