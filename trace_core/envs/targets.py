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


def write_tools(domain: str) -> frozenset[str]:
    """The tools of `domain` that change state (τ²: its own annotations; ToolSandbox: its catalogue's)."""
    if domain == "toolsandbox":
        from trace_core.envs.toolsandbox import tool_catalogue

        return tool_catalogue()[1]
    from trace_core.envs.tau2_env import write_tools as tau2_write_tools

    return tau2_write_tools(domain)


def all_tool_schemas(domain: str, profile: str) -> list[dict]:
    """Every tool schema the target can offer (τ²: the domain's tools in `profile`; ToolSandbox: every agent tool
    under its plain and its scrambled name)."""
    if domain == "toolsandbox":
        from trace_core.envs.toolsandbox import tool_catalogue

        return list(tool_catalogue()[0].values())
    return target_env(domain, profile).tool_schemas()
