"""The environment interface every stage shares: tool schemas, an episode API and scoring.

An `Environment` describes a domain (system prompt, OpenAI-format tool schemas) and starts `Episode`s from an
`Instance`. An episode is driven one assistant message at a time: tool calls are executed and answered with tool
observations, text goes to the user simulator, and the episode ends on a stop token, a step limit or too many
errors. Nothing the agent sends can raise: malformed calls, unknown tools and bad arguments come back as
"Error: ..." observations, as in τ²-bench.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trace_core.schemas import Instance, Message, RewardResult, ToolCall, Trajectory

if TYPE_CHECKING:
    from trace_core.envs.users import UserSimulator

# τ²-bench's conventions: the user ends with STOP (or TRANSFER / OUT-OF-SCOPE); the agent may end with STOP too.
STOP = "###STOP###"
TRANSFER = "###TRANSFER###"
OUT_OF_SCOPE = "###OUT-OF-SCOPE###"
STOP_TOKENS = (STOP, TRANSFER, OUT_OF_SCOPE)

# Every observation an episode produces (tool results, tool errors, refusals of unknown tools, bad arguments or
# unparsed calls, user replies) is cut to this many characters (`_observation`), so that nothing an agent, a tool
# or a user simulator sends can blow up the next prompt; the whole text stays in `Message.raw`.
MAX_OBSERVATION_CHARS = 8_000
MAX_ARGUMENT_CHARS = 20_000
# Tool calls executed per assistant message. Calls past this many are not run: they are answered together by one
# error observation (and dropped from the message, whose calls must each have an answer).
MAX_TOOL_CALLS_PER_MESSAGE = 16
IGNORED_CALLS = "ignored"  # the name of the call that stands for the ignored ones
_TRUNCATED = " ...[truncated]"


@dataclass
class StepResult:
    observations: list[Message]
    done: bool
    termination_reason: str | None = None


@dataclass
class EpisodeLimits:
    max_steps: int  # assistant messages per episode (params: env.max_steps)
    max_errors: int  # error observations per episode (params: env.max_errors)


class Environment(ABC):
    """A target domain. Subclasses provide tools, their execution on a per-episode state, and scoring."""

    domain: str

    @abstractmethod
    def tool_schemas(self, instance: Instance | None = None) -> list[dict[str, Any]]:
        """OpenAI-format tool schemas offered to the agent for this instance."""

    @abstractmethod
    def system_prompt(self, instance: Instance | None = None) -> str:
        """The agent's system prompt (the domain policy) for this instance."""

    @abstractmethod
    def _new_state(self, instance: Instance) -> Any:
        """A fresh per-episode state (e.g. a private copy of the database)."""

    @abstractmethod
    def _execute(self, state: Any, call: ToolCall) -> tuple[str, bool]:
        """Run one well-formed tool call against `state`; return (observation text, is_error). Must not raise."""

    @abstractmethod
    def score(self, instance: Instance, messages: list[Message], termination_reason: str) -> RewardResult:
        """Score a finished episode; reward in [0, 1] with its components."""

    def start(
        self,
        instance: Instance,
        user: "UserSimulator",
        limits: EpisodeLimits,
        system_prompt: str | None = None,
    ) -> "Episode":
        return Episode(self, instance, user, limits, system_prompt)


class Hinted:
    """Starts episodes like `env`, with `hint(instance)` appended to the system prompt (docs/method.md §2's hint
    injection). Rollout code only calls `start`, and the episode itself talks to the real environment."""

    def __init__(self, env: Environment, hint: "Callable[[Instance], str]"):
        self.env = env
        self.hint = hint

    def start(self, instance: Instance, user, limits: EpisodeLimits, system_prompt: str | None = None):
        base = system_prompt if system_prompt is not None else self.env.system_prompt(instance)
        return self.env.start(instance, user, limits, f"{base}\n\n{self.hint(instance)}")


def plan_hint(instance: Instance, writes: "frozenset[str] | set[str]", done: int = 0) -> str:
    """Non-revealing expert guidance for `instance`: the look-up tools its reference calls (after the first `done`
    actions, e.g. prefilled ones), in order, and how a correct agent acts on their results. It names no argument
    value and reads the same whether the instance must be refused or not."""
    reads: list[str] = []
    for action in instance.reference_actions[done:]:
        if action.name not in writes and (not reads or reads[-1] != action.name):
            reads.append(action.name)
    first = (f"Expert guidance: a correct agent first looks up what it needs with {', then '.join(reads)}. " if reads
             else "Expert guidance: the tool results already in the conversation hold every id needed. ")
    return first + (
        "Then it makes the change the user asked for, copying ids and values exactly as the tool results show them "
        "(ids with '#', lists as lists), and only where the policy allows it; otherwise it explains why and changes "
        "nothing. It confirms the outcome to the user and ends the conversation."
    )


