"""Reference plans for ToolSandbox scenarios (which ship no reference trajectories), and the oracle that plays them.

A plan is a list of steps, each `{"call": tool, "arguments": {...}}` (execution-facing tool name) or
`{"say": text}` (a message to the user). `reference_plan(base)` derives it from the base scenario's milestones, in
milestone order:

- a SANDBOX milestone on an execution-environment message with a `tool_trace` -> that call (the first candidate
  when the trace lists several);
- a SANDBOX milestone on an agent -> user message -> say its `content`;
- a SETTING snapshot (e.g. `{"wifi": false}`) -> the setting's setter;
- CONTACT / MESSAGING / REMINDER addition, update and removal milestones -> add_contact / modify_contact /
  remove_contact, send_message_with_phone_number, add_reminder / modify_reminder / remove_reminder with the
  milestone's values;
- no milestone at all (insufficient information) -> say that it cannot be done.

A milestone whose target depends on an earlier tool result (`tool_trace_dependant_similarity`, e.g. the days till a
holiday) becomes a step with a `fill`: the oracle completes its arguments or text with ToolSandbox's own extractor
applied to that earlier step's result. `HAND_WRITTEN` holds plans written by hand where derivation fails; a
scenario with neither has no plan (None).
Augmented variants (distraction tools, scrambled names or descriptions) share their base scenario's plan.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

from trace_core.schemas import Action

_SETTERS = {
    "wifi": "set_wifi_status",
    "cellular": "set_cellular_service_status",
    "location_service": "set_location_service_status",
    "low_battery_mode": "set_low_battery_mode_status",
}
CANNOT = "I'm sorry, I cannot do that: I don't have the tools or information needed."

# Plans written by hand for scenarios whose milestones cannot be turned into calls statically (none yet).
HAND_WRITTEN: dict[str, list[dict[str, Any]]] = {}


@dataclass
class Plan:
    steps: list[dict[str, Any]]
    source: str  # "milestones" | "hand"
    notes: list[str] = field(default_factory=list)

    def messages(self) -> list[str]:
        """What the plan tells the user, where it is fixed text (the milestones' expected agent messages)."""
        return [s["say"] for s in self.steps if "say" in s and not s.get("fill") and s["say"] != CANNOT]

    def actions(self) -> list[Action]:
        return [Action(name=s["call"], arguments=s.get("arguments", {})) for s in self.steps if "call" in s]


class NotDerivable(ValueError):
    pass


def _clean(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if v is not None and k != "sandbox_message_index"}


def _constraint_steps(c: Any) -> list[dict[str, Any]]:
    fn = getattr(c.snapshot_constraint, "func", c.snapshot_constraint).__name__
    ns = str(c.database_namespace)
    rows = c.target_dataframe.to_dicts() if c.target_dataframe is not None else []
    if fn == "guardrail_similarity":
        return []
    if fn == "tool_trace_dependant_similarity":
        return _dependent_steps(c, rows)
    steps: list[dict[str, Any]] = []
    for row in rows:
        row = _clean(row)
        if ns == "SANDBOX" and fn == "snapshot_similarity":
            if row.get("sender") == "EXECUTION_ENVIRONMENT" and "tool_trace" in row:
                trace = json.loads(row["tool_trace"])
                trace = trace[0] if isinstance(trace, list) else trace
                steps.append({"call": trace["tool_name"], "arguments": dict(trace.get("arguments") or {})})
            elif row.get("sender") == "AGENT" and row.get("recipient") == "USER" and "content" in row:
                steps.append({"say": row["content"]})
            else:
                raise NotDerivable(f"a SANDBOX milestone of an unknown shape: {sorted(row)}")
        elif ns == "SETTING" and fn == "snapshot_similarity":
            for key, value in row.items():
                if key not in _SETTERS:
                    raise NotDerivable(f"a SETTING milestone on {key!r}")
                steps.append({"call": _SETTERS[key], "arguments": {"on": bool(value)}})
        elif ns == "CONTACT":
            if fn == "addition_similarity":
                steps.append({"call": "add_contact", "arguments": {k: v for k, v in row.items()
                                                                    if k in ("name", "phone_number", "relationship",
                                                                             "is_self")}})
            elif fn == "removal_similarity":
                steps.append({"call": "remove_contact", "arguments": {"person_id": row["person_id"]}})
            elif fn == "update_similarity":
                args = {k: v for k, v in row.items() if k in ("person_id", "name", "phone_number", "relationship")}
                steps.append({"call": "modify_contact", "arguments": args})
            else:
                raise NotDerivable(f"a CONTACT milestone with {fn}")
        elif ns == "MESSAGING" and fn == "addition_similarity":
            steps.append({"call": "send_message_with_phone_number",
                          "arguments": {"phone_number": row["recipient_phone_number"], "content": row["content"]}})
        elif ns == "REMINDER":
            keys = ("content", "reminder_timestamp", "latitude", "longitude")
            if fn == "addition_similarity":
                steps.append({"call": "add_reminder", "arguments": {k: v for k, v in row.items() if k in keys}})
            elif fn == "update_similarity":
                args = {k: v for k, v in row.items() if k in keys or k == "reminder_id"}
                steps.append({"call": "modify_reminder", "arguments": args})
            elif fn == "removal_similarity":
                steps.append({"call": "remove_reminder", "arguments": {"reminder_id": row["reminder_id"]}})
            else:
                raise NotDerivable(f"a REMINDER milestone with {fn}")
        else:
            raise NotDerivable(f"a {ns} milestone with {fn}")
    return steps


def _dependent_steps(c: Any, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A milestone whose target is completed from the tool trace of an earlier milestone (its
    `reference_milestone_node_index`) by a ToolSandbox extractor: the step records the extractor and the
    milestone it reads (`fill`), and `play_plan` completes it from that step's result when it plays it."""
    keywords = getattr(c.snapshot_constraint, "keywords", {}) or {}
    extractor = getattr(keywords.get("extractor"), "__name__", None)
    fill_to = keywords.get("fill_to")
    if extractor is None or c.reference_milestone_node_index is None or fill_to not in ("tool_trace", "content"):
        raise NotDerivable("a tool_trace_dependant_similarity milestone without extractor or reference")
    fill = {"milestone": c.reference_milestone_node_index, "extractor": extractor}
    steps = []
    for row in map(_clean, rows):
        if fill_to == "tool_trace":
            trace = json.loads(row["tool_trace"])
            trace = trace[0] if isinstance(trace, list) else trace
            steps.append({"call": trace["tool_name"], "arguments": dict(trace.get("arguments") or {}),
                          "fill": [fill]})
        else:
            steps.append({"say": row["content"], "fill": [fill]})
    return steps


def _changes_state(milestone: Any) -> bool:
    return any(str(c.database_namespace) != "SANDBOX"
               and getattr(c.snapshot_constraint, "func", c.snapshot_constraint).__name__ != "guardrail_similarity"
               for c in milestone.snapshot_constraints)


def _milestone_order(matcher: Any) -> list[int]:
    """The milestones in an order their DAG allows; among those ready at once, state changes (settings, contacts,
    ...) first. The evaluator's guardrails require the other databases unchanged between a milestone and the
    milestones it reads, so e.g. wifi must be on before the timestamp a later difference is computed from."""
    import networkx as nx

    dag = matcher.milestone_dag
    ms = matcher.milestones
    return list(nx.lexicographical_topological_sort(dag, key=lambda i: (0 if _changes_state(ms[i]) else 1, i)))


def derive_plan(scenario: Any) -> Plan:
    """A plan from `scenario`'s milestones (raises NotDerivable when one cannot be turned into a step)."""
    milestones = scenario.evaluation.milestone_matcher.milestones
    if not milestones:
        return Plan([{"say": CANNOT}], "milestones")
    steps: list[dict[str, Any]] = []
    step_of: dict[int, int] = {}  # milestone index -> the plan step that satisfies it
    for i in _milestone_order(scenario.evaluation.milestone_matcher):
        for c in milestones[i].snapshot_constraints:
            for step in _constraint_steps(c):
                for f in step.get("fill", []):
                    if f["milestone"] not in step_of:
                        raise NotDerivable(f"milestone {i} reads milestone {f['milestone']}, which has no step")
                    f["step"] = step_of[f["milestone"]]
                prev = steps[-1] if steps else None
                if (prev is not None and "call" in step and prev.get("call") == step["call"] and "fill" in step
                        and "fill" in prev):
                    prev["fill"].extend(step["fill"])  # two milestones on the same call's arguments
                else:
                    steps.append(step)
                step_of[i] = len(steps) - 1
    _fill_open_arguments(steps)
    return Plan(steps, "milestones")


# A milestone that names a search tool with no arguments accepts any arguments, but the tool itself refuses a call
# without a criterion: give it one that every record meets.
_EARLIEST = 315529200.0  # the tools' minimum valid timestamp (1980-01-01)
_MATCH_ALL = {
    "search_messages": {"creation_timestamp_lowerbound": _EARLIEST},
    "search_reminder": {"creation_timestamp_lowerbound": _EARLIEST},
    "search_contacts": {"is_self": False},
}


def _fill_open_arguments(steps: list[dict[str, Any]]) -> None:
    """Complete calls whose milestone leaves the arguments open: search tools get a match-all criterion, and a
    `datetime_info_to_timestamp` call gets the date and time of the first later step's `reminder_timestamp`
    (in the process's local time, as the tool computes it)."""
    import datetime as dt

    for i, step in enumerate(steps):
        if "call" not in step or step.get("arguments") or step.get("fill"):
            continue
        if step["call"] in _MATCH_ALL:
            step["arguments"] = dict(_MATCH_ALL[step["call"]])
        elif step["call"] == "datetime_info_to_timestamp":
            later = next((s["arguments"]["reminder_timestamp"] for s in steps[i + 1:]
                          if "call" in s and "reminder_timestamp" in s.get("arguments", {})), None)
            if later is not None:
                d = dt.datetime.fromtimestamp(float(later))
                step["arguments"] = {"year": d.year, "month": d.month, "day": d.day, "hour": d.hour,
                                     "minute": d.minute, "second": d.second}


@functools.lru_cache(maxsize=None)
def reference_plan(base: str) -> Plan | None:
    """The reference plan of base scenario `base` (hand-written if there is one, else derived), or None."""
    if base in HAND_WRITTEN:
        return Plan(HAND_WRITTEN[base], "hand")
    from trace_core.envs.toolsandbox import scenarios

    sc = scenarios().get(base)
    if sc is None:
        return None
    try:
        return derive_plan(sc)
    except NotDerivable:
        return None


def not_derivable_reason(base: str) -> str | None:
    from trace_core.envs.toolsandbox import scenarios

    try:
        derive_plan(scenarios()[base])
    except NotDerivable as exc:
        return str(exc)
    return None


def play_plan(env: Any, instance: Any, limits: Any = None):
    """The oracle: play the instance's reference plan through `env` (tool names mapped to what the agent sees),
    with a scripted user that acknowledges every plan message but the last; return the finished episode."""
    from trace_core.envs.base import EpisodeLimits
    from trace_core.envs.oracle import CONTROL_USER_TURNS
    from trace_core.envs.toolsandbox import ToolSandboxUser
    from trace_core.schemas import Message, ToolCall

    steps = list(instance.meta.get("reference_plan") or [])
    if not steps or "say" not in steps[-1]:
        steps.append({"say": "Done."})
    says = sum(1 for s in steps if "say" in s)
    user = ToolSandboxUser(max_turns=CONTROL_USER_TURNS, replies=["OK."] * (says - 1))
    ep = env.start(instance, user, limits or EpisodeLimits(max_steps=len(steps) + 4, max_errors=100))
    results: dict[int, Any] = {}
    for i, step in enumerate(steps):
        if ep.done:
            break
        values: dict[str, Any] = {}
        for f in step.get("fill", []):
            values.update(_extract(f["extractor"], results.get(f["step"])))
        if "call" in step:
            name = env.agent_tool_name(instance, step["call"])
            out = ep.step(Message(role="assistant", tool_calls=[ToolCall(
                id=f"ref_{i}", name=name, arguments={**step.get("arguments", {}), **values})]))
            results[i] = _literal(out.observations[0].content if out.observations else None)
        else:
            text = step["say"]
            if values:
                try:
                    text = text.format(**values)
                except (KeyError, IndexError, ValueError):
                    pass
            ep.step(Message(role="assistant", content=text))
    while not ep.done:
        ep.step(Message(role="assistant", content="Goodbye."))
    return ep


def _literal(text: str | None) -> Any:
    import ast

    try:
        return ast.literal_eval(text) if text is not None else None
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None


def _extract(extractor: str, result: Any) -> dict[str, Any]:
    """The first value ToolSandbox's extractor `extractor` reads from a trace with this result ({} if none)."""
    from tool_sandbox.common import tool_trace_extractors

    fn = getattr(tool_trace_extractors, extractor, None)
    try:
        found = fn({"result": result}) if fn is not None else []
    except (KeyError, IndexError, TypeError, ValueError):
        found = []
    return dict(found[0]) if found else {}


def do_nothing(env: Any, instance: Any):
    """The do-nothing control: no tool call, one polite message; the scripted user then ends the conversation."""
    from trace_core.envs.base import EpisodeLimits
    from trace_core.envs.oracle import CONTROL_USER_TURNS
    from trace_core.envs.toolsandbox import ToolSandboxUser
    from trace_core.schemas import Message

    user = ToolSandboxUser(max_turns=CONTROL_USER_TURNS)
    ep = env.start(instance, user, EpisodeLimits(max_steps=4, max_errors=100))
    while not ep.done:
        ep.step(Message(role="assistant", content="Okay."))
    return ep


def sweep(instances: list[Any], env: Any = None) -> list[dict[str, Any]]:
    """Oracle and do-nothing scores per instance: ToolSandbox's similarity, the milestone mapping, and why an
    instance has no plan."""
    from trace_core.envs.toolsandbox import ToolSandboxEnvironment

    env = env or ToolSandboxEnvironment("full")  # one tool set per scenario: the profile changes nothing
    rows = []
    for inst in instances:
        row: dict[str, Any] = {"scenario": inst.meta["scenario"], "augmentation": inst.meta["augmentation"],
                               "family": inst.family}
        if inst.meta.get("reference_plan") is None:
            row.update(oracle=None, why=not_derivable_reason(inst.meta["base_scenario"]))
        else:
            r = play_plan(env, inst).score()
            row.update(oracle=r.reward, milestones=r.info.get("milestone_mapping"), error=r.info.get("error"))
        row["do_nothing"] = do_nothing(env, inst).score().reward
        rows.append(row)
    return rows
