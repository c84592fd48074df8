"""Fault specifications, the scenario file, and the set of faults active right now.

A fault is a value (``FaultSpec``); ``FaultSet`` is the mutable set the engines and the
fabric consult (it implements the engine's ``FaultView``). Timing (``at``/``duration``)
is applied by the fleet, which adds and removes faults; this module reads no clock and
does no I/O except ``load_scenario`` reading the file it is given.

Kinds and their fields::

    slow_link         prefill, decode, factor   the P x D link is ``factor`` times slower
    slow_nic          decode | prefill, factor  every link into that D (or out of that P) is ``factor``
                                                times slower: a D's NIC, or a P's toward every D
    transfer_failure  rate [, prefill, decode]  share of NIXL reads that fail (D counts them)
    stop_pulling      decode                    D stops pulling and heartbeating: P's leases expire
    lease_stall       instance                  P's lease reaper falls behind: an expired lease keeps its
                                                blocks until the fault clears (stranded KV; vLLM had
                                                expired entries stuck behind a heartbeated one)
    (slow_nic and stop_pulling also take ``instance`` for ``decode``; a P's NIC is named by ``prefill``)
    stale_peer        prefill, decode           D keeps a stale NIXL agent for P (from before P restarted with
                                                the same engine id): each of D's pulls from P fails
    down              instance                  the instance is gone (connection refused) until cleared
    kv_capacity       instance, blocks | fraction   the instance's KV cache shrinks
    slow              instance, factor          every engine step takes ``factor`` times longer (slow P)

Scenario file (YAML or JSON)::

    faults:
      - {at: 10, duration: 30, kind: slow_link, prefill: prefill-0, decode: decode-1, factor: 20}
      - {at: 20, duration: 15, kind: down, instance: decode-2}
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdscope.config import ConfigError, validated

FaultKind = Literal[
    "slow_link",
    "slow_nic",
    "transfer_failure",
    "stop_pulling",
    "lease_stall",
    "stale_peer",
    "down",
    "kv_capacity",
    "slow",
]

_REQUIRED: dict[str, tuple[str, ...]] = {
    "slow_link": ("prefill", "decode", "factor"),
    "slow_nic": ("factor",),  # and one of decode (a D's NIC) or prefill (a P's)
    "transfer_failure": ("rate",),
    "stop_pulling": ("decode",),
    "lease_stall": ("instance",),
    "stale_peer": ("prefill", "decode"),
    "down": ("instance",),
    "kv_capacity": ("instance",),
    "slow": ("instance", "factor"),
}


class FaultSpec(BaseModel):
    """One fault. ``at`` (seconds after start) and ``duration`` apply to scenario files
    and to live injection (``at`` = delay); ``duration: null`` lasts until cleared."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: FaultKind
    instance: str | None = None
    prefill: str | None = None
    decode: str | None = None
    factor: float | None = Field(default=None, gt=0)
    rate: float | None = Field(default=None, ge=0, le=1)
    blocks: int | None = Field(default=None, ge=0)
    fraction: float | None = Field(default=None, ge=0, le=1)
    at: float = Field(default=0.0, ge=0)
    duration: float | None = Field(default=None, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _instance_names_the_decode(cls, data: Any) -> Any:
        """``instance`` works for the one-D kinds too (``slow_nic --instance decode-0``)."""
        if (
            isinstance(data, dict)
            and data.get("kind") in ("slow_nic", "stop_pulling")
            and data.get("decode") is None
            and data.get("prefill") is None
            and data.get("instance") is not None
        ):
            data = {k: v for k, v in data.items() if k != "instance"} | {"decode": data["instance"]}
        return data

    @model_validator(mode="after")
    def _fields_for_kind(self) -> FaultSpec:
        missing = [f for f in _REQUIRED[self.kind] if getattr(self, f) is None]
        if missing:
            raise ValueError(f"fault {self.kind!r} needs {', '.join(missing)}")
        if self.kind == "slow_nic" and (self.decode is None) == (self.prefill is None):
            raise ValueError("fault 'slow_nic' needs decode (a D's NIC) or prefill (a P's), one of them")
        if self.kind == "kv_capacity" and self.blocks is None and self.fraction is None:
            raise ValueError("fault 'kv_capacity' needs blocks or fraction")
        return self

    def instances(self) -> set[str]:
        return {n for n in (self.instance, self.prefill, self.decode) if n}


def parse_fault(data: dict[str, Any], source: str = "fault") -> FaultSpec:
    return validated(FaultSpec, data, source, "fault")


def load_scenario(path: str | Path) -> list[FaultSpec]:
    """Read a scenario file: a mapping with ``faults:`` (or a bare list) of fault specs."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML/JSON: {exc}"]) from exc
    items = data.get("faults") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise ConfigError([f"{path}: expected 'faults:' with a list of faults"])
    return [
        parse_fault(item if isinstance(item, dict) else {}, f"{path}: faults[{i}]")
        for i, item in enumerate(items)
    ]


class FaultSet:
    """The faults in force now. ``on_change(fault_id, spec, added)`` lets the fleet act
    (bring an instance down or back)."""

    def __init__(self, on_change: Callable[[int, FaultSpec, bool], None] | None = None) -> None:
        self._active: dict[int, FaultSpec] = {}
        self._ids = itertools.count(1)
        self.on_change = on_change

    def reserve_id(self) -> int:
        return next(self._ids)

    def add(self, spec: FaultSpec, fid: int | None = None) -> int:
        fid = next(self._ids) if fid is None else fid
        self._active[fid] = spec
        if self.on_change is not None:
            self.on_change(fid, spec, True)
        return fid

    def remove(self, fid: int) -> bool:
        spec = self._active.pop(fid, None)
        if spec is None:
            return False
        if self.on_change is not None:
            self.on_change(fid, spec, False)
        return True

    def clear(self) -> int:
        ids = list(self._active)
        for fid in ids:
            self.remove(fid)
        return len(ids)

    def active(self) -> dict[int, FaultSpec]:
        return dict(self._active)

    def _of(self, kind: str) -> list[FaultSpec]:
        return [f for f in self._active.values() if f.kind == kind]

    # -- FaultView (engine) --------------------------------------------------------

    def compute_factor(self, name: str) -> float:
        factor = 1.0
        for f in self._of("slow"):
            if f.instance == name:
                factor *= f.factor or 1.0
        return factor

    def kv_capacity(self, name: str, default: int) -> int:
        cap = default
        for f in self._of("kv_capacity"):
            if f.instance == name:
                cap = min(cap, f.blocks if f.blocks is not None else int(default * (f.fraction or 0.0)))
        return cap

    def stops_pulling(self, name: str) -> bool:
        return any(f.decode == name for f in self._of("stop_pulling"))

    def leases_stalled(self, name: str) -> bool:
        return any(f.instance == name for f in self._of("lease_stall"))

    # -- fabric --------------------------------------------------------------------

    def link_factor(self, prefill: str, decode: str) -> float:
        factor = 1.0
        for f in self._of("slow_link"):
            if f.prefill == prefill and f.decode == decode:
                factor *= f.factor or 1.0
        for f in self._of("slow_nic"):
            if (f.decode == decode) if f.decode is not None else (f.prefill == prefill):
                factor *= f.factor or 1.0
        return factor

    def stale_peer(self, prefill: str, decode: str) -> bool:
        return any(f.prefill == prefill and f.decode == decode for f in self._of("stale_peer"))

    def failure_rate(self, prefill: str, decode: str) -> float:
        ok = 1.0
        for f in self._of("transfer_failure"):
            if f.prefill in (None, prefill) and f.decode in (None, decode):
                ok *= 1.0 - (f.rate or 0.0)
        return 1.0 - ok

    def is_down(self, name: str) -> bool:
        return any(f.instance == name for f in self._of("down"))
