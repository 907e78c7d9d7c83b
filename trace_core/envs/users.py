"""User simulators behind one interface: a deterministic scripted user and an LLM user.

The scripted user states the request from the instance's known facts, answers identification questions with
facts it holds, says yes to a confirmation request, and ends with ###STOP### when the agent wraps up or after a
few turns without progress. The LLM user follows τ²-bench's simulation guidelines and stop tokens, on any
chat backend (an OpenAI-compatible endpoint or a local model).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Callable

from trace_core.envs.base import OUT_OF_SCOPE, STOP, STOP_TOKENS, TRANSFER
from trace_core.schemas import Instance, Message

# Words in an agent message that ask for each kind of fact the user may hold.
_FACT_CUES: dict[str, tuple[str, ...]] = {
    "name": ("name",),
    "first_name": ("name",),
    "last_name": ("name",),
    "zip": ("zip", "postal", "postcode"),
    "email": ("email", "e-mail"),
    "user_id": ("user id", "user_id", "account id", "username"),
    "order_id": ("order id", "order_id", "order number", "which order"),
    "reservation_id": ("reservation",),
}
_IDENTIFY_CUES = ("identify", "verify", "authenticate", "look you up", "locate your account", "find your account")
_CONFIRM_CUES = ("confirm", "proceed", "shall i", "should i", "would you like", "do you want", "go ahead", "(yes", "yes/no")


class UserSimulator(ABC):
    """Produces the user's opening message and replies to the agent's text messages."""

    @abstractmethod
    def opening(self, instance: Instance) -> Message: ...

    @abstractmethod
    def respond(self, instance: Instance, messages: list[Message]) -> Message: ...


class ScriptedUser(UserSimulator):
    """Deterministic user built from `Instance.opening`, `user_goal` and `user_facts`."""

    def __init__(self, max_turns: int, max_confirmations: int = 2):
        self.max_turns = max_turns
        self.max_confirmations = max_confirmations

    def opening(self, instance: Instance) -> Message:
        return Message(role="user", content=instance.opening or instance.user_goal)

    def respond(self, instance: Instance, messages: list[Message]) -> Message:
        user_turns = [m for m in messages if m.role == "user"]
        said = " ".join((m.content or "") for m in user_turns).lower()
        agent_text = (messages[-1].content or "").lower() if messages and messages[-1].role == "assistant" else ""
        if len(user_turns) > self.max_turns:
            return Message(role="user", content=f"I have to go now. {STOP}")
        # 1. Hand over facts the agent asks for and that were not said yet.
        asked = [k for k, cues in _FACT_CUES.items() if k in instance.user_facts and any(c in agent_text for c in cues)]
        wanted = asked
        if not wanted and any(c in agent_text for c in _IDENTIFY_CUES):
            wanted = [k for k in instance.user_facts if k in _FACT_CUES]
        fresh = [k for k in wanted if str(instance.user_facts[k]).lower() not in said]
        if fresh:
            parts = [f"my {k.replace('_', ' ')} is {instance.user_facts[k]}" for k in fresh]
            return Message(role="user", content="Sure, " + ", ".join(parts) + ".")
        # 2. Agree to a confirmation request (a bounded number of times).
        confirmations = sum(1 for m in user_turns if (m.content or "").startswith("Yes, please"))
        if any(c in agent_text for c in _CONFIRM_CUES) and confirmations < self.max_confirmations:
            return Message(role="user", content="Yes, please go ahead.")
        # 2b. Asked by name for facts already given: repeat them. (Falling through to 3 hung up on an agent that
        # merely re-asked, e.g. for an email stated in the opening; `max_turns` still bounds the repetition.)
        if asked:
            parts = [f"my {k.replace('_', ' ')} is {instance.user_facts[k]}" for k in asked]
            return Message(role="user", content="As I said, " + ", ".join(parts) + ".")
        # 3. Otherwise the agent has answered or is stuck: end the conversation.
        return Message(role="user", content=f"Thank you, that's all. {STOP}")


class LLMUser(UserSimulator):
    """A user played by a language model, with τ²-bench's guidelines and stop tokens.

    `complete` maps a list of {"role", "content"} dicts to the reply text; build it from any chat backend
    (see `trace_core.agents.factories.chat_completer`). Roles are flipped: the simulator speaks as "assistant".
    """

    def __init__(self, complete: Callable[[list[dict]], str], guidelines: str | None = None):
        self.complete = complete
        self.guidelines = guidelines if guidelines is not None else _tau2_guidelines()

    def _system(self, instance: Instance) -> str:
        facts = "\n".join(f"- {k}: {v}" for k, v in instance.user_facts.items())
        return (
            f"{self.guidelines}\n\n<scenario>\n{instance.user_goal}\n"
            + (f"Facts you know:\n{facts}\n" if facts else "")
            + f"</scenario>\nWhen your request is handled or cannot be handled, reply with {STOP}. "
            f"If you are transferred to a human, reply {TRANSFER}; if the scenario does not cover a question, "
            f"reply {OUT_OF_SCOPE}."
        )

    def opening(self, instance: Instance) -> Message:
        if instance.opening:
            return Message(role="user", content=instance.opening)
        return self._say(instance, [])

    def respond(self, instance: Instance, messages: list[Message]) -> Message:
        return self._say(instance, messages)

    def _say(self, instance: Instance, messages: list[Message]) -> Message:
        convo: list[dict] = [{"role": "system", "content": self._system(instance)}]
        for m in messages:
            if m.role == "assistant" and m.has_text():
                convo.append({"role": "user", "content": m.content})
            elif m.role == "user":
                convo.append({"role": "assistant", "content": m.content or ""})
        if len(convo) == 1:
            convo.append({"role": "user", "content": "Hi! How can I help you today?"})
        try:
            text = self.complete(convo).strip()
        except Exception as exc:  # noqa: BLE001 — a failed simulator ends the episode instead of crashing it
            return Message(role="user", content=f"(user simulator failed: {exc}) {STOP}")
        if not text:
            text = STOP
        # Keep everything up to and including the first stop token, as τ²'s simulator does.
        for tok in STOP_TOKENS:
            if tok in text:
                text = text[: text.index(tok) + len(tok)]
        return Message(role="user", content=re.sub(r"\s+\n", "\n", text))


def _tau2_guidelines() -> str:
    from tau2.user.user_simulator import get_global_user_sim_guidelines

    return get_global_user_sim_guidelines(use_tools=False)
