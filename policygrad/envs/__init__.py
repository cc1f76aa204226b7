"""Multi-turn environments: the protocol, the registry, the token bookkeeping of episodes."""

from policygrad.envs.base import STOP_REASONS, Environment, EnvironmentFailure, StepResult
from policygrad.envs.registry import BUILTIN_ENVIRONMENTS, environment_factory

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "STOP_REASONS",
    "Environment",
    "EnvironmentFailure",
    "StepResult",
    "environment_factory",
]
