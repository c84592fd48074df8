"""Span names and attribute keys that pdscope's proxy emits and its collector reads.

vLLM's own ``llm_request`` span and its ``gen_ai.*`` attributes are listed too, as
vLLM 0.32/0.33 emit them (see the real captures under ``tests/fixtures``).

A request's trace, as the proxy writes it::

    pdscope.request (SERVER, root; proxy_in .. done)
    ├── pdscope.admission   proxy_in .. admitted (or rejected)
    ├── pdscope.prefill     p_sent .. p_done     (one per attempt; vLLM P's llm_request is its child)
    ├── pdscope.handoff     p_done .. first token (D queue incl. the NIXL pull)
    └── pdscope.decode      d_sent .. done, event "first_token"  (D's llm_request is its child)

The root also carries every stage timestamp the proxy knows (``*_unix_nano``: the same
readings its children start or end at, so a record built from the root alone has the same
stage columns), because under ``proxy.trace_sample_ratio`` below 1 an unsampled request
exports its root only: its children are kept only when it failed or missed the TTFT SLO
or was retried (``KEEP`` says why).
"""

from __future__ import annotations

SERVICE_PROXY = "pdscope-proxy"

SPAN_REQUEST = "pdscope.request"
SPAN_ADMISSION = "pdscope.admission"
SPAN_PREFILL = "pdscope.prefill"
SPAN_HANDOFF = "pdscope.handoff"
SPAN_DECODE = "pdscope.decode"
EVENT_FIRST_TOKEN = "first_token"

