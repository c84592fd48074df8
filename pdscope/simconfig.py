"""The ``simulator:`` section of pdscope.yaml: the simulated fleet's model.

``Settings.simulator`` is this model, so ``pdscope config check`` validates the section with
the rest of the file. Every knob of the latency, KV-capacity, transfer and lease model lives
here with a default, so ``simulator: {}`` is a working fleet. It holds values only: no I/O,
no clock, no environment reads. (It lives in the kernel, not in ``simulator/``, because the
config file is the kernel's; the simulator reads it from here.)
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The admin API's port under ``pdscope sim`` when ``simulator.admin_port`` is 0 and no --admin-port.
DEFAULT_ADMIN_PORT = 8399

# Llama-3-70B in BF16: 80 layers * 8 KV heads * 128 head dim * 2 (K, V) * 2 bytes.
LLAMA3_70B_KV_BYTES_PER_TOKEN = 327680


_PER_INSTANCE = (
    "latency_scale",
    "prefill_tokens_per_s",
    "step_overhead_s",
    "decode_per_seq_s",
    "max_num_seqs",
    "max_num_batched_tokens",
    "default_output_tokens",
    "max_num_queued_reqs",
    "max_num_queued_tokens",
    "block_size",
    "kv_capacity_blocks",
    "prefix_caching",
    "lease_duration_s",
    "heartbeat_interval_s",
    "tp_size",
    "cache_dtype",
    "served_model_name",
    "scheduling_policy",
)


class SimulatorConfig(BaseModel):
    """The simulated instances' model. ``latency_scale: 0`` makes every step take no time."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    vllm_version: Literal["0.32.0", "0.33.0"] = "0.32.0"
    """whose kv_transfer_params keys and /version to mimic"""
    seed: int = 0
    """seed of every random choice (transfer failures, token text): the same seed and load give the same run
    """
    latency_scale: float = Field(default=1.0, ge=0.0)
    """multiplies every modelled duration; 0 = zero-latency mode"""
    # compute
    prefill_tokens_per_s: float = Field(default=16000.0, gt=0)
    """prefill throughput per instance"""
    step_overhead_s: float = Field(default=0.010, ge=0)
    """fixed cost of one engine step"""
    decode_per_seq_s: float = Field(default=0.0001, ge=0)
    """extra step time per sequence in the batch (decode slows with batch)"""
    max_num_seqs: int = Field(default=256, gt=0)
    """most sequences in one batch"""
    max_num_batched_tokens: int = Field(default=8192, gt=0)
    """token budget of one step"""
    default_output_tokens: int = Field(default=128, gt=0)
    """output length when a request sets no max_tokens (ends with 'stop')"""
    max_model_len: int = Field(default=32768, gt=1)
    """context length the instances advertise and enforce; also sets the request_tokens histogram buckets"""
    max_num_queued_reqs: int | None = Field(default=None, gt=0)
    """vLLM --max-num-queued-reqs: 503 and admission_rejections_total past it"""
    max_num_queued_tokens: int | None = Field(default=None, gt=0)
    """vLLM --max-num-queued-tokens: prompt tokens of requests still in prefill"""
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """vLLM --scheduling-policy: fcfs (the waiting queue in arrival order; a request's priority is ignored, as
    vLLM 0.32.0 does) or priority (waiting in order of (priority, arrival), and under a KV shortage the
    running request of the largest (priority, arrival) is preempted)"""
    request_id_headers: bool = False
    """echo X-Request-Id (vLLM --enable-request-id-headers)"""
    # KV cache
    block_size: int = Field(default=16, gt=0)
    """tokens per KV block"""
    kv_capacity_blocks: int = Field(default=16384, gt=0)
    """KV blocks per instance"""
    cache_dtype: str = Field(default="auto", pattern=r"^[A-Za-z0-9_.]{1,32}$")
    """vLLM --kv-cache-dtype as vllm:cache_config_info reports it (per instance: a pair that differs is
    incompatible to pdscope)"""
    served_model_name: str | None = Field(default=None, min_length=1, max_length=256)
    """vLLM --served-model-name: the model name the instance reports (/v1/models, its metrics' model_name
    label); default the fleet's model (per instance: a pair that differs is incompatible to pdscope)"""
    prefix_caching: bool = True
    """vLLM --enable-prefix-caching: full prompt blocks stay cached (LRU under kv_capacity_blocks) and a
    request reuses its longest cached prefix; D pulls only the blocks it lacks"""
    kv_bytes_per_token: int | None = Field(default=None, gt=0)
    """KV bytes per token a simulated transfer moves; default: model.kv_bytes_per_token of the config"""
    # NIXL transfer (D pulls from P)
    link_bandwidth_bytes_per_s: float = Field(default=25e9, gt=0)
    """bandwidth of one P x D link (a link serves one transfer at a time)"""
    descriptors_per_block: int = Field(default=2, gt=0)
    """NIXL descriptors per KV block moved (each costs per_descriptor_s; vllm:nixl_num_descriptors)"""
    per_descriptor_s: float = Field(default=2e-6, ge=0)
    """cost of one NIXL descriptor"""
    post_time_s: float = Field(default=0.0002, ge=0)
    """time to post one NIXL transfer"""
    # lease (vLLM kv_lease_duration; D heartbeats every lease/6, each extends to now + lease*2/3)
    lease_duration_s: float = Field(default=30.0, gt=0)
    """P holds a request's KV blocks this long for D to pull (vLLM kv_lease_duration); past it they expire
    (nixl_num_kv_expired_reqs)"""
    heartbeat_interval_s: float | None = Field(default=None, gt=0)
    """seconds between D's lease heartbeats while it waits to pull; default lease_duration_s / 6"""
    transfer_mode: Literal["pull", "push"] = "pull"
    """the NIXL connector the instance runs: pull (vLLM NixlConnector: D reads P's blocks, D records the
    transfers) or push (NixlPushConnector: D registers its blocks with P, P writes into them and records
    the transfers); P and D of one pair must run the same"""
    push_registration_timeout_s: float = Field(default=480.0, gt=0)
    """push mode: D fails a request whose registered blocks P has not written within this (vLLM
    push_registration_timeout, default decoder_kv_blocks_ttl 480 s)"""
    startup_s: float = Field(default=0.0, ge=0, le=600)
    """a restarted instance answers (its API and /metrics) this long after its new process started: a real
    vLLM loads its weights first, for a minute or more"""
    # identity as P returns it in kv_transfer_params
    side_channel_host: str = "localhost"
    """remote_host P returns in kv_transfer_params (the NIXL side channel it advertises)"""
    side_channel_port: int = Field(default=5600, ge=1, le=65535)
    """remote_port P returns in kv_transfer_params; the i-th instance advertises this + i"""
    tp_size: int = Field(default=1, gt=0)
    """tensor-parallel size P returns in kv_transfer_params"""
    # tracing
    tracing: bool = False
    """emit vLLM's llm_request spans over OTLP/HTTP, parented by an incoming traceparent"""
    otlp_endpoint: str | None = None
    """where llm_request spans go (with tracing: true); default: the collector's /v1/traces"""
    # honest timing
    loop_lag_threshold_s: float = Field(default=0.05, gt=0)
    """event-loop lag above which results are marked untrustworthy"""
    admin_port: int = Field(default=0, ge=0, le=65535)
    """port of the admin API (faults, stats); 0: pdscope sim takes DEFAULT_ADMIN_PORT 8399 (or --admin-port),
    an in-process fleet any free port"""
    scenario: str | None = None
    """fault scenario file (faults at set times) applied at start, relative to the config file"""
    instances: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """per-instance overrides of the engine knobs, e.g. {decode-2: {kv_capacity_blocks: 4096}}"""

    @model_validator(mode="after")
    def _overrides_are_engine_knobs(self) -> SimulatorConfig:
        for name, override in self.instances.items():
            bad = sorted(set(override) - set(_PER_INSTANCE))
            if bad:
                raise ValueError(f"instances.{name}: {', '.join(bad)} cannot be set per instance")
            self.for_instance(name)  # validates the values
        return self

    def for_instance(self, name: str) -> SimulatorConfig:
        """This config with ``instances[name]``'s overrides applied (validated)."""
        override = self.instances.get(name)
        if not override:
            return self
        data = self.model_dump()
        data.update(override)
        data["instances"] = {}
        return SimulatorConfig.model_validate(data)

    @property
    def heartbeat_s(self) -> float:
        return self.heartbeat_interval_s or self.lease_duration_s / 6.0

    @property
    def heartbeat_extend_s(self) -> float:
        return self.lease_duration_s * 2.0 / 3.0

    def kv_bytes(self, model_default: int) -> int:
        return self.kv_bytes_per_token or model_default
