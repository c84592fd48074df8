"""The ``proxy`` section: the P/D router, the data plane."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from pdscope.config.base import (
    Count1M,
    Count10k,
    DaySeconds,
    Fraction,
    NonEmpty,
    NonNegative,
    Port,
    PositiveFloat,
    PositiveFraction,
    PositiveInt,
    Seconds,
    _Frozen,
)
from pdscope.config.kvaware import KvAwareSettings
from pdscope.routing import PROXY_ID_PATTERN


class AdmissionDefaults(_Frozen):
    max_inflight_requests: PositiveInt = 256
    """requests a pool may hold in flight when the routing table sets no limit; the limit AIMD grows back to
    """
    max_inflight_kv_bytes: PositiveInt = 64 * 2**30
    """handoff KV bytes (prompt tokens x model.kv_bytes_per_token, from P's answer to D's first token) a pool
    may hold; the controller scales it by the KV headroom"""
    queue_timeout_s: NonNegative = 1.0
    """seconds a request over a limit waits for room before its 429; a pool's max_queue_wait_s in the table
    can shorten it"""
    retry_after_s: int = Field(default=1, ge=1)
    """Retry-After seconds sent with a 429"""


class ProxyTimeouts(_Frozen):
    connect_s: PositiveFloat = 2.0
    """seconds to connect to a P or D instance"""
    prefill_s: PositiveFloat = 60.0
    """seconds for P's whole max_tokens=1 answer; past it another P is tried if the retry budget allows, else
    504"""
    decode_first_token_s: PositiveFloat = 60.0
    """seconds from sending to D until its first token of a streamed request (504 before any byte)"""
    decode_total_s: PositiveFloat = 600.0
    """seconds for D's whole answer (a non-streamed request's first-token bound too); past it the outcome is
    timeout"""


class OutlierSettings(_Frozen):
    """Outlier detection in the proxy (``proxy/outlier.py``): the one home of an instance's recent
    failures."""

    consecutive_failures: Count10k = 5
    """this many failures in a row eject the instance"""
    failure_ratio: PositiveFraction = 0.2
    """failed share of the last window_s that ejects (with min_requests)"""
    min_requests: Count1M = 20
    """results in the window before the ratio counts"""
    window_s: Seconds = 10.0
    """seconds of results the failure ratio is computed over"""
    base_ejection_s: Seconds = 5.0
    """first ejection; doubles per successive one"""
    max_ejection_s: DaySeconds = 60.0
    """cap on one ejection"""
    max_ejected_share: Fraction = 0.5
    """share of a pool that may be ejected at once (at least one, never the last; 0: never eject)"""
    failure_penalty: float = Field(default=2.0, ge=0, le=10)
    """exponent k: selection weighs an instance by (1 - recent failure ratio)^k (0: failures ignored)"""

    @model_validator(mode="after")
    def _ejection_bounds(self) -> OutlierSettings:
        if self.max_ejection_s < self.base_ejection_s:
            raise ValueError("max_ejection_s must be at least base_ejection_s")
        return self


class AdaptiveLimitSettings(_Frozen):
    """The proxy's local adaptive concurrency limit per pool (``proxy/concurrency.py``), AIMD on its
    own TTFT."""

    enabled: bool = True
    """hold each pool's request limit under an AIMD limit driven by the proxy's own TTFT against slo.ttft; off
    under policy round-robin"""
    min_limit: Count1M = 1
    """floor of a pool's adaptive limit"""
    increase: Count1M = 2
    """added per window comfortably under target"""
    decrease_factor: float = Field(default=0.75, gt=0, lt=1)
    """limit multiplied by this per window over target"""
    window_s: float = Field(default=1.0, gt=0, le=600)
    """one decision per window (once min_samples arrived)"""
    min_samples: Count1M = 10
    """samples a decision needs"""
    headroom: PositiveFraction = 0.8
    """'comfortably under': the SLO percentile under headroom x target"""


