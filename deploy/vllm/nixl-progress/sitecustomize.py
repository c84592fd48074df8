"""Tame NIXL's progress thread on CPU-only machines (loaded via PYTHONPATH by launch-cpu.sh).

NIXL 1.5.1's Python agent hard-codes ``pthrDelay = 0`` for its progress thread, so each idle
vLLM worker busy-polls one core at ~100 %. On a 2-core box that starves the model. Set one of:

- ``PDSCOPE_NIXL_PROGRESS_DELAY_US=N``  keep the thread, but let it wait up to N microseconds
  between polls (it still wakes on UCX events). This is what launch-cpu.sh uses by default.
- ``PDSCOPE_NIXL_NO_PROGRESS_THREAD=1`` no progress thread at all. NIXL then advances only
  when vLLM polls it, which an idle prefill instance does not do: with UCX over TCP loopback
  the decode side's READ can stall. Kept for experiments only.

Also, ``PDSCOPE_VLLM_CPU_NO_AMX=1``: vLLM's CPU attention does not pick its AMX kernels. Some
virtual machines advertise AMX (``amx_bf16``, ``amx_tile``) and grant the tile permission, yet the
AMX decode kernel dies there with SIGILL on D's first step after a NIXL pull; the AVX-512 kernel
works everywhere (launch-cpu.sh sets this unless ``--amx``).

The patch is lazy: an import hook waits for ``nixl_cu12._api`` (or ``nixl_cu13._api``) to be
imported and then patches the classes it uses; processes that never import NIXL pay nothing.
When a class it expects is missing, it prints one line to stderr and leaves NIXL alone.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

_TARGETS = ("nixl_cu12._api", "nixl_cu13._api")
_CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"


def _no_progress_thread(api: ModuleType) -> None:
    cfg = api.nixl_agent_config
    original = cfg.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.enable_pthread = False

    cfg.__init__ = __init__


def _progress_delay(api: ModuleType, delay_us: int) -> None:
    bindings = api.nixlBind
    base = bindings.nixlAgentConfig
    field = base.pthrDelay  # the C++ property; the agent sets it to 0 right after construction

    class DelayedConfig(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:
            return int(field.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:
            field.__set__(self, max(int(value), delay_us))

    bindings.nixlAgentConfig = DelayedConfig


def _no_amx(module: ModuleType) -> None:
    """After vLLM's CPU attention backend is imported: report AMX tiles as unsupported, so its
    ISA choice falls through to the AVX-512 kernels."""
    try:
        module.torch.cpu._is_amx_tile_supported = lambda: False
    except AttributeError as exc:
        print(f"sitecustomize: AMX patch not applied to {module.__name__}: {exc}", file=sys.stderr)


def _patch(api: ModuleType) -> None:
    if api.__name__ == _CPU_ATTN:
        _no_amx(api)
        return
    if getattr(api, "_pdscope_patched", False):
        return
    setattr(api, "_pdscope_patched", True)  # noqa: B010
    try:
        if os.environ.get("PDSCOPE_NIXL_NO_PROGRESS_THREAD") == "1":
            _no_progress_thread(api)
        elif os.environ.get("PDSCOPE_NIXL_PROGRESS_DELAY_US"):
            _progress_delay(api, int(os.environ["PDSCOPE_NIXL_PROGRESS_DELAY_US"]))
    except (AttributeError, TypeError, ValueError) as exc:
        print(f"sitecustomize: NIXL progress patch not applied to {api.__name__}: {exc}", file=sys.stderr)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _wanted:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec: importlib.machinery.ModuleSpec | None = find(fullname, path, target) if find else None
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


_wanted: set[str] = set()
if os.environ.get("PDSCOPE_NIXL_NO_PROGRESS_THREAD") == "1" or os.environ.get(
    "PDSCOPE_NIXL_PROGRESS_DELAY_US"
):
    _wanted.update(_TARGETS)
if os.environ.get("PDSCOPE_VLLM_CPU_NO_AMX") == "1":
    _wanted.add(_CPU_ATTN)
if _wanted:
    sys.meta_path.insert(0, _Finder())
