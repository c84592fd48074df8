"""The routing table: the wire contract between the controller and the proxy.

The controller serves it at ``GET /v1/routing`` with an ETag (:func:`routing_etag`); the
proxy polls it and applies it. Neither imports the other: both import this module.

The ETag is opaque: a client sends it back in ``If-None-Match`` and gets 304 while the
table is the same, and never compares it or ``version`` with anything else. It carries the
serving process's epoch as well as the version, because a restarted controller may count
versions again from what it stored and so reach a number an earlier process served with
other content; the epoch keeps that from answering 304 to a proxy holding the old table.
``version`` orders the tables of one controller process only.

``leader_epoch`` is another thing: the epoch of the controller leader whose stored decisions the
table serves (bumped on each takeover; the same on every replica). A proxy may poll any
controller replica; it needs neither field to apply the table, and a table without
``leader_epoch`` (an older controller) is as valid.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# The two roles of a P/D fleet, the one definition every layer uses.
Role = Literal["prefill", "decode"]


class InstanceRoute(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str
    pool: str
    role: Role
    url: str
    weight: float = Field(ge=0.0, description="relative share within its role; 0 = no new work")
    drained: bool = False
    reason: str = ""


class PoolRoute(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str
    role: Role
    weight: float = Field(default=1.0, ge=0.0)
    max_inflight_requests: int | None = Field(default=None, ge=0)
    max_inflight_kv_bytes: int | None = Field(default=None, ge=0)
    max_queue_wait_s: float | None = Field(
        default=None,
        ge=0,
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
    leader_epoch: int | None = Field(
        default=None,
        ge=0,
        description="epoch of the controller leader whose decisions this table serves "
        "(bumped on each takeover); None: not known",
    )


def routing_etag(epoch: str, version: int) -> str:
    """The strong ETag of table ``version`` served by the controller process ``epoch``."""
    return f'"{epoch}-{version}"'
