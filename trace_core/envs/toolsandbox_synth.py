"""Generated ToolSandbox scenarios: new tasks on ToolSandbox's own tools, databases and evaluator.

A spec (a JSON-able dict, kept in the instance's `meta["ts_spec"]`, so any process rebuilds the same scenario)
names one write task and the device state it starts from:

    {"task": "send_message", "phone_number": "+1...", "content": "...",       # or
     "task": "add_contact", "name": "...", "phone_number": "+1...", "relationship": "...",
     "request": "<the user's words>", "off": ["cellular"], "low_battery": false, "distractors": 3}

`build_scenario` starts from ToolSandbox's own base scenario (its contacts, messages and reminders), applies the
device state, writes the user's request as the pre-written first message, allows the task's tool plus
`distractors` other offline tools, and sets milestones the way ToolSandbox's own scenarios do: each setting the
task depends on (low battery mode off, then cellular on) as a SETTING snapshot, then the write as a MESSAGING or
CONTACT addition. `reference_actions(spec)` is the matching call sequence.
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

from trace_core.schemas import Action

_TOOL = {"send_message": "send_message_with_phone_number", "add_contact": "add_contact"}
# Offline tools a generated scenario may add as distractors, in a fixed order.
DISTRACTORS = (
    "search_contacts", "search_messages", "get_current_timestamp", "search_reminder", "add_reminder",
    "get_wifi_status", "get_cellular_service_status", "modify_contact", "timestamp_diff", "unit_conversion",
    "get_current_location", "remove_contact",
)


@functools.lru_cache(maxsize=1)
def _base() -> Any:
    from tool_sandbox.common.tool_discovery import ToolBackend
    from tool_sandbox.scenarios.base_scenarios import named_base_scenarios

    return named_base_scenarios(preferred_tool_backend=ToolBackend.DEFAULT)["base"]


def needs_settings(spec: dict[str, Any]) -> list[tuple[str, bool]]:
    """The settings changes the task requires, in order (ToolSandbox's tools refuse otherwise)."""
    steps: list[tuple[str, bool]] = []
    if spec.get("low_battery") and "cellular" in spec.get("off", []):
        steps.append(("low_battery_mode", False))
    if spec["task"] == "send_message" and "cellular" in spec.get("off", []):
        steps.append(("cellular", True))
    return steps


def reference_actions(spec: dict[str, Any]) -> list[Action]:
    setter = {"low_battery_mode": "set_low_battery_mode_status", "cellular": "set_cellular_service_status"}
    actions = [Action(name=setter[k], arguments={"on": v}) for k, v in needs_settings(spec)]
    if spec["task"] == "send_message":
        actions.append(Action(name=_TOOL["send_message"],
                              arguments={"phone_number": spec["phone_number"], "content": spec["content"]}))
    else:
        actions.append(Action(name="add_contact", arguments={"name": spec["name"], "phone_number": spec["phone_number"],
                                                             "relationship": spec["relationship"]}))
    return actions


@functools.lru_cache(maxsize=256)
def build_scenario(spec_json: str) -> Any:
    import polars as pl
    from tool_sandbox.common.evaluation import (
        Evaluation,
        Milestone,
        MilestoneMatcher,
        SnapshotConstraint,
        addition_similarity,
        snapshot_similarity,
    )
    from tool_sandbox.common.execution_context import DatabaseNamespace, RoleType
    from tool_sandbox.scenarios.user_simulator_few_shot_examples import USER_INSTRUCTION

    spec = json.loads(spec_json)
    if spec.get("task") not in _TOOL:
        raise ValueError(f"generated ToolSandbox spec: task must be one of {sorted(_TOOL)}, got {spec.get('task')!r}")
    scenario = copy.deepcopy(_base())
    ctx = scenario.starting_context
    flips = [pl.lit(False).alias(c) for c in spec.get("off", [])]
    if spec.get("low_battery"):
        flips.append(pl.lit(True).alias("low_battery_mode"))
    if flips:
        ctx.update_database(namespace=DatabaseNamespace.SETTING,
                            dataframe=ctx.get_database(namespace=DatabaseNamespace.SETTING).with_columns(flips))
    ctx.add_to_database(namespace=DatabaseNamespace.SANDBOX, rows=[
        {"sender": RoleType.SYSTEM, "recipient": RoleType.USER, "content": USER_INSTRUCTION + spec["request"]},
        {"sender": RoleType.USER, "recipient": RoleType.AGENT, "content": spec["request"]},
    ])
    tools = [a.name for a in reference_actions(spec)]
    tools += [t for t in DISTRACTORS if t not in tools][: int(spec.get("distractors", 0))]
    ctx.tool_allow_list = sorted(set(tools))
    milestones = [
        Milestone(snapshot_constraints=[SnapshotConstraint(
            database_namespace=DatabaseNamespace.SETTING, snapshot_constraint=snapshot_similarity,
            target_dataframe=pl.DataFrame({key: value}))])
        for key, value in needs_settings(spec)
    ]
    if spec["task"] == "send_message":
        namespace = DatabaseNamespace.MESSAGING
        row = {"recipient_phone_number": spec["phone_number"], "content": spec["content"]}
    else:
        namespace = DatabaseNamespace.CONTACT
        row = {"name": spec["name"], "phone_number": spec["phone_number"], "relationship": spec["relationship"]}
    milestones.append(Milestone(
        # The addition is judged against the database at the previous milestone (-1: the starting state).
        snapshot_constraints=[SnapshotConstraint(database_namespace=namespace, snapshot_constraint=addition_similarity,
                                                 target_dataframe=pl.DataFrame([row]),
                                                 reference_milestone_node_index=len(milestones) - 1)],
        guardrail_database_exclusion_list=[DatabaseNamespace.SETTING] if len(milestones) else None,
    ))
    scenario.evaluation = Evaluation(milestone_matcher=MilestoneMatcher(milestones=milestones))
    return scenario
