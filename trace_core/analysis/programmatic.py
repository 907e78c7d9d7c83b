"""Programmatic labeller: capability labels from a trajectory's tool calls against its instance's reference actions.

Works wherever instances carry reference actions (official τ² tasks, our procedural families). Each detector
answers NA (not needed, or never reached), PRESENT or LACKING with a one-line reason. The detectors split the
blame for one mistake deliberately, so that one injected deficit shows up as one capability:

- a wrong argument value whose *right* value (or the wrong one) was in an earlier tool result is a **data
  reasoning** failure; any other wrong or mis-formatted value, a missing/unknown key or a malformed call is a
  **precision** failure;
- a reference write never attempted (no call to that tool) is **multi-step completion**; an attempted one with
  wrong arguments is not;
- a write on a refusal task, a successful write the reference lacks, or a write before the reads the reference
  does on the same entity is **precondition verification**;
- identification counts as shown when the agent looked the user up with the right details, even if the call
  itself was mangled (that is precision).

Deterministic: one labelling run (`LabelSet.runs == 1`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from trace_core.analysis.base import Item, LabelSet, label_row
from trace_core.schemas import Action, CapabilitySpec, Instance, Trajectory, answered_calls

CAPABILITIES: dict[str, tuple[str, str]] = {
    "tool_call_precision": (
        "tool-call precision",
        ("Emitting well-formed calls to existing tools with every required argument, no unknown ones, correct "
        "types, and values in the exact format the tool expects (ids, enums, lists)."),
    ),
    "multi_step_completion": (
        "multi-step task completion",
        ("Carrying a request that needs several actions through to the end: every required write is attempted, "
        "and the agent does not stop or hand back to the user before the work is done."),
    ),
    "structured_data_reasoning": (
        "structured data reasoning",
        ("Reading tool results (records, lists of variants, payment methods) and picking the right id or value "
        "from them when it is not given by the user."),
    ),
    "precondition_verification": (
        "precondition verification",
        ("Checking that the policy allows an action before taking it: reading the entity first, refusing "
        "forbidden requests, and making no writes the task does not call for."),
    ),
    "identification": (
        "user identification",
        ("Finding the user's account with the details the user gave (e-mail, or name and zip code) before "
        "acting on it."),
    ),
    "required_communication": (
        "required communication",
        "Telling the user the facts the task requires (amounts, statuses, results of look-ups) in a message.",
    ),
}

_TERMINATED_BY_AGENT_OR_USER = ("agent_stop", "user_stop", "max_steps")


@dataclass
class Call:
    """One agent tool call with what the agent had seen before making it."""

    position: int  # index in the message list
    name: str
    arguments: dict[str, Any]
    parse_error: str | None
    ok: bool  # the tool answered without an error
    observation: str
    seen: str  # lower-cased text of every tool result before this call


def _loose(value: Any) -> Any:
    """A formatting-blind form of a value: case, '#', spaces and punctuation removed; lists/dicts recursively."""
    if isinstance(value, str):
        return re.sub(r"[^0-9a-z]+", "", value.lower())
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return re.sub(r"[^0-9a-z]+", "", f"{float(value):.4f}".rstrip("0").rstrip("."))
    if isinstance(value, (list, tuple)):
        return tuple(_loose(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _loose(v)) for k, v in value.items()))
    return str(value)


def _atoms(value: Any) -> list[str]:
    """The scalar pieces of a value, as lower-case strings (lists and dicts flattened)."""
    if isinstance(value, dict):
        return [a for v in value.values() for a in _atoms(v)]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in _atoms(v)]
    if value is None or isinstance(value, bool):
        return []
    return [str(value).lower()]


def _appears(value: Any, text: str) -> bool:
    atoms = _atoms(value)
    return bool(atoms) and all(a in text for a in atoms)


def extract_calls(trajectory: Trajectory) -> list[Call]:
    """The agent's tool calls in order, each with its observation and the tool results seen before it."""
    messages = trajectory.messages
    calls: list[Call] = []
    for pos, call, answer in answered_calls(messages):
        seen = "\n".join((m.raw or m.content or "").lower() for m in messages[:pos] if m.role == "tool")
        calls.append(
            Call(
                position=pos,
                name=call.name,
                arguments=call.arguments if isinstance(call.arguments, dict) else {},
                parse_error=call.parse_error,
                ok=answer is not None and not answer.error,
                observation=(answer.raw or answer.content or "") if answer else "",
                seen=seen,
            )
        )
    return calls


