"""Apple's ToolSandbox as a TRACE target: its scenarios, stateful tools and milestone/minefield evaluator.

Installed as an optional extra (`bash scripts/install.sh --toolsandbox`, docs/toolsandbox.md); importing this module
without it raises an ImportError that says so. Everything domain-specific comes from the `tool_sandbox` package:

- instances are its named scenarios (1,032: 129 base scenarios x 8 tool augmentations); those whose tools call the
  RapidAPI web services (`tool_sandbox.tools.rapid_api_search_tools`) are marked `meta["offline"] = False` and left
  out of `scenario_instances(offline_only=True)`;
- tool schemas are its own OpenAI conversion of the scenario's allowed tools, augmentations (scrambled tool names,
  descriptions, argument types) included;
- a tool call runs as ToolSandbox's agent runs one: Python code sent to its execution environment, in the episode's
  own `ExecutionContext`. That context is a process-global in ToolSandbox; each episode keeps its own and installs
  it only for the duration of one operation, under a lock (so interleaved and threaded episodes never share state);
- the score replays the conversation (user turns, agent text, the tool calls the episode ran) into a fresh copy of
  the scenario's starting context and returns ToolSandbox's own evaluator similarity in [0, 1] (1.0: perfect).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import importlib
import json
import random
import threading
import time
import types
from dataclasses import dataclass
from typing import Any

try:
    from tool_sandbox.common.execution_context import (
        DatabaseNamespace,
        ExecutionContext,
        RoleType,
        ScenarioCategories,
        get_current_context,
        new_context,
    )
    from tool_sandbox.common.message_conversion import Message as TSMessage
    from tool_sandbox.common.tool_conversion import convert_to_openai_tools
    from tool_sandbox.common.tool_discovery import ToolBackend
    from tool_sandbox.roles.base_role import BaseRole
    from tool_sandbox.roles.execution_environment import ExecutionEnvironment
except ImportError as exc:  # pragma: no cover — exercised only without the extra
    raise ImportError(
        "ToolSandbox is not installed: run `bash scripts/install.sh --toolsandbox` (see docs/toolsandbox.md)"
    ) from exc

from trace_core.envs.base import STOP_TOKENS, Environment, rejection
from trace_core.envs.users import UserSimulator
from trace_core.schemas import Instance, Message, RewardResult, ToolCall, answered_calls

DOMAIN = "toolsandbox"
NETWORK_MODULE = "tool_sandbox.tools.rapid_api_search_tools"
# Tool augmentations, as the suffixes ToolSandbox gives the scenario names (longest first when matching).
AUGMENTATIONS = (
    "3_distraction_tools_tool_description_scrambled",
    "3_distraction_tools_arg_description_scrambled",
    "3_distraction_tools_tool_name_scrambled",
    "3_distraction_tools_arg_type_scrambled",
    "3_distraction_tools",
    "10_distraction_tools",
    "all_tools",
)
# The scenario's primary category (an instance's family): the first of these it carries.
PRIMARY_CATEGORIES = ("insufficient_information", "multiple_user_turn", "multiple_tool_call", "single_tool_call")
# The seed of ToolSandbox's own shuffles of each scenario's tool list (`named_scenarios` calls `random.shuffle`).
SCENARIO_SEED = 0

# ToolSandbox's execution context is a module global; every operation on an episode's context holds this lock.
_LOCK = threading.RLock()
# Tools whose answer is the clock (execution-facing names), and the ToolSandbox modules whose tools read
# `datetime.datetime.now()`: the score's replay runs them on the episode's clock (see `_episode_clock`).
CLOCK_TOOLS = frozenset({"get_current_timestamp"})
CLOCK_MODULES = ("tool_sandbox.tools.utilities", "tool_sandbox.tools.reminder", "tool_sandbox.tools.messaging")


@functools.lru_cache(maxsize=1)
def scenarios() -> dict[str, Any]:
    """ToolSandbox's named scenarios, built once per process with a fixed shuffle seed (the global `random`
    state is restored afterwards)."""
    from tool_sandbox.scenarios import named_scenarios

    state = random.getstate()
    random.seed(SCENARIO_SEED)
    try:
        return named_scenarios(preferred_tool_backend=ToolBackend.DEFAULT)
    finally:
        random.setstate(state)


def _split_name(name: str) -> tuple[str, str]:
    for aug in AUGMENTATIONS:
        if name.endswith("_" + aug):
            return name[: -len(aug) - 1], aug
    return name, "none"


def needs_network(scenario: Any) -> bool:
    """Whether solving the scenario needs a RapidAPI web service: a tool its base scenario allows (distraction
    tools of the augmented variants do not count) calls one, and it is not an insufficient-information scenario
    (there the right behaviour calls no such tool)."""
    if ScenarioCategories.INSUFFICIENT_INFORMATION in scenario.categories:
        return False
    name = next((n for n, s in scenarios().items() if s is scenario), None)
    base = scenarios().get(_split_name(name)[0], scenario) if name else scenario
    tools = base.starting_context.name_to_tool
    allowed = base.starting_context.tool_allow_list
    names = tools if allowed is None else [n for n in allowed if n in tools]
    return any(getattr(tools[n], "__module__", "") == NETWORK_MODULE for n in names)


def _prime(scenario: Any) -> ExecutionContext:
    """A private copy of the scenario's starting context with its system set-up code run (tool imports), as
    `Scenario.play` does before the first turn."""
    ctx = copy.deepcopy(scenario.starting_context)
    with _LOCK, new_context(ctx):
        db = ctx.get_database(DatabaseNamespace.SANDBOX, drop_sandbox_message_index=False,
                              get_all_history_snapshots=True)
        for i in range(ctx.max_sandbox_message_index + 1):
            if db["recipient"][i] == RoleType.EXECUTION_ENVIRONMENT and db["sender"][i] == RoleType.SYSTEM:
                ExecutionEnvironment().respond(ending_index=i)
        return get_current_context()


def _visible(ctx: ExecutionContext, role: RoleType) -> list[TSMessage]:
    with _LOCK, new_context(ctx):
        return [m for m in BaseRole.get_messages() if role in (m.visible_to or [])]


def _task_text(ctx: ExecutionContext) -> str:
    """The user simulator's instruction for this scenario (ToolSandbox's common preamble removed)."""
    from tool_sandbox.scenarios.user_simulator_few_shot_examples import USER_INSTRUCTION

    texts = [m.content for m in _visible(ctx, RoleType.USER)
             if m.sender == RoleType.SYSTEM and m.recipient == RoleType.USER]
    text = texts[-1] if texts else ""
    return text[len(USER_INSTRUCTION):].strip() if text.startswith(USER_INSTRUCTION) else text.strip()


def scenario_instance(name: str) -> Instance:
    """Scenario `name` as an instance (a fresh copy: callers may change it)."""
    return _scenario_instance(name).model_copy(deep=True)


@functools.cache
def _scenario_instance(name: str) -> Instance:
    # Built once per process: reading the scenario's messages out of its polars tables takes ~5-15 ms each.
    sc = scenarios()[name]
    base, aug = _split_name(name)
    cats = [str(c).lower() for c in sc.categories]
    family = next((c for c in PRIMARY_CATEGORIES if c in cats), "other")
    ctx = sc.starting_context
    agent_view = _visible(ctx, RoleType.AGENT)
    system = next((m.content for m in agent_view if m.sender == RoleType.SYSTEM), "")
    openings = [m.content for m in agent_view if m.sender == RoleType.USER]
    from trace_core.envs.toolsandbox_plans import reference_plan

    plan = reference_plan(base)
    return Instance(
        instance_id=f"{DOMAIN}/{name}",
        source="toolsandbox",
        domain=DOMAIN,
        family=family,
        user_goal=_task_text(ctx),
        opening=openings[-1] if openings else None,
        # As the agent must call them: scrambled variants name the tools differently.
        reference_actions=[a.model_copy(update={"name": ctx.get_agent_facing_tool_name(a.name)})
                           for a in (plan.actions() if plan else [])],
        communicate_info=plan.messages() if plan else [],
        requires_write=bool(sc.evaluation.milestone_matcher.milestones),
        must_refuse="insufficient_information" in cats,
        meta={
            "scenario": name,
            "base_scenario": base,
            "augmentation": aug,
            "categories": cats,
            "offline": not needs_network(sc),
            "system": system,
            "reference_plan": plan.steps if plan else None,
            "plan_source": plan.source if plan else None,
        },
    )


def scenario_instances(offline_only: bool = True, names: list[str] | None = None) -> list[Instance]:
    """ToolSandbox's scenarios as instances, in its order; `offline_only` leaves out those needing network tools
    (`offline_counts()` says how many)."""
    out = [scenario_instance(n) for n in (names if names is not None else scenarios())]
    return [i for i in out if i.meta["offline"]] if offline_only else out


def offline_counts() -> dict[str, int]:
    sc = scenarios()
    online = [n for n, s in sc.items() if needs_network(s)]
    return {"total": len(sc), "offline": len(sc) - len(online), "network": len(online),
            "network_base": len({_split_name(n)[0] for n in online})}


def _agent_tools(ctx: ExecutionContext) -> dict[str, Any]:
    """The tools the agent may call in `ctx`, by agent-facing name (as ToolSandbox's agent roles see them: the
    user's end_conversation is not among them)."""
    return {name: tool for name, tool in ctx.get_available_tools(scrambling_allowed=True).items()
            if RoleType.AGENT in getattr(tool, "visible_to", (RoleType.AGENT,))}


# ToolSandbox's tools carry no read/write annotation; these name prefixes are its state-changing ones.
WRITE_PREFIXES = ("set_", "add_", "modify_", "remove_", "send_")


def tool_catalogue() -> tuple[dict[str, dict[str, Any]], frozenset[str]]:
    """Every agent tool's OpenAI schema under its plain and its scrambled name, and the names of the
    state-changing ones (both spellings): what the programmatic labeller needs."""
    ctx = ExecutionContext()
    with _LOCK, new_context(ctx):
        plain = _agent_tools(ctx)
        schemas = {t["function"]["name"]: t for t in convert_to_openai_tools(plain)}
    catalogue: dict[str, dict[str, Any]] = {}
    writes: set[str] = set()
    for name, schema in schemas.items():
        scrambled = ctx._actual_to_scrambled_tool_name.get(name, name)  # what TOOL_NAME_SCRAMBLED shows
        for alias in {name, scrambled}:
            catalogue[alias] = {**schema, "function": {**schema["function"], "name": alias}}
            if name.startswith(WRITE_PREFIXES):
                writes.add(alias)
    return catalogue, frozenset(writes)


def content_groups(instances: list[Instance]) -> dict[str, str]:
    """base scenario -> the first (by name) of the base scenarios it shares a task with: two base scenarios whose
    instances have the same content (`task_key`: the same request, reference actions and messages; e.g. two
    insufficient-information scenarios that differ only in a starting setting) are one group, so a split never
    puts one in training and the other in evaluation."""
    from trace_core.schemas import task_key

    parent: dict[str, str] = {}

    def find(b: str) -> str:
        while parent.setdefault(b, b) != b:
            b = parent[b]
        return b

    by_key: dict[str, str] = {}
    for i in instances:
        base = i.meta["base_scenario"]
        other = by_key.setdefault(task_key(i), base)
        a, b = find(base), find(other)
        if a != b:
            parent[max(a, b)] = min(a, b)
    return {b: find(b) for b in {i.meta["base_scenario"] for i in instances}}


def split_instances(split: str, per_family: int | None, seed: int) -> list[Instance]:
    """Offline instances of a split: ToolSandbox has none, so "train" and "test" are the halves of its base
    scenarios by a stable hash of the base name (all augmentations of a base scenario fall in the same half;
    base scenarios with the same content, `content_groups`, by the hash of their group's first name); "base" is
    every offline scenario. `per_family`: at most that many per family, drawn with `seed`."""
    import hashlib

    if split not in ("train", "test", "base"):
        raise ValueError(f"ToolSandbox split {split!r}: use train, test or base")
    out = scenario_instances(offline_only=True)
    if split != "base":
        half = 0 if split == "train" else 1
        group = content_groups(out)
        out = [i for i in out
               if int(hashlib.sha256(group[i.meta["base_scenario"]].encode()).hexdigest(), 16) % 2 == half]
    if per_family is None:
        return out
    rng = random.Random(seed)
    picked: list[Instance] = []
    for family in sorted({i.family for i in out}):
        members = [i for i in out if i.family == family]
        picked.extend(rng.sample(members, min(per_family, len(members))))
    return picked


@dataclass
class _State:
    name: str
    ctx: ExecutionContext
    calls: int = 0


def _run_tool(state: _State, call: ToolCall) -> tuple[str, bool]:
    """Run one agent tool call in `state`'s context, as ToolSandbox's OpenAI agent and execution environment
    do (Python code in the context's console); return (observation, is_error)."""
    from openai.types.chat.chat_completion_message_tool_call import ChatCompletionMessageToolCall, Function
    from tool_sandbox.common.message_conversion import openai_tool_call_to_python_code

    state.calls += 1
    call_id = f"call_{state.calls}"  # a Python identifier: ToolSandbox names variables after the call id
    with _LOCK, new_context(state.ctx):
        ctx = state.ctx
        available = set(_agent_tools(ctx))
        if call.name not in available:
            return f"Error: unknown tool {call.name!r}", True
        tool_call = ChatCompletionMessageToolCall(
            id=call_id, type="function",
            function=Function(name=call.name, arguments=json.dumps(call.arguments, ensure_ascii=False)),
        )
        code = openai_tool_call_to_python_code(
            tool_call, available, execution_facing_tool_name=ctx.get_execution_facing_tool_name(call.name)
        )
        BaseRole.add_messages([TSMessage(sender=RoleType.AGENT, recipient=RoleType.EXECUTION_ENVIRONMENT,
                                         content=code, openai_tool_call_id=call_id,
                                         openai_function_name=call.name)])
        ExecutionEnvironment().respond()
        state.ctx = get_current_context()  # the environment may install a new context object
        reply = BaseRole.get_messages()[-1]
    return reply.content or "", reply.tool_call_exception is not None


class _Clock:
    """The time ToolSandbox's tools read while a replay runs: frozen at `frozen` when set, otherwise the wall clock
    shifted by `offset` seconds."""

    def __init__(self) -> None:
        self.offset = 0.0
        self.frozen: float | None = None

    def now(self) -> float:
        return self.frozen if self.frozen is not None else time.time() + self.offset


@contextlib.contextmanager
def _episode_clock(clock: _Clock):
    """Make the tools of `CLOCK_MODULES` read `clock` instead of the wall clock, for the duration of the block
    (which must hold `_LOCK`: the modules are process-global)."""

    class _Datetime(datetime.datetime):
        @classmethod
        def now(cls, tz=None):  # noqa: ANN001 — datetime's own signature
            return cls.fromtimestamp(clock.now(), tz)

    shim = types.ModuleType("datetime")
    shim.__dict__.update(datetime.__dict__)
    shim.datetime = _Datetime
    modules = [importlib.import_module(m) for m in CLOCK_MODULES]
    saved = [m.__dict__.get("datetime") for m in modules]
    try:
        for m in modules:
            m.datetime = shim
        yield
    finally:
        for m, old in zip(modules, saved):
            m.datetime = old


def _clock_reading(answer: Message | None) -> float | None:
    """The POSIX time a clock tool's answer in the episode showed, or None when it is not a number."""
    if answer is None or answer.content is None:
        return None
    try:
        value = float(answer.content.strip())
    except ValueError:
        return None
    return value if value == value and abs(value) < 1e11 else None  # not NaN, a plausible POSIX time


class ToolSandboxEnvironment(Environment):
    """ToolSandbox scenarios behind TRACE's `Environment` interface (see the module docstring)."""

    domain = DOMAIN

    def __init__(self, profile: str):
        self.profile = profile  # one tool set per scenario; kept for the params model's shape

    @staticmethod
    def _name(instance: Instance) -> str:
        """The scenario key: a named scenario's name, or a generated one's spec (`meta["ts_spec"]`) as JSON."""
        meta = instance.meta if instance is not None else {}
        if meta.get("scenario") in scenarios():
            return meta["scenario"]
        if isinstance(meta.get("ts_spec"), dict):
            return "spec:" + json.dumps(meta["ts_spec"], sort_keys=True)
        raise KeyError(f"instance {getattr(instance, 'instance_id', None)!r} names no ToolSandbox scenario "
                       "(meta['scenario'] or a generated meta['ts_spec']); build it with scenario_instances()")

    @staticmethod
    def _scenario_of(key: str) -> Any:
        if key.startswith("spec:"):
            from trace_core.envs.toolsandbox_synth import build_scenario

            return build_scenario(key[len("spec:"):])
        return scenarios()[key]

    def _scenario(self, instance: Instance) -> Any:
        return self._scenario_of(self._name(instance))

    def agent_tool_name(self, instance: Instance, tool: str) -> str:
        """The name the agent sees for ToolSandbox tool `tool` in this instance (scrambled in some variants)."""
        return self._scenario(instance).starting_context.get_agent_facing_tool_name(tool)

    @functools.lru_cache(maxsize=None)
    def _schemas(self, name: str) -> tuple[str, ...]:
        ctx = _prime(self._scenario_of(name))
        with _LOCK, new_context(ctx):
            tools = convert_to_openai_tools(_agent_tools(ctx))
        return tuple(json.dumps(t, sort_keys=True) for t in tools)

    def tool_schemas(self, instance: Instance | None = None) -> list[dict[str, Any]]:
        if instance is None:
            return []
        return [json.loads(t) for t in self._schemas(self._name(instance))]

    def system_prompt(self, instance: Instance | None = None) -> str:
        if instance is not None and instance.meta.get("system"):
            return instance.meta["system"]
        return "Don't make assumptions about what values to plug into functions. Ask for clarification if a user " \
               "request is ambiguous."

    def _new_state(self, instance: Instance) -> _State:
        name = self._name(instance)
        return _State(name, _prime(self._scenario_of(name)))

    def _execute(self, state: Any, call: ToolCall) -> tuple[str, bool]:
        if not isinstance(state, _State):
            return "Error: internal: a tool call got a state not made by ToolSandboxEnvironment", True
        try:
            return _run_tool(state, call)
        except Exception as exc:  # noqa: BLE001 — a tool must never crash the episode
            return f"Error: {type(exc).__name__}: {exc}", True

    # -- scoring -------------------------------------------------------------------------------------
    def replay(self, instance: Instance, messages: list[Message], termination_reason: str) -> ExecutionContext:
        """The episode's conversation written into a fresh starting context the way ToolSandbox records a
        rollout: user and agent turns as SANDBOX messages, each tool call the episode ran executed again (calls the
        episode refused are left out, as their observations came from TRACE, not from a tool), and, when the user
        ended the conversation, the user's `end_conversation()`."""
        name = self._name(instance)
        state = _State(name, _prime(self._scenario_of(name)))
        tool_names = {t["function"]["name"] for t in self.tool_schemas(instance)}
        readings = self._clock_readings(state, messages)
        clock = _Clock()
        if readings:  # run the replay on the episode's clock, from its first reading on
            clock.offset = next(iter(readings.values())) - time.time()
        with _LOCK, _episode_clock(clock):
            self._replay_turns(state, messages, tool_names, readings, clock)
        if termination_reason == "user_stop":
            with _LOCK, new_context(state.ctx):
                BaseRole.add_messages([TSMessage(sender=RoleType.USER, recipient=RoleType.EXECUTION_ENVIRONMENT,
                                                 content="end_conversation()")])
                ExecutionEnvironment().respond()
                state.ctx = get_current_context()
        return state.ctx

    @staticmethod
    def _clock_readings(state: _State, messages: list[Message]) -> dict[int, float]:
        """{index of the call among the episode's tool calls: the time it showed} for each call of a clock tool
        (`CLOCK_TOOLS`, under whatever name the scenario gives it) whose answer is a number."""
        out: dict[int, float] = {}
        for k, (_, call, answer) in enumerate(answered_calls(messages)):
            try:
                facing = state.ctx.get_execution_facing_tool_name(call.name)
            except Exception:  # noqa: BLE001 — an unknown name is no clock tool
                continue
            value = _clock_reading(answer) if facing in CLOCK_TOOLS else None
            if value is not None:
                out[k] = value
        return out

    def _replay_turns(self, state: _State, messages: list[Message], tool_names: set[str],
                      readings: dict[int, float], clock: _Clock) -> None:
        """Write the conversation's turns into `state`; a clock tool's call runs with the clock frozen at what the
        episode's call showed, and every later call on the episode's clock from there (a score computed seconds or
        days after the episode then sees the times the agent saw: ToolSandbox's milestones compare them within 1 s)."""
        skipped_opening = False
        k = -1  # index of the call among the episode's tool calls, as `answered_calls` counts them
        for m in messages:
            if m.role == "system" or m.role == "tool":
                continue
            if m.role == "user":
                if not skipped_opening:
                    skipped_opening = True  # the scenario's pre-written first message is in the context already
                    continue
                self._say(state, RoleType.USER, RoleType.AGENT, m.content or "")
            elif m.role == "assistant":
                if m.has_text() or not m.tool_calls:
                    self._say(state, RoleType.AGENT, RoleType.USER, m.content or "")
                for call in m.tool_calls or []:
                    k += 1
                    if rejection(call, tool_names) is not None:
                        continue
                    if k in readings:
                        clock.frozen = readings[k]
                    try:
                        _run_tool(state, call)
                    except Exception:  # noqa: BLE001 — the episode saw an error observation here too
                        pass
                    if clock.frozen is not None:
                        clock.offset, clock.frozen = clock.frozen - time.time(), None

    @staticmethod
    def _say(state: _State, sender: RoleType, recipient: RoleType, text: str) -> None:
        with _LOCK, new_context(state.ctx):
            BaseRole.add_messages([TSMessage(sender=sender, recipient=recipient, content=text)])

    def score(self, instance: Instance, messages: list[Message], termination_reason: str) -> RewardResult:
        sc = self._scenario(instance)
        try:
            ctx = self.replay(instance, messages, termination_reason)
            with _LOCK, new_context(ctx):
                result = sc.evaluation.evaluate(ctx, max_turn_count=sc.max_messages)
        except Exception as exc:  # noqa: BLE001 — scoring never raises on model output
            return RewardResult(reward=0.0, info={"error": f"{type(exc).__name__}: {exc}"})
        similarity = float(result.similarity)
        return RewardResult(
            reward=min(1.0, max(0.0, similarity)),
            components={"milestone_similarity": float(result.milestone_similarity),
                        "minefield_similarity": float(result.minefield_similarity)},
            info={"similarity": similarity, "perfect": similarity >= 1.0 - 1e-6,
                  "turn_count": int(result.turn_count),
                  "milestone_mapping": {str(k): [int(v[0]), float(v[1])] for k, v in
                                        result.milestone_mapping.items()}},
        )


class ToolSandboxUser(UserSimulator):
    """A deterministic user for ToolSandbox scenarios: it opens with the scenario's pre-written first message;
    when the agent asks something (a question mark), it answers once with the scenario's task text (what
    ToolSandbox tells its own simulated user, which holds every fact the user may give); otherwise, or after
    `max_turns` user turns, it ends the conversation. `replies` (e.g. the reference plan's, so that the user
    does not hang up between two of its messages) take precedence, in order."""

    def __init__(self, max_turns: int, replies: list[str] | None = None):
        self.max_turns = max_turns
        self.replies = list(replies or [])

    def opening(self, instance: Instance) -> Message:
        return Message(role="user", content=instance.opening or instance.user_goal)

    def respond(self, instance: Instance, messages: list[Message]) -> Message:
        users = [m for m in messages if m.role == "user"]
        said = len(users) - 1
        if said < len(self.replies):
            return Message(role="user", content=self.replies[said])
        agent = (messages[-1].content or "") if messages and messages[-1].role == "assistant" else ""
        told = any((m.content or "") == instance.user_goal for m in users)
        if len(users) <= self.max_turns and "?" in agent and instance.user_goal and not told:
            return Message(role="user", content=instance.user_goal)
        return Message(role="user", content=f"Thanks, that's all. {STOP_TOKENS[0]}")


def llm_user(complete) -> UserSimulator:
    """An LLM user for ToolSandbox (any OpenAI-compatible endpoint via `make_user_completer`): TRACE's `LLMUser`
    with ToolSandbox's own user-simulator instruction as guidelines and the scenario's task as its scenario."""
    from tool_sandbox.scenarios.user_simulator_few_shot_examples import USER_INSTRUCTION

    from trace_core.envs.users import LLMUser

    return LLMUser(complete, guidelines=USER_INSTRUCTION.strip())


__all__ = [
    "DOMAIN", "ToolSandboxEnvironment", "ToolSandboxUser", "llm_user", "needs_network", "offline_counts",
    "scenario_instance", "scenario_instances", "scenarios",
]
