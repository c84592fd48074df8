"""One run's services: bench/goodput's simulated fleet and pdscope proxy (its ``static`` contender:
the weighted policy, the config's admission defaults with the proxy's own adaptive limit and admission by
prediction, no controller), with the run's ``tenants`` section in the generated pdscope.yaml.
``scheduling: priority``: every pool and every simulated instance priority-scheduled (vLLM
``--scheduling-policy priority``). A scenario's ``fleet`` changes the pools' request slots and the
simulated decode step's time per sequence.

``proxy_tree``: the proxy alone runs from another checkout (a worktree of a branch: its path is the
proxy's working directory and first on its PYTHONPATH); the fleet and the client run from this one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.goodput.stack import Stack, StackSpec
from bench.tenants.scenarios import Fleet
from pdscope.stack import Child, child_env, pdscope_argv


class TenantStack(Stack):
    """``with TenantStack(spec, tmp, tenants) as s:`` as :class:`bench.goodput.stack.Stack`."""

    def __init__(
        self,
        spec: StackSpec,
        tmp: Path,
        tenants: dict[str, Any],
        proxy_tree: str | None = None,
        scheduling: str = "fcfs",
        fleet: Fleet | None = None,
    ) -> None:
        self.tenants, self.proxy_tree, self.scheduling, self.fleet = tenants, proxy_tree, scheduling, fleet
        super().__init__(spec, tmp)

    def _config(self, dead: str) -> dict[str, Any]:
        config = {**super()._config(dead), "tenants": self.tenants}
        if self.scheduling != "fcfs":
            for pool in config["pools"].values():
                pool["scheduling"] = self.scheduling
            config["simulator"]["scheduling_policy"] = self.scheduling
        if self.fleet is not None:
            config["proxy"]["admission"]["max_inflight_requests"] = self.fleet.pool_slots
            config["simulator"]["decode_per_seq_s"] = self.fleet.decode_per_seq_s
        return config

    def _start(self, command: str, ready_url: str | None = None) -> None:
        if command != "proxy" or self.proxy_tree is None:
            super()._start(command, ready_url)
            return
        argv = pdscope_argv(self.config, command, log_level="WARNING")
        env = child_env({"PYTHONPATH": self.proxy_tree})
        log, cwd = self.tmp / f"{command}.log", Path(self.proxy_tree)
        self.children.start(Child(command, argv, log, ready_url=ready_url, env=env, cwd=cwd))