# attributes on the root span (some repeated on children)
REQUEST_ID = "pdscope.request_id"  # the X-Request-Id sent to both P and D
ENDPOINT = "pdscope.endpoint"  # "/v1/completions" | "/v1/chat/completions"
STREAM = "pdscope.stream"
P_INSTANCE = "pdscope.p_instance"
D_INSTANCE = "pdscope.d_instance"
P_POOL = "pdscope.p_pool"
D_POOL = "pdscope.d_pool"
OUTCOME = "pdscope.outcome"  # see OUTCOMES
RETRIES = "pdscope.retries"
KV_BLOCKS = "pdscope.kv_blocks"  # len of remote_block_ids (all groups)
KV_BYTES = "pdscope.kv_bytes"  # prompt tokens * kv_bytes_per_token
REJECT_REASON = "pdscope.reject_reason"
PROMPT_TOKENS = "pdscope.prompt_tokens"  # from P's usage
COMPLETION_TOKENS = "pdscope.completion_tokens"  # from D's usage, when D reports it
ATTEMPT = "pdscope.attempt"  # on prefill/decode spans, 0-based
INSTANCE = "pdscope.instance"  # on prefill/decode spans
REMOTE_ENGINE_ID = "pdscope.remote_engine_id"
# stage timestamps on the root, Unix nanoseconds (int): the last prefill attempt's start and end,
# the last decode attempt's start, D's first token
P_SENT_NS = "pdscope.p_sent_unix_nano"
P_DONE_NS = "pdscope.p_done_unix_nano"
D_SENT_NS = "pdscope.d_sent_unix_nano"
FIRST_TOKEN_NS = "pdscope.first_token_unix_nano"
# KV-aware routing (proxy.kv_aware), on the root: the path taken, what the router predicted each
# chosen instance held of the prompt, and what P and D reported they reused (usage
# prompt_tokens_details.cached_tokens); the prefix is the hex chain key of the longest matched block
ROUTE_PATH = "pdscope.route_path"  # see ROUTE_PATHS
ROUTE_PD = "pd"  # P then D (the disaggregated path)
ROUTE_DECODE_ONLY = "decode_only"  # conditional disaggregation: D alone computed the prompt
ROUTE_PATHS = (ROUTE_PD, ROUTE_DECODE_ONLY)
P_PREDICTED_CACHED = "pdscope.p_predicted_cached_tokens"
D_PREDICTED_CACHED = "pdscope.d_predicted_cached_tokens"
P_CACHED_TOKENS = "pdscope.p_cached_tokens"  # from P's usage.prompt_tokens_details.cached_tokens
D_CACHED_TOKENS = "pdscope.d_cached_tokens"  # from D's usage (local hits plus, on vLLM, pulled tokens)
PREFIX_KEY = "pdscope.prefix_key"  # hex, the deepest matched block's chain key (first 8 bytes)
PREFIX_TOKENS = "pdscope.prefix_tokens"  # tokens of that matched prefix
HANDOFF = "pdscope.handoff"  # how the KV went from P to D: see HANDOFFS
HANDOFF_PULL = "pull"  # D read P's blocks after P answered (NixlConnector)
HANDOFF_PUSH = "push"  # P wrote into D's blocks; D's leg sent after P answered (NixlPushConnector)
HANDOFF_PUSH_EARLY = "push_early"  # push, D's leg sent with P's (the proxy knew P's side channel)
HANDOFFS = (HANDOFF_PULL, HANDOFF_PUSH, HANDOFF_PUSH_EARLY)
TENANT = "pdscope.tenant"  # the request's tenant (pdscope.config.tenants): a declared id, or "default"
ROUTE_REASON = "pdscope.route_reason"  # why this P (and D): see proxy.kvaware
# The TTFT predictor (proxy.predict), on the root: the TTFT predicted at admission for the P and D it
# was sent to (seconds from the proxy's receipt, the admission wait so far included), the target it was
# admitted against (slo.ttft or the request's header), the uncached prefill tokens ahead of it on that P
# (the proxy's count, scaled to the whole pool when several proxies share it), its own uncached tokens,
# and where the rates came from (see PREDICT_SOURCES). A rejected request carries the prediction that
# rejected it (reject reason "predicted_late").
PREDICTED_TTFT_S = "pdscope.predicted_ttft_s"
TTFT_TARGET_S = "pdscope.ttft_target_s"
PREDICT_TOKENS_AHEAD = "pdscope.predict.tokens_ahead"
PREDICT_TOKENS = "pdscope.predict.tokens"
PREDICT_SOURCE = "pdscope.predict.source"
PREDICT_ONLINE = "online"  # fitted by this proxy from what it saw complete
PREDICT_TABLE = "table"  # the controller's fit, served in the routing table
PREDICT_PRIOR = "prior"  # the configured priors: nothing fitted yet
PREDICT_SOURCES = (PREDICT_ONLINE, PREDICT_TABLE, PREDICT_PRIOR)
SAMPLED = "pdscope.sampled"  # on the root: the head-sampling decision (the traceparent flag sent on)
KEEP = "pdscope.keep"  # on an unsampled root whose children were kept anyway: see KEEP_REASONS
KEEP_FAILED = "failed"  # outcome error or timeout
KEEP_RETRIED = "retried"  # served, after a failed attempt (forensics reads the failed attempts' spans)
KEEP_SLOW = "ttft_slo"  # the proxy's own TTFT over slo.ttft.target_ms
KEEP_REASONS = (KEEP_FAILED, KEEP_RETRIED, KEEP_SLOW)
HTTP_STATUS = "http.response.status_code"
ERROR_TYPE = "error.type"

# "client_error": the request was the client's mistake (the proxy's 400 before any prefill, or
# a 4xx that P or D answered); not a failure of any instance, and not a served request.
OUTCOME_CLIENT_ERROR = "client_error"
OUTCOMES = ("ok", "error", "rejected", "client_disconnect", "timeout", OUTCOME_CLIENT_ERROR)
FAILED_OUTCOMES = frozenset({"error", "timeout"})  # charged to the instance that failed them

# vLLM's per-request span and attributes
VLLM_SPAN = "llm_request"
GEN_AI_REQUEST_ID = "gen_ai.request.id"
GEN_AI_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
GEN_AI_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
GEN_AI_TTFT = "gen_ai.latency.time_to_first_token"
GEN_AI_E2E = "gen_ai.latency.e2e"
GEN_AI_QUEUE = "gen_ai.latency.time_in_queue"
GEN_AI_PREFILL = "gen_ai.latency.time_in_model_prefill"
GEN_AI_DECODE = "gen_ai.latency.time_in_model_decode"
GEN_AI_INFERENCE = "gen_ai.latency.time_in_model_inference"
GEN_AI_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_TOP_P = "gen_ai.request.top_p"
GEN_AI_N = "gen_ai.request.n"