def _capped(text: str) -> tuple[str, str | None]:
    """(`text` as valid UTF-8 cut to MAX_OBSERVATION_CHARS, the whole scrubbed text when it was cut else None)."""
    text = _scrub(text)
    if len(text) <= MAX_OBSERVATION_CHARS:
        return text, None
    return text[:MAX_OBSERVATION_CHARS] + _TRUNCATED, text


def _observation(call: ToolCall, text: str, is_error: bool) -> Message:
    """The one constructor of tool observations: scrubbed (a refusal may quote the agent's own text, with lone
    surrogates in it) and capped. A cut observation keeps its whole text in `raw`: scoring replays the calls and
    checks each result against it (τ²'s evaluator raises on a mismatch, e.g. airline's search_onestop_flight can
    return ~9k chars)."""
    content, full = _capped(text)
    name, _ = _capped(call.name)
    return Message(role="tool", tool_call_id=call.id, name=name, content=content, error=is_error, raw=full)


def _error(call: ToolCall, text: str) -> Message:
    return _observation(call, f"Error: {text}", True)


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def rejection(call: ToolCall, tool_names: "set[str] | frozenset[str]") -> str | None:
    """Why `call` is refused before it reaches any tool, or None when it may run.

    Refused calls never touch the episode state. Scoring uses this same test (with the same tool names) to leave
    them out of the replayed trajectory: τ²'s evaluator re-executes every call in the history and raises when a
    result differs from the recorded one, and our refusal texts are not what τ²'s tools would have said."""
    if call.parse_error:
        if call.name == IGNORED_CALLS:  # stands for the calls past MAX_TOOL_CALLS_PER_MESSAGE (`_drop_extra_calls`)
            return call.parse_error
        return f"could not parse the tool call: {call.parse_error}"
    if call.name not in tool_names:
        return f"unknown tool {_short(call.name)!r}; available: {', '.join(sorted(tool_names))}"
    if not isinstance(call.arguments, dict):
        return "tool arguments must be a JSON object"
    try:
        text = json.dumps(call.arguments, ensure_ascii=False, default=str)
    except Exception as exc:  # noqa: BLE001 — anything unserialisable is the agent's error
        return f"arguments are not JSON-serialisable: {exc}"
    if len(text) > MAX_ARGUMENT_CHARS:
        return f"arguments too large ({len(text)} characters)"
    try:
        # Lone surrogates (bytes decoded with surrogateescape) are not text: refuse them rather than let them
        # into a tool (and from there into the database and the exported trajectory).
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "arguments are not valid UTF-8 text"
    return None


def _scrub(text: str) -> str:
    # Lone surrogates (from invalid UTF-8 decoded with surrogateescape) cannot be encoded; replace them.
    return text.encode("utf-8", "replace").decode("utf-8")


def _exportable(messages: list[Message]) -> list[Message]:
    """`messages` as valid UTF-8: an agent's text or arguments may hold lone surrogates (e.g. from a JSON reply
    with "\\udcff" escapes), which parquet/JSON writers cannot encode. Copies only when something needs scrubbing."""
    dumped = json.dumps([m.model_dump() for m in messages], ensure_ascii=False)
    try:
        dumped.encode("utf-8")
        return messages
    except UnicodeEncodeError:
        return [Message.model_validate(d) for d in json.loads(_scrub(dumped))]


def _drop_extra_calls(assistant: Message) -> None:
    """Keep the first MAX_TOOL_CALLS_PER_MESSAGE calls of `assistant`; the rest become one call that is refused as
    a whole (its parse_error keeps it out of scoring's replay) and answered by one short error observation."""
    calls = assistant.tool_calls or []
    if len(calls) <= MAX_TOOL_CALLS_PER_MESSAGE:
        return
    extra = len(calls) - MAX_TOOL_CALLS_PER_MESSAGE
    marker = ToolCall(
        id=calls[MAX_TOOL_CALLS_PER_MESSAGE].id,
        name=IGNORED_CALLS,
        parse_error=f"{extra} tool call(s) past the first {MAX_TOOL_CALLS_PER_MESSAGE} of this message were ignored; "
        f"make at most {MAX_TOOL_CALLS_PER_MESSAGE} calls per message",
    )
    assistant.tool_calls = calls[:MAX_TOOL_CALLS_PER_MESSAGE] + [marker]


