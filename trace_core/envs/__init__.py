"""Target environments: the episode interface, the τ²-bench adapter, procedural task families and user simulators."""

from trace_core.envs.base import STOP_TOKENS, Environment, Episode, StepResult

__all__ = ["STOP_TOKENS", "Environment", "Episode", "StepResult"]
