"""``Settings``: the whole file, its sections, the checks across them and the lookups."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pdscope.config.access import MIN_PROXY_SECRET_CHARS, parse_named_tokens
from pdscope.config.alerts import AlertSettings
from pdscope.config.base import ConfigError, _Frozen
from pdscope.config.collector import CollectorSettings
from pdscope.config.controller import ControllerSettings
from pdscope.config.dashboard import DashboardSettings
from pdscope.config.model import ModelSettings
from pdscope.config.pools import Instance, Pool
from pdscope.config.proxy import ProxySettings
from pdscope.config.slo import SLOSettings
from pdscope.config.store import StoreSettings
from pdscope.config.tenants import TenantSettings
from pdscope.routing import Role
from pdscope.simconfig import SimulatorConfig  # the one definition, with the routing contract
from pdscope.simtokenizer import NAME as SIM_TOKENIZER


class Settings(_Frozen):
    """The whole file. Sections other than ``model`` and ``pools`` have defaults."""

    model: ModelSettings
    """The served model, as every instance knows it. Required."""
    pools: dict[str, Pool]
    """The fleet: named pools of instances, each pool prefill or decode; at least one of each. Required."""
    slo: SLOSettings = SLOSettings()
    """What the service promises its users: the targets alerts, admission, the dashboard and the benchmarks
    judge against."""
    alerts: AlertSettings = AlertSettings()
    """The controller's paging policy: when and how loudly the built-in rules (docs/alerts.md) alert."""
    store: StoreSettings = StoreSettings()
    """The database every service meets in, and how long it keeps what it holds."""
    controller: ControllerSettings = ControllerSettings()
    """The reconcile loop and its HTTP API (docs/policy.md, docs/api.md)."""
    proxy: ProxySettings = ProxySettings()
    """The P/D router, the data plane (docs/proxy.md)."""
    collector: CollectorSettings = CollectorSettings()
    """The scraper, the OTLP receiver and the request-record builder (docs/collector.md)."""
    dashboard: DashboardSettings = DashboardSettings()
    """The Streamlit dashboard and who may change things through it (docs/dashboard.md)."""
    tenants: TenantSettings = TenantSettings()
    """Who a request belongs to, and each tenant's fair share, priority class, limits and SLOs
    (docs/tenants.md)."""
    simulator: SimulatorConfig = Field(default_factory=SimulatorConfig)
    """The simulated fleet's model (docs/simulator.md); only pdscope sim and the demo read it. simulator: {}
    is a working fleet."""

    @field_validator("pools")
    @classmethod
    def _pools_cover_both_roles(cls, pools: dict[str, Pool]) -> dict[str, Pool]:
        roles = {pool.role for pool in pools.values()}
        missing = [role for role in ("prefill", "decode") if role not in roles]
        if missing:
            raise ValueError(f"no {' or '.join(missing)} pool: a P/D fleet needs at least one of each")
        seen: dict[str, tuple[str, int]] = {}
        for pool_name, pool in pools.items():
            for i, inst in enumerate(pool.instances):
                if inst.name in seen:
                    first_pool, first_i = seen[inst.name]
                    where = "also" if first_pool == pool_name else f"also in pool {first_pool!r},"
                    # ctx "loc"/"first": the formatter reports this at the duplicate's own line.
                    message = (
                        f"duplicate instance name {inst.name!r} in pool {pool_name!r}: {where} at "
                        f"pools.{first_pool}.instances.{first_i}; instance names must be unique"
                    )
                    raise PydanticCustomError(
                        "duplicate_instance",
                        "{message}",
                        {
                            "message": message,
                            "loc": ("pools", pool_name, "instances", i, "name"),
                            "first": ("pools", first_pool, "instances", first_i, "name"),
                        },
                    )
                seen[inst.name] = (pool_name, i)
        return pools

    @model_validator(mode="after")
    def _proxy_ttl_spans_polls(self) -> Settings:
        if self.controller.proxy_ttl_s < 2 * self.proxy.routing_poll_s:
            raise PydanticCustomError(
                "proxy_ttl",
                "{message}",
                {
                    "message": f"controller.proxy_ttl_s ({self.controller.proxy_ttl_s:g}) must be at least "
                    f"two routing polls (2 x proxy.routing_poll_s = {2 * self.proxy.routing_poll_s:g}): "
                    "a live proxy would be counted dead between its polls",
                    "loc": ("controller", "proxy_ttl_s"),
                },
            )
        return self

    @model_validator(mode="after")
    def _one_handoff_mode(self) -> Settings:
        modes = {pool.handoff: name for name, pool in self.pools.items()}
        if len(modes) > 1:
            raise PydanticCustomError(
                "handoff_mode",
                "{message}",
                {
                    "message": f"pools.{modes['push']}.handoff is push and pools.{modes['pull']}.handoff "
                    "is pull: a fleet hands off in one mode (a push P cannot serve a pull D)",
                    "loc": ("pools", modes["push"], "handoff"),
                },
            )
        return self

    @property
    def handoff(self) -> str:
        """The fleet's KV handoff mode (every pool's ``handoff``)."""
        return next(iter(self.pools.values())).handoff if self.pools else "pull"

    @model_validator(mode="after")
    def _precise_needs_tokenizer(self) -> Settings:
        if self.proxy.kv_aware.mode == "precise" and self.model.tokenizer is None:
            raise PydanticCustomError(
                "kv_aware_tokenizer",
                "{message}",
                {
                    "message": "proxy.kv_aware.mode precise tokenizes prompts with model.tokenizer, "
                    f"which is unset (set it to {SIM_TOKENIZER!r} or a tokenizer path, or use approximate)",
                    "loc": ("proxy", "kv_aware", "mode"),
                },
            )
        return self

    # -- lookups used by every service -------------------------------------------------

    def instances(self, role: Role | None = None) -> Iterator[tuple[str, Instance]]:
        """Yield ``(pool_name, instance)`` for every instance, optionally of one role."""
        for pool_name, pool in self.pools.items():
            if role is None or pool.role == role:
                for inst in pool.instances:
                    yield pool_name, inst

    def priority_scheduled(self) -> frozenset[str]:
        """The instances whose vLLM runs ``--scheduling-policy priority`` (their own ``scheduling``, else
        their pool's): those a request's ``priority`` is sent to."""
        return frozenset(
            inst.name
            for pool in self.pools.values()
            for inst in pool.instances
            if pool.scheduling_of(inst) == "priority"
        )

    def pool_of(self, instance_name: str) -> str | None:
        for pool_name, inst in self.instances():
            if inst.name == instance_name:
                return pool_name
        return None

    def proxy_tokens(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """token -> proxy identity, from ``$controller.proxy_tokens_env``; empty when unset (open).

        Raises ConfigError naming the variable when an entry is not ``name:token``.
        """
        name = self.controller.proxy_tokens_env
        raw = (os.environ if environ is None else environ).get(name, "")
        try:
            by_name = parse_named_tokens(raw, name)
        except ValueError as exc:
            raise ConfigError([str(exc)]) from exc
        return {token: who for who, token in by_name.items()}

    def proxy_secret(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The fleet's proxy secret from ``$controller.proxy_secret_env``; None when unset or empty.

        Raises ConfigError naming the variable when it is shorter than 16 characters.
        """
        name = self.controller.proxy_secret_env
        raw = (os.environ if environ is None else environ).get(name, "").strip()
        if raw and len(raw) < MIN_PROXY_SECRET_CHARS:
            raise ConfigError([f"${name}: a proxy secret of at least {MIN_PROXY_SECRET_CHARS} characters"])
        return raw or None

    def api_token(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The controller API token, read from the variable named in the file."""
        env = os.environ if environ is None else environ
        token = env.get(self.controller.api_token_env)
        return token or None

    @property
    def controller_url(self) -> str:
        return self.proxy.controller_url or f"http://{self.controller.host}:{self.controller.port}"

    @property
    def controller_urls(self) -> list[str]:
        """Where the proxy polls the routing table, in the order it tries them."""
        return list(self.proxy.controller_urls or [self.controller_url])

    @property
    def collector_url(self) -> str:
        return f"http://{self.collector.host}:{self.collector.port}"