def _schema_problem(call: Call, schemas: dict[str, dict]) -> str | None:
    """What is structurally wrong with a call (malformed, unknown tool, keys, types), or None."""
    if call.parse_error:
        return f"malformed call ({call.parse_error[:80]})"
    schema = schemas.get(call.name)
    if schema is None:
        return f"unknown tool {call.name!r}"
    params = schema.get("parameters", {}) if "parameters" in schema else schema.get("function", {}).get("parameters", {})
    props: dict[str, dict] = params.get("properties", {}) or {}
    missing = [k for k in params.get("required", []) if k not in call.arguments]
    if missing:
        return f"{call.name} without {', '.join(missing)}"
    extra = [k for k in call.arguments if props and k not in props]
    if extra:
        return f"{call.name} with unknown argument(s) {', '.join(extra)}"
    for key, value in call.arguments.items():
        want = (props.get(key) or {}).get("type")
        if want and not _type_ok(value, want):
            return f"{call.name}.{key} should be {want}, got {type(value).__name__}"
    return None


def _type_ok(value: Any, want: str | list) -> bool:
    if isinstance(want, list):
        return any(_type_ok(value, w) for w in want)
    return {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "array": lambda v: isinstance(v, list),
        "object": lambda v: isinstance(v, dict),
        "null": lambda v: v is None,
    }.get(want, lambda v: True)(value)


def _pair(reference: list[Action], calls: list[Call]) -> list[tuple[Action, Call | None]]:
    """Match each reference action to at most one agent call of the same tool: the one agreeing on most
    arguments (then: one that succeeded, then the earliest)."""
    used: set[int] = set()
    pairs: list[tuple[Action, Call | None]] = []
    for ref in reference:
        best, best_key = None, None
        for i, c in enumerate(calls):
            if i in used or c.name != ref.name or c.parse_error:
                continue
            agree = sum(1 for k, v in ref.arguments.items() if k in c.arguments and c.arguments[k] == v)
            loose = sum(1 for k, v in ref.arguments.items() if k in c.arguments and _loose(c.arguments[k]) == _loose(v))
            key = (agree, loose, c.ok, -i)
            if best_key is None or key > best_key:
                best, best_key = i, key
        if best is not None:
            used.add(best)
        pairs.append((ref, calls[best] if best is not None else None))
    return pairs


def _user_text(instance: Instance, trajectory: Trajectory) -> str:
    """Everything the user made available: the opening, the facts the user holds, and what the user said."""
    parts = [instance.opening or "", instance.user_goal, *instance.user_facts.values()]
    parts += [m.content or "" for m in trajectory.messages if m.role == "user"]
    return "\n".join(parts).lower()


@dataclass
class _Context:
    trajectory: Trajectory
    instance: Instance
    calls: list[Call]
    reference: list[Action]
    ref_writes: list[Action]
    write_pairs: list[tuple[Action, Call | None]]
    user_text: str