class Episode:
    """One conversation between an agent, a user simulator and an environment state."""

    def __init__(
        self,
        env: Environment,
        instance: Instance,
        user: "UserSimulator",
        limits: EpisodeLimits,
        system_prompt: str | None = None,
    ):
        self.env = env
        self.instance = instance
        self.user = user
        self.limits = limits
        self.tools = env.tool_schemas(instance)
        self._tool_names = {t["function"]["name"] for t in self.tools}
        self.state = env._new_state(instance)
        self.steps = 0
        self.errors = 0
        self.done = False
        self.termination_reason: str | None = None
        self.messages: list[Message] = [
            Message(role="system", content=system_prompt if system_prompt is not None else env.system_prompt(instance)),
        ]
        opening = user.opening(instance)
        self.messages.append(opening)

    # -- driving -----------------------------------------------------------------------------------------
    def step(self, assistant: Message) -> StepResult:
        """Apply one assistant message (text and/or tool calls); return the observations it produced."""
        if self.done:
            raise RuntimeError("episode is finished; start a new one")
        if assistant.role != "assistant":
            raise ValueError(f"step() takes an assistant message, got role={assistant.role!r}")
        self.steps += 1
        self.messages.append(assistant)
        observations: list[Message] = []
        if assistant.tool_calls:
            _drop_extra_calls(assistant)
            for i, call in enumerate(assistant.tool_calls):
                if not call.id:
                    call.id = f"call_{self.steps}_{i}"
                obs = self._run_call(call)
                if obs.error:
                    self.errors += 1
                observations.append(obs)
            self.messages.extend(observations)
            if self.errors >= self.limits.max_errors:
                return self._finish(observations, "too_many_errors")
        else:
            text = assistant.content or ""
            if any(tok in text for tok in STOP_TOKENS):
                return self._finish(observations, "agent_stop")
            reply = self.user.respond(self.instance, self.messages)
            if reply.content is not None and len(reply.content) > MAX_OBSERVATION_CHARS:
                content, full = _capped(reply.content)
                reply = reply.model_copy(update={"content": content, "raw": full})
            self.messages.append(reply)
            observations.append(reply)
            if any(tok in (reply.content or "") for tok in STOP_TOKENS):
                return self._finish(observations, "user_stop")
        if self.steps >= self.limits.max_steps:
            return self._finish(observations, "max_steps")
        return StepResult(observations, False)

    def abort(self, reason: str) -> None:
        """End the episode from outside (context overflow, backend failure)."""
        if not self.done:
            self._finish([], reason)

    def _finish(self, observations: list[Message], reason: str) -> StepResult:
        self.done = True
        self.termination_reason = reason
        return StepResult(observations, True, reason)

    def _run_call(self, call: ToolCall) -> Message:
        reason = rejection(call, self._tool_names)
        if reason is not None:
            return _error(call, reason)
        try:
            text, is_error = self.env._execute(self.state, call)
        except Exception as exc:  # noqa: BLE001 — a tool must never crash the episode
            text, is_error = f"Error: {type(exc).__name__}: {exc}", True
        return _observation(call, text, is_error)

    # -- results -----------------------------------------------------------------------------------------
    def score(self) -> RewardResult:
        if not self.done:
            raise RuntimeError("score() needs a finished episode")
        return self.env.score(self.instance, self.messages, self.termination_reason or "max_steps")

    def trajectory(self, policy: str = "", trial: int = 0, seed: int | None = None, meta: dict | None = None) -> Trajectory:
        result = self.score()
        return Trajectory(
            trajectory_id=f"{self.instance.instance_id}/t{trial}/{uuid.uuid5(uuid.NAMESPACE_URL, self.instance.instance_id + str(trial)).hex[:8]}",
            instance_id=self.instance.instance_id,
            domain=self.instance.domain,
            family=self.instance.family,
            source=self.instance.source,
            trial=trial,
            seed=seed,
            policy=policy,
            messages=_exportable(self.messages),
            termination_reason=self.termination_reason or "max_steps",  # type: ignore[arg-type]
            num_steps=self.steps,
            reward=result.reward,
            success=result.reward >= 1.0 - 1e-6,  # τ²'s tolerance (trace_core.metrics.SUCCESS_TOLERANCE)
            reward_components=result.components,
            reward_info=result.info,
            meta=meta or {},
        )
