"""The ``pools`` section: the fleet, named pools of vLLM instances, each prefill or decode."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from pdscope.config.base import _Frozen
from pdscope.routing import Role

REVISION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$"  # what pdscope.kvcompat accepts as a revision
Scheduling = Literal["fcfs", "priority"]  # vLLM --scheduling-policy


class Instance(_Frozen):
    """One vLLM server (or one simulated one)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """the instance's name, unique across all pools: it keys weights, decisions, snapshots and spans (for
    vLLM, set OTEL_SERVICE_NAME to it)"""
    url: str
    """base URL the proxy sends requests to, e.g. http://10.0.0.5:8000 (http:// or https://; a trailing / is
    dropped)"""
    metrics_url: str | None = None
    """where the collector scrapes vLLM's Prometheus page; default <url>/metrics"""
    labels: dict[str, str] = Field(default_factory=dict)
    """free-form labels (e.g. rack: r1), kept with the config for your own use; no pdscope service reads them
    """
    kv_events_endpoint: str | None = Field(default=None, max_length=256, pattern=r"^(tcp|ipc)://[^\s*]+$")
    """where the instance publishes its KV cache events (vLLM --kv-events-config {"enable_kv_cache_events":
    true, "publisher": "zmq", "endpoint": "tcp://*:5557"}), e.g. tcp://10.0.0.5:5557; unset: no events from
    this instance"""
    kv_events_replay_endpoint: str | None = Field(
        default=None, max_length=256, pattern=r"^(tcp|ipc)://[^\s*]+$"
    )
    """the instance's replay socket (vLLM replay_endpoint): messages missed in a gap are asked for again;
    unset: a gap makes pdscope forget this instance's cache and rebuild it"""
    kv_events_topic: str = Field(default="", max_length=128)
    """the topic the instance publishes under (vLLM topic)"""
    revision: str | None = Field(default=None, max_length=128, pattern=REVISION_PATTERN)
    """the revision this instance runs during a rollout (e.g. a model or image tag); overrides its pool's.
    A P and a D are paired only when their revisions agree (docs/policy.md, Compatible pairs only); unset
    on both: not compared"""
    scheduling: Scheduling | None = None
    """the instance's vLLM --scheduling-policy, when it differs from its pool's (fcfs or priority); unset: the
    pool's"""

    @field_validator("url", "metrics_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value.rstrip("/")

    @property
    def scrape_url(self) -> str:
        return self.metrics_url or f"{self.url}/metrics"


class Pool(_Frozen):
    """A named set of instances with one role; weights apply per pool and per instance."""

    role: Role
    """prefill (P: gets the request with max_tokens=1) or decode (D: pulls the KV cache and streams the
    tokens); the fleet needs at least one pool of each"""
    weight: float = Field(default=1.0, ge=0.0)
    """the pool's share of traffic relative to pools of the same role; multiplies its instances' weights (0:
    the pool gets nothing)"""
    instances: list[Instance] = Field(min_length=1)
    """the pool's vLLM servers (at least one)"""
    handoff: Literal["pull", "push"] = "pull"
    """how its instances hand the KV cache over, as their vLLM --kv-transfer-config says: pull
    (NixlConnector: D reads P's blocks after P answered) or push (NixlPushConnector, vLLM 0.32+: D registers
    its blocks and P writes into them; the proxy sends D's leg with P's once it knows P's side channel). For
    now every pool of the fleet must say the same"""
    labels: dict[str, str] = Field(default_factory=dict)
    """free-form labels (e.g. gpu: h100), kept with the config for your own use; no pdscope service reads them
    """
    revision: str | None = Field(default=None, max_length=128, pattern=REVISION_PATTERN)
    """the revision the pool's instances run (an instance's own revision wins); see the instance's revision"""
    scheduling: Scheduling = "fcfs"
    """its instances' vLLM --scheduling-policy (an instance may say otherwise): fcfs (vLLM's default: P's and
    D's waiting queues in arrival order) or priority (in order of each request's priority, lower first, then
    arrival). With tenants on, the proxy sets each leg's priority from its tenant's class and share to the
    instances declared priority, and sends none to fcfs ones (docs/tenants.md, Inside the pools)"""

    def scheduling_of(self, inst: Instance) -> Scheduling:
        """``inst``'s scheduling policy: its own, else the pool's."""
        return inst.scheduling or self.scheduling
