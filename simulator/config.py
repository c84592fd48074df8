"""Validate a ``simulator:`` mapping handed to the simulator directly (tests, in-process fleets).

The section's model is ``pdscope.simconfig.SimulatorConfig`` (``Settings.simulator``); this
module only turns a plain mapping into it, with a ``ConfigError`` naming each bad field.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from pdscope.config import ConfigError
from pdscope.simconfig import SimulatorConfig


def parse_simulator_config(data: dict[str, Any] | None, source: str = "simulator") -> SimulatorConfig:
    """Validate the ``simulator:`` mapping; raise ConfigError naming each bad field."""
    try:
        return SimulatorConfig.model_validate(data or {})
    except ValidationError as exc:
        problems = [f"{source}.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()]
        raise ConfigError(problems) from exc
