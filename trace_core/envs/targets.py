"""The target environment named by `env.domain`: a τ²-bench domain or ToolSandbox (optional extra)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trace_core.envs.base import Environment
from trace_core.schemas import Instance


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


def training_instances(domain: str, source: str, split: str) -> list[Instance]:
    """The target's own training tasks for the equal-budget baselines (GRPO on the target, GEPA): every instance of
    the training split `split` (params `baseline.tau2_split`), unsampled. ToolSandbox: its offline scenarios of
    that half (all augmentations); τ²: the official split. A procedural source has no split: its training tasks are
    a procedural stream (`trace_core.baselines.target.TargetEnv`)."""
    if source == "toolsandbox":
        from trace_core.envs.toolsandbox import split_instances

        return split_instances(split, per_family=None, seed=0)  # unsampled: the seed draws nothing
    if source == "tau2":
        from trace_core.envs.tau2_env import official_instances

        return official_instances(domain, split)
    raise ValueError(f"baseline.source={source!r} has no training split for env.domain={domain}; set "
                     "baseline.source to the target's own instances (tau2 or toolsandbox) and baseline.tau2_split")


def task_group(instance: Instance) -> str:
    """The task an instance is a version of: ToolSandbox's augmentations of one base scenario (distraction tools,
    scrambled names) are one task; any other instance is its own. Training and evaluation never share a group."""
    return str(instance.meta.get("base_scenario") or instance.instance_id)


def scripted_user(domain: str, max_turns: int) -> Callable[[], Any]:
    """A maker of the target's own scripted user: ToolSandbox's (answers a question with the scenario's task
    text), τ²'s `ScriptedUser` otherwise."""
    if domain == "toolsandbox":
        from trace_core.envs.toolsandbox import ToolSandboxUser

        return lambda: ToolSandboxUser(max_turns=max_turns)
    from trace_core.envs.users import ScriptedUser

    return lambda: ScriptedUser(max_turns=max_turns)


def graded_reward(domain: str) -> bool:
    """Whether the target's reward is a graded score rather than pass/fail: ToolSandbox's similarity in [0, 1]
    (its reports give the mean similarity and the count of perfect, 1.0, scenarios); τ²'s reward is 0 or 1."""
    return domain == "toolsandbox"