class PredictSettings(_Frozen):
    """The TTFT predictor and admission by prediction (docs/proxy.md, Admission by prediction)."""

    admit: bool = True
    """reject at once (429 predicted_late, Retry-After from the predicted drain) a request whose best
    predicted TTFT, times the predictor's recent error quantile, is over its target; and let a request wait
    for a pool's room only while it can still make its target. Off: the prediction is made, recorded and
    measured, and admission is by the pool limits alone"""
    quantile: float = Field(default=0.995, ge=0.5, le=0.999)
    """the quantile of the recent observed/predicted TTFT ratios a prediction is multiplied by before it is
    held against the target (the predictor's own error as the margin); at least the attainment promised
    to admitted requests (0.99), or that share of them misses by construction"""
    margin: Fraction = 0.05
    """share of the target held back besides the error quantile"""
    errors_s: PositiveFloat = Field(default=20.0, le=3600)
    """seconds an observed/predicted TTFT ratio counts in the error quantile: a transient's ratios (a
    saturation's, a fault's onset) leave the margin after this long, even while the margin's own
    rejections bring no first token to replace them"""
    min_samples: Count1M = 20
    """completions of a P (or, at the table's prior, the controller's samples) before its prediction may
    reject a request: a cold predictor routes and records, but does not reject"""
    forget: float = Field(default=0.98, gt=0.5, lt=1.0)
    """the online fit's forgetting factor per completion (0.98: the last ~50 count most)"""
    probe_s: PositiveFloat = Field(default=10.0, le=3600)
    """a P whose fit learnt nothing for this long and has nothing of this proxy's in flight may be sent one
    request to learn from again (so a P that was slow and recovered is found again); a handoff line this
    old falls back to the D's, the table's, the prior, until its probe is in flight"""
    chars_per_token: PositiveFloat = Field(default=4.0, le=1000)
    """characters per token, to estimate a prompt's tokens where no tokenizer or KV view counted them"""
    prefill_base_s: NonNegative = Field(default=0.02, le=3600)
    """prior: a P's fixed time per request (a step, the round trip)"""
    handoff_s: NonNegative = Field(default=0.05, le=3600)
    """prior: P's answer to D's first token, before any is seen"""
    target_header: str = Field(default="x-pdscope-ttft-target-ms", pattern=r"^[A-Za-z0-9][A-Za-z0-9-]{0,63}$")
    """request header carrying the request's own TTFT target in ms (interactive vs batch traffic), bounded by
    min_target_ms and max_target_ms; absent: slo.ttft.target_ms"""
    min_target_ms: PositiveFloat = Field(default=100.0, le=86_400_000)
    """the smallest TTFT target a request may ask for (400 below)"""
    max_target_ms: PositiveFloat = Field(default=600_000.0, le=86_400_000)
    """the largest TTFT target a request may ask for (400 above)"""

    @model_validator(mode="after")
    def _bounds(self) -> PredictSettings:
        if self.min_target_ms > self.max_target_ms:
            raise ValueError("min_target_ms must be at most max_target_ms")
        return self


