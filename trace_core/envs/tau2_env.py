"""The τ²-bench adapter: real `tau2` tools on a per-episode copy of the real database, scored by τ²'s evaluator.

Everything domain-specific comes from the installed `tau2` package: the toolkits and DB models (tool execution,
including its "Error: ..." observations), the policies, the task sets and `evaluate_simulation` (DB hash after
replaying the agent's writes vs after replaying the reference actions, plus COMMUNICATE checks; a run not ended by
a stop scores 0). The only thing added is speed: each domain's database is parsed once per process and every
environment — the episode's and the two the evaluator builds — gets a private copy of it through a constructor
registered with τ²'s own registry under `trace-<domain>`.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import pickle
import threading
from pathlib import Path
from typing import Any, Literal

from trace_core.envs.base import Environment
from trace_core.schemas import Action, Instance, Message, RewardResult, ToolCall

DOMAINS = ("airline", "retail", "telecom")
Profile = Literal["compact", "full"]

# A short policy for small models (the "compact" profile). It keeps the rules our procedural families test.
COMPACT_POLICY = {
    "retail": (
        "You are a retail customer-service agent. Rules:\n"
        "- Before any change, identify the user: use find_user_id_by_email or find_user_id_by_name_zip, "
        "unless the user gives their user id.\n"
        "- Only pending orders can be cancelled or modified; only delivered orders can be returned or exchanged.\n"
        "- Cancel reasons are 'no longer needed' or 'ordered by mistake'.\n"
        "- An item can only be exchanged or modified to another variant of the same product that is available.\n"
        "- Refuse requests the rules forbid and explain why. Make one tool call at a time.\n"
        "- When the request is done, tell the user the outcome."
    ),
    "airline": (
        "You are an airline customer-service agent. Rules:\n"
        "- Get the user id before any change. Check the reservation with get_reservation_details first.\n"
        "- Basic economy flights cannot be modified. Cancellation is allowed within 24 hours of booking, "
        "when the airline cancelled the flight, or with travel insurance.\n"
        "- Refuse requests the rules forbid and explain why. Make one tool call at a time.\n"
        "- When the request is done, tell the user the outcome."
    ),
}


@functools.lru_cache(maxsize=None)
def _domain_module(domain: str):
    import importlib

    # tau2 imports litellm, which otherwise tries to download a model cost map at import (no network here).
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from loguru import logger

    # τ² logs every tool response at DEBUG (formatting whole DB records); that dominated episode time.
    logger.disable("tau2")

    if domain not in DOMAINS:
        raise ValueError(f"unknown τ² domain {domain!r}; choose one of {', '.join(DOMAINS)}")
    _install_fast_db_update()
    return importlib.import_module(f"tau2.domains.{domain}.environment")


def _deep_update(base: dict, update: dict) -> None:
    """Merge `update` into `base` in place as addict's `Dict.update` does: a key whose old and new values are both
    dicts merges recursively; any other value replaces the old one (lists included)."""
    import copy

    for key, value in update.items():
        if key in base and isinstance(base[key], dict) and isinstance(value, dict):
            _deep_update(base[key], value)
        else:
            base[key] = copy.deepcopy(value)


def update_model_with_dict(model_instance: Any, update_data: dict[str, Any]) -> Any:
    """τ²'s `update_pydantic_model_with_dict` (the DB update behind `set_state`'s initialization data), without
    addict: the same merge of `update_data` into `model_instance.model_dump()`, validated into a new model.
    τ²'s version wraps the whole dumped DB in addict objects; measured on the retail DB, 1.0 s per call against
    0.1 s here (dump + validate with the cyclic GC paused), and an episode with a generated DB state calls it three
    times (its own start and the two DBs τ²'s evaluator replays)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        raw = model_instance.model_dump()
        _deep_update(raw, update_data or {})
        return type(model_instance).model_validate(raw)
    finally:
        if was_enabled:
            gc.enable()


def _install_fast_db_update() -> None:
    """Point τ²'s toolkit at `update_model_with_dict` (the toolkit module looks the name up at call time)."""
    import tau2.environment.toolkit as toolkit

    toolkit.update_pydantic_model_with_dict = update_model_with_dict


_lock = threading.Lock()
_DB_PICKLES: dict[str, bytes] = {}


def _db_copy(domain: str):
    """A private copy of the domain's DB model. The DB is parsed from JSON once per process and kept pickled:
    unpickling with the cyclic GC paused is 2-4x faster than a pydantic deep copy (measured 0.04 s for retail)."""
    with _lock:
        if domain not in _DB_PICKLES:
            mod = _domain_module(domain)
            _DB_PICKLES[domain] = pickle.dumps(mod.get_environment().tools.db, protocol=pickle.HIGHEST_PROTOCOL)
        blob = _DB_PICKLES[domain]
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return pickle.loads(blob)
    finally:
        if was_enabled:
            gc.enable()


def fresh_environment(domain: str, solo_mode: bool = False):
    """A real τ² Environment for `domain` over a private copy of its database."""
    mod = _domain_module(domain)
    if domain == "telecom":
        # Telecom keeps a user-side DB too; build it the package's way (no cache).
        return mod.get_environment_manual_policy(solo_mode=solo_mode)
    return mod.get_environment(db=_db_copy(domain), solo_mode=solo_mode)


@functools.lru_cache(maxsize=None)
def _registered_name(domain: str) -> str:
    """Register the caching constructor with τ²'s registry so that `evaluate_simulation` uses it."""
    from tau2.registry import registry

    name = f"trace-{domain}"
    if name not in registry.get_domains():
        registry.register_domain(functools.partial(fresh_environment, domain), name)
    return name


class Tau2Environment(Environment):
    """A τ²-bench domain as a TRACE environment.

    profile="full": the official setting — τ²'s full policy and every tool of the domain.
    profile="compact": a short policy and, when the instance names one, only its `tool_subset` (cheap on CPU).
    """

    def __init__(self, domain: str, profile: Profile):
        if profile not in ("compact", "full"):
            raise ValueError(f"profile must be 'compact' or 'full', got {profile!r}")
        _domain_module(domain)  # validates the name early
        self.domain = domain
        self.profile = profile
        self._probe = None

    # -- description ---------------------------------------------------------------------------------
    def _env(self):
        if self._probe is None:
            self._probe = fresh_environment(self.domain)
        return self._probe

    @functools.cached_property
    def _all_schemas(self) -> list[dict[str, Any]]:
        tools = sorted(self._env().get_tools(), key=lambda t: t.name)
        return [t.openai_schema for t in tools]

    @functools.cached_property
    def _compact_schemas(self) -> list[dict[str, Any]]:
        return [compact_schema(s) for s in self._all_schemas]

    def tool_schemas(self, instance: Instance | None = None) -> list[dict[str, Any]]:
        if self.profile == "full":
            return list(self._all_schemas)
        schemas = self._compact_schemas
        if instance is not None and instance.tool_subset:
            keep = set(instance.tool_subset)
            schemas = [s for s in schemas if s["function"]["name"] in keep]
        return list(schemas)

    def system_prompt(self, instance: Instance | None = None) -> str:
        if self.profile == "compact" and self.domain in COMPACT_POLICY:
            return COMPACT_POLICY[self.domain]
        return self._env().get_policy()

    # -- execution -----------------------------------------------------------------------------------
    def _new_state(self, instance: Instance):
        env = fresh_environment(self.domain)
        task = self.tau2_task(instance)
        init = task.initial_state
        if init is not None:
            env.set_state(
                initialization_data=init.initialization_data,
                initialization_actions=init.initialization_actions,
                message_history=init.message_history or [],
            )
        return env

    def _execute(self, state: Any, call: ToolCall) -> tuple[str, bool]:
        from tau2.data_model.message import ToolCall as TauToolCall

        if (reason := _unbounded(call)) is not None:
            return f"Error: {reason}", True
        msg = state.get_response(TauToolCall(id=call.id or "call", name=call.name, arguments=call.arguments))
        return msg.content or "", bool(msg.error)

    # -- scoring -------------------------------------------------------------------------------------
    @staticmethod
    def tau2_task(instance: Instance):
        """The τ² Task behind an instance (official tasks verbatim; procedural ones built from their fields)."""
        from tau2.data_model.tasks import Task

        if instance.tau2_task is not None:
            if instance.db_patch is not None:
                raise ValueError(f"{instance.instance_id}: an official τ² task carries its own initial state; db_patch must be None")
            return Task.model_validate(instance.tau2_task)
        task: dict[str, Any] = {
            "id": instance.instance_id,
            "user_scenario": {"instructions": instance.user_goal},
            "evaluation_criteria": {
                "actions": [
                    {"action_id": f"a{i}", "name": a.name, "arguments": a.arguments, "requestor": a.requestor}
                    for i, a in enumerate(instance.reference_actions)
                ],
                "communicate_info": instance.communicate_info,
                "reward_basis": ["DB", "COMMUNICATE"],
            },
        }
        if instance.db_patch is not None:
            # τ² applies it to the episode's DB (`_new_state`) and to both DBs its evaluator replays.
            task["initial_state"] = {"initialization_data": {"agent_data": instance.db_patch}}
        return Task.model_validate(task)

    def score(self, instance: Instance, messages: list[Message], termination_reason: str) -> RewardResult:
        from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation

        tool_names = {t["function"]["name"] for t in self.tool_schemas(instance)}
        sim = to_tau2_simulation(instance.instance_id, messages, termination_reason, tool_names)
        task = self.tau2_task(instance)
        # τ²'s evaluator makes two more DB copies and hashes both: hundreds of thousands of objects, which made
        # the cyclic GC run full collections that freed nothing. Pausing it here (as `_db_copy` does) halves the
        # CPU time of a score (measured: airline 2.5 -> 1.1 s, retail 0.7 -> 0.36 s per replayed task).
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            info = evaluate_simulation(
                simulation=sim,
                task=task,
                evaluation_type=EvaluationType.ALL,
                solo_mode=False,
                domain=_registered_name(self.domain),
            )
        finally:
            if was_enabled:
                gc.enable()
        components = {str(getattr(k, "value", k)).lower(): float(v) for k, v in (info.reward_breakdown or {}).items()}
        details: dict[str, Any] = {}
        if info.db_check is not None:
            details["db_match"] = info.db_check.db_match
        if info.communicate_checks:
            details["communicate"] = {c.info: c.met for c in info.communicate_checks}
        if info.info and isinstance(info.info, dict) and "note" in info.info:
            details["note"] = info.info["note"]
        return RewardResult(reward=float(info.reward), components=components, info=details)


def _unbounded(call: ToolCall) -> str | None:
    """A call that τ²'s own tool would run without bound, refused before it runs (and left out of the scoring
    replay, which would run it again). airline/retail `calculate` eval()s its expression after a character check
    that lets "**" through: "9**9**7" takes ~8 s of CPU and "9**9**9" hours. Its documented operators are
    + - * /; it is read-only, so leaving the call out of the replay changes no DB hash."""
    expr = call.arguments.get("expression") if isinstance(call.arguments, dict) else None
    if call.name == "calculate" and isinstance(expr, str) and "**" in expr:
        return "the expression may only use the operators +, -, *, / (no '**')"
    return None


def _first_sentence(text: str) -> str:
    text = " ".join(text.split())
    for end in (". ", "? ", "! "):
        if end in text:
            return text[: text.index(end) + 1]
    return text


def compact_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A tool schema for the compact profile: the same name, parameters, types and required list, with each
    description cut to its first sentence and pydantic's "title" fields dropped. On retail this cuts about a quarter of
    the tokens the tool list costs in every prompt (measured with the SmolLM2 tokenizer: 1,037 -> 786 for the
    4-tool identify_then_act subset)."""

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            out = {}
            for key, value in node.items():
                if key == "title" and isinstance(value, str):
                    continue
                if key == "description" and isinstance(value, str):
                    out[key] = _first_sentence(value)
                elif key == "properties" and isinstance(value, dict):
                    out[key] = {name: walk(sub) for name, sub in value.items()}  # keep parameters named "title"
                else:
                    out[key] = walk(value)
            return out
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(schema)


_TERMINATION_MAP = {
    "agent_stop": "agent_stop",
    "user_stop": "user_stop",
    "max_steps": "max_steps",
    "too_many_errors": "too_many_errors",
}


def to_tau2_simulation(
    sim_id: str, messages: list[Message], termination_reason: str, tool_names: set[str] | None = None
):
    """Our messages as a τ² SimulationRun. Calls the episode refused before they reached a tool (and their error
    observations) are dropped — τ²'s replay must not see them either: it re-runs every call and raises when a
    result differs from the recorded one. `tool_names` are the tools the episode offered (needed to recognise
    unknown-tool refusals; without it only unparsed calls are dropped). A tool observation that the episode cut
    short is replayed against its full text, kept in `Message.raw`."""
    from tau2.data_model.message import AssistantMessage, ToolMessage, UserMessage
    from tau2.data_model.message import ToolCall as TauToolCall
    from tau2.data_model.simulation import SimulationRun, TerminationReason

    from trace_core.envs.base import rejection

    def refused(c) -> bool:
        if _unbounded(c) is not None:
            return True
        if tool_names is None:
            return c.parse_error is not None
        return rejection(c, tool_names) is not None

    out: list[Any] = []
    # Whether each pending call was refused, in call order: an episode answers a message's calls in order, so
    # tool observations are matched by position (ids may repeat, e.g. a server that numbers calls per message).
    pending: list[bool] = []
    for m in messages:
        if m.role == "system":
            continue
        if m.role == "user":
            out.append(UserMessage(role="user", content=m.content or ""))
        elif m.role == "assistant":
            pending = [refused(c) for c in (m.tool_calls or [])]
            calls = [
                TauToolCall(id=c.id, name=c.name, arguments=c.arguments)
                for c, skip in zip(m.tool_calls or [], pending)
                if not skip
            ]
            content = m.content if m.has_text() else None
            if not calls and content is None:
                content = ""  # τ² allows neither-empty; keep the turn so indices stay honest
            out.append(AssistantMessage(role="assistant", content=content, tool_calls=calls or None))
        elif m.role == "tool":
            if pending and pending.pop(0):
                continue
            content = m.raw if m.raw is not None else m.content
            out.append(ToolMessage(id=m.tool_call_id or "", role="tool", content=content, error=m.error))
    reason = _TERMINATION_MAP.get(termination_reason, "max_steps")
    return SimulationRun(
        id=sim_id,
        task_id=sim_id,
        start_time="",
        end_time="",
        duration=0.0,
        termination_reason=TerminationReason(reason),
        messages=out,
    )


# -- official task sets -------------------------------------------------------------------------------------
def official_instances(domain: str, split: str | None = "base") -> list[Instance]:
    """The official τ² tasks of `domain` for `split` ("train", "test", "base" or None for every task)."""
    mod = _domain_module(domain)
    tasks = mod.get_tasks(split)
    return [instance_from_tau2(t, domain, split) for t in tasks]


def official_splits(domain: str) -> dict[str, list[str]]:
    return _domain_module(domain).get_tasks_split()


def instance_from_tau2(task, domain: str, split: str | None = None) -> Instance:
    """Wrap a τ² Task: keep it verbatim and lift the parts our simulators and labellers read."""
    ec = task.evaluation_criteria
    instructions = task.user_scenario.instructions
    if isinstance(instructions, str):
        goal, known, reason = instructions, "", instructions
    else:
        reason = instructions.reason_for_call or ""
        known = instructions.known_info or ""
        goal = "\n".join(x for x in (reason, known, instructions.task_instructions or "") if x)
    actions = [Action(name=a.name, arguments=a.arguments, requestor=a.requestor) for a in (ec.actions or [])] if ec else []
    writes = _write_tools(domain)
    return Instance(
        instance_id=f"tau2/{domain}/{task.id}",
        source="tau2",
        domain=domain,
        family=f"tau2-{domain}",
        split=split,
        user_goal=goal,
        user_facts=_facts_from_text(known),
        opening=(reason + ("\n" + known if known else "")).strip() or None,
        reference_actions=actions,
        communicate_info=list(ec.communicate_info or []) if ec else [],
        requires_write=any(a.name in writes for a in actions),
        tau2_task=json.loads(task.model_dump_json()),
    )


@functools.lru_cache(maxsize=None)
def _write_tools(domain: str) -> frozenset[str]:
    """Tools that change the DB, read from τ²'s own tool-type annotations."""
    from tau2.environment.toolkit import ToolType

    toolkit = fresh_environment(domain).tools
    return frozenset(name for name, _ in toolkit.get_tools().items() if toolkit.tool_type(name) == ToolType.WRITE)


def write_tools(domain: str) -> frozenset[str]:
    return _write_tools(domain)


def _facts_from_text(text: str) -> dict[str, str]:
    """Pick identifiers out of τ²'s free-text known_info so the scripted user can answer questions."""
    import re

    facts: dict[str, str] = {}
    if m := re.search(r"[\w.+-]+@[\w-]+\.[\w.]+", text):
        facts["email"] = m.group(0).rstrip(".")
    if m := re.search(r"\bzip code (?:is )?(\d{5})\b", text, re.I) or re.search(r"\b(\d{5})\b", text):
        facts["zip"] = m.group(1)
    if m := re.search(r"(?:name is|You are) ([A-Z][a-z]+ [A-Z][a-z]+)", text):
        facts["name"] = m.group(1)
    if m := re.search(r"user id is ([a-z_]+_\d+)", text, re.I):
        facts["user_id"] = m.group(1)
    if m := re.search(r"#W\d{7}", text):
        facts["order_id"] = m.group(0)
    if m := re.search(r"\b([A-Z0-9]{6})\b", text):
        facts.setdefault("reservation_id", m.group(1))
    return facts


@functools.lru_cache(maxsize=None)
def data_dir() -> Path:
    from tau2.utils import DATA_DIR

    return Path(DATA_DIR) / "tau2" / "domains"


__all__ = [
    "COMPACT_POLICY",
    "Tau2Environment",
    "fresh_environment",
    "instance_from_tau2",
    "official_instances",
    "official_splits",
    "to_tau2_simulation",
    "write_tools",
    "data_dir",
]