class ProgrammaticLabeller:
    """Detectors for the capabilities in `CAPABILITIES`, over (trajectory, instance with reference actions).

    `tool_schemas` maps tool name -> OpenAI function schema (either the `function` object or the whole tool
    entry); `write_tools` names the tools that change state."""

    name = "programmatic"

    def __init__(self, tool_schemas: dict[str, dict], write_tools: frozenset[str] | set[str]):
        self.schemas = {k: (v.get("function", v)) for k, v in tool_schemas.items()}
        self.write_tools = frozenset(write_tools)

    @classmethod
    def for_domain(cls, domain: str) -> ProgrammaticLabeller:
        """The labeller for a τ² domain: every tool of the domain (full profile) and its write tools; for
        "toolsandbox", every ToolSandbox agent tool (plain and scrambled names) and its state-changing ones."""
        if domain == "toolsandbox":
            from trace_core.envs.toolsandbox import tool_catalogue

            return cls(*tool_catalogue())
        from trace_core.envs.tau2_env import Tau2Environment, write_tools

        schemas = {t["function"]["name"]: t for t in Tau2Environment(domain, "full").tool_schemas()}
        return cls(schemas, write_tools(domain))

    def specs(self) -> list[CapabilitySpec]:
        return [
            CapabilitySpec(capability_id=cid, name=name, definition=definition, labeller="programmatic")
            for cid, (name, definition) in CAPABILITIES.items()
        ]

    # -- the detectors -----------------------------------------------------------------------------------------
    def judge(self, trajectory: Trajectory, instance: Instance | None) -> dict[str, tuple[str, str]]:
        """capability_id -> (label, reason) for one trajectory."""
        if instance is None or (not instance.reference_actions and not instance.must_refuse):
            return {cid: ("NA", "no reference actions") for cid in CAPABILITIES}
        reference = [a for a in instance.reference_actions if a.requestor == "assistant"]
        ref_writes = [a for a in reference if a.name in self.write_tools]
        calls = extract_calls(trajectory)
        ctx = _Context(
            trajectory=trajectory,
            instance=instance,
            calls=calls,
            reference=reference,
            ref_writes=ref_writes,
            write_pairs=_pair(ref_writes, calls),
            user_text=_user_text(instance, trajectory),
        )
        identification = self._identification(ctx)
        return {
            "tool_call_precision": self._precision(ctx),
            "multi_step_completion": self._multi_step(ctx, identification[0]),
            "structured_data_reasoning": self._data_reasoning(ctx),
            "precondition_verification": self._precondition(ctx),
            "identification": identification,
            "required_communication": self._communication(ctx),
        }

    def _wrong_values(self, ref: Action, call: Call) -> list[tuple[str, Any, Any, bool]]:
        """(key, reference value, agent value, formatting-only) for each argument the call gets wrong."""
        out = []
        for key, want in ref.arguments.items():
            if key not in call.arguments:
                continue  # a missing key is a schema problem, reported by precision
            got = call.arguments[key]
            if got != want:
                out.append((key, want, got, _loose(got) == _loose(want)))
        return out

    def _from_data(self, value: Any, ctx: _Context) -> bool:
        """A value the agent had to read from a tool result: the user never said it."""
        atoms = _atoms(value)
        return bool(atoms) and not all(a in ctx.user_text for a in atoms)

    def _precision(self, ctx: _Context) -> tuple[str, str]:
        if not ctx.reference and not ctx.calls:
            return "NA", "no tool call needed"
        for c in ctx.calls:
            problem = _schema_problem(c, self.schemas)
            if problem:
                return "LACKING", problem
        # Values are checked on the calls that matter for the outcome (writes and user look-ups); reads of other
        # records are exploration, not imprecision.
        lookups = [a for a in ctx.reference if a.name.startswith("find_")]
        for ref, call in ctx.write_pairs + _pair(lookups, ctx.calls):
            if call is None:
                continue
            for key, want, got, formatting in self._wrong_values(ref, call):
                if formatting:
                    return "LACKING", f"{ref.name}.{key}={got!r} is mis-formatted (expected {want!r})"
                data_slip = self._from_data(want, ctx) and (_appears(want, call.seen) or _appears(got, call.seen))
                if not data_slip:
                    return "LACKING", f"{ref.name}.{key}={got!r}, expected {want!r}"
        if not ctx.calls:
            return "NA", "no tool call made"
        return "PRESENT", "every call well-formed with the right values"

    def _multi_step(self, ctx: _Context, identification: str) -> tuple[str, str]:
        if not ctx.ref_writes or len(ctx.reference) < 2:
            return "NA", "single-action task"
        if identification == "LACKING":
            return "NA", "never got past identification"
        missing = [ref.name for ref, call in ctx.write_pairs if call is None]
        if not missing:
            return "PRESENT", f"all {len(ctx.ref_writes)} required writes attempted"
        attempted = len(ctx.ref_writes) - len(missing)
        reason = ctx.trajectory.termination_reason
        if reason not in _TERMINATED_BY_AGENT_OR_USER or (reason == "max_steps" and attempted == 0):
            return "NA", f"cut off ({reason}) before the writes"
        return "LACKING", f"{attempted}/{len(ctx.ref_writes)} required writes attempted; missing {', '.join(missing)}"

    def _data_reasoning(self, ctx: _Context) -> tuple[str, str]:
        needed = False
        for ref, call in ctx.write_pairs:
            if call is None:
                continue
            for key, want in ref.arguments.items():
                if not self._from_data(want, ctx):
                    continue
                needed = True
                if key not in call.arguments:
                    continue
                got = call.arguments[key]
                if got != want and _loose(got) != _loose(want) and (_appears(want, call.seen) or _appears(got, call.seen)):
                    return "LACKING", f"{ref.name}.{key}={got!r} but the data said {want!r}"
        if not needed:
            return "NA", "no value to read from tool results (or no write reached)"
        return "PRESENT", "values read from tool results correctly"

    def _precondition(self, ctx: _Context) -> tuple[str, str]:
        writes = [c for c in ctx.calls if c.name in self.write_tools and not c.parse_error]
        if ctx.instance.must_refuse:
            if writes:
                return "LACKING", f"called {writes[0].name} on a request the policy forbids"
            return "PRESENT", "refused without writing"
        if not ctx.ref_writes:
            return "NA", "no write involved"
        ref_names = {a.name for a in ctx.ref_writes}
        for c in writes:
            if c.ok and c.name not in ref_names:
                return "LACKING", f"made a write the task does not call for ({c.name})"
        for ref, call in ctx.write_pairs:
            if call is None:
                continue
            i = ctx.reference.index(ref)
            ref_values = {_loose(v) for v in ref.arguments.values()}
            checks = [r for r in ctx.reference[:i] if r.name not in self.write_tools and ref_values & {_loose(v) for v in r.arguments.values()}]
            for check in checks:
                done = any(
                    c.name == check.name
                    and c.position < call.position
                    and all(_loose(c.arguments.get(k)) == _loose(v) for k, v in check.arguments.items())
                    for c in ctx.calls
                )
                if not done:
                    return "LACKING", f"{ref.name} before {check.name}({json.dumps(check.arguments, sort_keys=True)})"
        return "PRESENT", "checked before writing"

    def _identification(self, ctx: _Context) -> tuple[str, str]:
        lookups = [a for a in ctx.reference if a.name.startswith("find_")]
        if not lookups:
            return "NA", "the user is identified in the request"
        finds = [c for c in ctx.calls if c.name.startswith("find_") and not c.parse_error]
        for ref in lookups:
            for c in finds:
                if c.name == ref.name and all(_loose(c.arguments.get(k)) == _loose(v) for k, v in ref.arguments.items()):
                    return "PRESENT", f"looked the user up with {ref.name}"
        if not finds:
            return "LACKING", "never looked the user up"
        return "LACKING", f"looked the user up with the wrong details ({finds[0].name} {json.dumps(finds[0].arguments, sort_keys=True)})"

    def _communication(self, ctx: _Context) -> tuple[str, str]:
        info = ctx.instance.communicate_info
        if not info:
            return "NA", "nothing to communicate"
        said = " ".join(
            (m.content or "").lower().replace(",", "") for m in ctx.trajectory.messages if m.role == "assistant"
        )
        missing = [x for x in info if x.lower().replace(",", "") not in said]
        if missing:
            return "LACKING", f"never said {missing[0]!r}"
        return "PRESENT", "said every required fact"

    # -- the Labeller interface --------------------------------------------------------------------------------
    def label(self, items: list[Item]) -> LabelSet:
        rows = []
        for item in items:
            for cid, (label, note) in self.judge(item.trajectory, item.instance).items():
                rows.append(label_row(0, item, cid, label, "programmatic", note))
        return LabelSet(capabilities=self.specs(), rows=rows, runs=1)