class ProxySettings(_Frozen):
    host: str = "127.0.0.1"
    """address the client-facing API listens on"""
    port: Port = 8000
    """port of the client-facing API"""
    id: str | None = Field(default=None, min_length=1, max_length=128, pattern=PROXY_ID_PATTERN)
    """this proxy's id among the proxies in front of the fleet, sent on every routing poll; the controller
    apportions each pool's limits among the live ids. Unique per process. Unset: <hostname>:<port>"""
    controller_token_env: NonEmpty = "PDSCOPE_PROXY_TOKEN"
    """env variable whose value the routing poll sends as Authorization: Bearer <value> (needed when the
    controller sets controller.proxy_tokens_env; unset: no header)"""
    controller_secret_env: NonEmpty = "PDSCOPE_PROXY_SECRET"
    """env variable holding the fleet's proxy secret (controller.proxy_secret_env): when set, the routing poll
    sends the token derived from it and this proxy's id, and controller_token_env is not read"""
    expected_replicas: Count10k = 1
    """how many proxies normally run: with no share from the controller (never reached, or unreachable past
    fail_static_s) this proxy admits the config's limits divided by this, never the whole limit"""
    controller_url: str | None = None
    """where GET /v1/routing is polled; default http://<controller.host>:<controller.port>"""
    controller_urls: (
        list[Annotated[str, Field(min_length=8, max_length=512, pattern=r"^https?://")]] | None
    ) = Field(default=None, min_length=1, max_length=16)
    """several controller replicas to poll GET /v1/routing from (every replica serves it): the one that last
    answered first, the next on a failure; overrides controller_url"""
    routing_poll_s: PositiveFloat = 1.0
    """seconds between polls of the routing table (with If-None-Match)"""
    fail_static_s: NonNegative = 60.0
    """seconds the last table is kept while the controller is unreachable; then equal weights from the config
    (fallback)"""
    pair_probe_s: PositiveFloat = 10.0
    """a P x D pair the routing table says to leave out (avoid_pairs: a D's stale agent for a restarted P)
    still gets one request at most this often from this proxy, a probe: once one is served, the controller
    lets the pair back"""
    push_early: bool = False
    """in a fleet whose pools hand off by push: send D's leg with P's (D registers its blocks while P
    computes) once P's side channel is known from its last answer, instead of after P's answer. Off by
    default: it saves only the proxy's round trip and D's admission, and is unverified on real vLLM"""
    policy: Literal["weighted", "round-robin"] = "weighted"
    """weighted: power of two choices on the table's weights; round-robin: cycles like vLLM's toy proxy (a
    baseline: no failure weighing, no adaptive limit)"""
    retry_budget: Fraction = 0.2
    """retries may be at most this share of requests (plus a small reserve), so a failing pool cannot double
    the load"""
    outlier: OutlierSettings = OutlierSettings()
    """outlier detection: when a failing instance is ejected, and for how long"""
    adaptive_limit: AdaptiveLimitSettings = AdaptiveLimitSettings()
    """the proxy's own AIMD limit per pool on its TTFT"""
    predict: PredictSettings = PredictSettings()
    """the per-request TTFT predictor (fitted online, prior from the controller's rates) and admission by
    prediction"""
    admission: AdmissionDefaults = AdmissionDefaults()
    """per-pool admission limits used where the routing table sets none"""
    timeouts: ProxyTimeouts = ProxyTimeouts()
    """bounds on each stage of a request (a timeout is a 504 before the first byte)"""
    otlp_endpoint: str | None = None
    """where spans are exported (OTLP/HTTP); default the collector's /v1/traces"""
    otlp_token_env: NonEmpty = "PDSCOPE_OTLP_TOKEN"
    """env variable whose value the span exporter sends as Authorization: Bearer <value> (unset: no header)"""
    tracing: bool = True
    """emit and export OpenTelemetry spans and forward traceparent to P and D (off: no spans, nothing for the
    collector to assemble)"""
    trace_sample_ratio: Fraction = 1.0
    """share of requests whose whole trace is kept (head sampling on the trace id, sent on as the traceparent
    sampled flag so vLLM follows it; a caller's sampled traceparent is always kept); every other request
    exports its root span only (its record is complete), except a failed or retried one or one over
    slo.ttft.target_ms, whose proxy spans are kept"""
    span_queue_max: int = Field(default=32768, ge=1, le=2**22)
    """spans held for export (a down collector costs nothing until this fills; then counted drops)"""
    span_retry_max_s: float = Field(default=5.0, gt=0, le=300)
    """longest pause between tries of a failed span batch"""
    client_read_timeout_s: Seconds = 30.0
    """time a client has to send a request's headers and body; then the connection is closed"""
    max_request_bytes: int = Field(default=32 * 2**20, gt=0, le=2**30)
    """largest client body (413)"""
    max_model_len: int | None = Field(default=None, gt=1)
    """the model's context length; when set, max_tokens that cannot fit is a 400 before prefill. Unset: the
    smallest max_model_len the instances report on GET /v1/models"""
    max_tokens_overflow: Literal["refuse", "clamp"] = "refuse"
    """a prompt plus max_tokens over the context: refuse (a 400 before prefill, as OpenAI and older vLLM do)
    or clamp (let it through: vLLM 0.32 and the simulator cut max_tokens to the room left; only a prompt
    that leaves no room is refused)"""
    model_info_refresh_s: Seconds = 30.0
    """how often the proxy asks every instance for GET /v1/models and GET /version"""
    kv_aware: KvAwareSettings = KvAwareSettings()
    """KV-aware routing: P and D chosen by the KV cache they hold, bounded by load"""

    @model_validator(mode="before")
    @classmethod
    def _no_cooldown(cls, data: Any) -> Any:
        if isinstance(data, dict) and "failure_cooldown_s" in data:
            raise ValueError(
                "failure_cooldown_s was replaced by proxy.outlier (consecutive_failures, failure_ratio, "
                "base_ejection_s, ...): see docs/proxy.md"
            )
        return data
