"""The routing table: the wire contract between the controller and the proxy.

The controller serves it at ``GET /v1/routing`` (with an ETag of ``version``); the
proxy polls it and applies it. Neither imports the other: both import this module.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class InstanceRoute(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str
    pool: str
    role: Literal["prefill", "decode"]
    url: str
    weight: float = Field(ge=0.0, description="relative share within its role; 0 = no new work")
    drained: bool = False
    reason: str = ""


class PoolRoute(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str
    role: Literal["prefill", "decode"]
    weight: float = Field(default=1.0, ge=0.0)
    max_inflight_requests: int | None = Field(default=None, ge=0)
    max_inflight_kv_bytes: int | None = Field(default=None, ge=0)
    max_queue_wait_s: float | None = Field(
        default=None, ge=0,
        description="longest a request may wait for a slot in this pool before a 429; "
                    "None = the proxy's proxy.admission.queue_timeout_s (which also caps it)",
    )
    reason: str = ""


class RoutingTable(BaseModel):
    """What the proxy should do now. ``enforce=False`` means advisory: show, don't apply."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    version: int = Field(ge=0)
    generated_at: float
    mode: Literal["advisory", "enforce"]
    enforce: bool
    instances: list[InstanceRoute]
    pools: list[PoolRoute]
