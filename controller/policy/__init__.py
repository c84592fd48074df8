"""The controller's pure policy: weights, admission limits, overrides and alert states.

No I/O and no clock: every function takes the observation (which carries ``now``) and
the state carried from the previous tick, and returns values. Tests replay tables of
observations through :func:`decide` with a virtual clock.
"""

from controller.policy.admission import LimitState, PoolDecision, decide_pools
from controller.policy.alerts import AlertConfig, AlertRule, AlertState, AlertStep, default_rules, step_alerts
from controller.policy.config import PolicyConfig
from controller.policy.routes import InstanceSpec, Override, PoolSpec, ServedInstance, build_table
from controller.policy.signals import InstanceSignals, Observation, PairSignals, PoolSignals, SLOFigures
from controller.policy.tick import PolicyState, TickInput, TickOutput, compose, decide
from controller.policy.weights import WeightDecision, WeightState, decide_weights

__all__ = [
    "AlertConfig",
    "AlertRule",
    "AlertState",
    "AlertStep",
    "InstanceSignals",
    "InstanceSpec",
    "LimitState",
    "Observation",
    "Override",
    "PairSignals",
    "PolicyConfig",
    "PolicyState",
    "PoolDecision",
    "PoolSignals",
    "PoolSpec",
    "SLOFigures",
    "ServedInstance",
    "TickInput",
    "TickOutput",
    "WeightDecision",
    "WeightState",
    "build_table",
    "compose",
    "decide",
    "decide_pools",
    "decide_weights",
    "default_rules",
    "step_alerts",
]
