"""Reference replay: drive an episode with an instance's reference actions (the "oracle agent").

Used to check that instances are solvable (replay scores 1.0), to build warm-start dialogues, and as the
do-nothing control (an agent that only says goodbye)."""

from __future__ import annotations

from trace_core.envs.base import Environment, Episode, EpisodeLimits
from trace_core.envs.users import ScriptedUser, UserSimulator
from trace_core.schemas import Action, Instance, Message, ToolCall

# The scripted user of the reference replay and the controls when the caller gives none: part of the conformance
# protocol (the harness must judge every environment alike under any params), not the run's user.max_turns.
CONTROL_USER_TURNS = 4


def closing_message(instance: Instance) -> str:
    """The oracle's final words: the outcome, with every fact the task requires to be communicated."""
    if instance.must_refuse:
        text = "I'm sorry, but I cannot do that: our policy does not allow it."
    elif instance.reference_actions:
        text = "All done: your request has been completed."
    else:
        text = "Here is what I found."
    if instance.communicate_info:
        text += " " + " ".join(f"{x}." for x in instance.communicate_info)
    return text


def replay_reference(
    env: Environment,
    instance: Instance,
    user: UserSimulator | None = None,
    communicate: bool = True,
    limits: EpisodeLimits | None = None,
    actions: list[Action] | None = None,
) -> Episode:
    """Run the reference actions one call per turn, then a closing message; answer the user until it stops.
    `actions` replaces the reference actions (a scripted agent with a deliberate deficit, for tests)."""
    actions = instance.reference_actions if actions is None else actions
    limits = limits or EpisodeLimits(max_steps=len(actions) + 8, max_errors=100)
    ep = env.start(instance, user or ScriptedUser(max_turns=CONTROL_USER_TURNS), limits)
    for i, action in enumerate(actions):
        if ep.done:
            break
        ep.step(Message(role="assistant", tool_calls=[ToolCall(id=f"ref_{i}", name=action.name, arguments=action.arguments)]))
    text = closing_message(instance) if communicate else "Is there anything else I can help with?"
    while not ep.done:
        ep.step(Message(role="assistant", content=text))
        text = "Thank you for contacting us. Goodbye!"
    return ep


def do_nothing(env: Environment, instance: Instance, user: UserSimulator | None = None) -> Episode:
    """The do-nothing control: no tool calls, only polite text until the user stops."""
    user = user or ScriptedUser(max_turns=CONTROL_USER_TURNS)
    ep = env.start(instance, user, EpisodeLimits(max_steps=8, max_errors=100))
    while not ep.done:
        ep.step(Message(role="assistant", content="I see. Is there anything else I can help with?"))
    return ep
