"""The target environment named by `env.domain`: a τ²-bench domain or ToolSandbox (optional extra)."""

from __future__ import annotations

from trace_core.envs.base import Environment


def target_env(domain: str, profile: str) -> Environment:
    """`Tau2Environment(domain, profile)` for a τ² domain; `ToolSandboxEnvironment` for "toolsandbox" (it has one
    tool set per scenario, so `profile` changes nothing there)."""
    if domain == "toolsandbox":
        from trace_core.envs.toolsandbox import ToolSandboxEnvironment

        return ToolSandboxEnvironment(profile)
    from trace_core.envs.tau2_env import Tau2Environment

    return Tau2Environment(domain, profile)
