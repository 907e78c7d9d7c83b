"""Templates on ToolSandbox (env.domain=toolsandbox): generated tasks on ToolSandbox's own tools, databases and
milestone evaluator (`trace_core.envs.toolsandbox_synth`), scored by the contract's R_c over ToolSandbox's
similarity. Each instance keeps its scenario spec in `meta["ts_spec"]`, so any process rebuilds it exactly.

- `toolsandbox_tool_call_precision`: one write (send a message, add a contact) whose arguments the request gives;
  difficulty 0 gives the phone number in E.164 form, 1 as people write it ("(415) 555-0134"), 2 adds 3
  distraction tools, 3 adds 8.
- `toolsandbox_precondition_verification`: send a message while the device state forbids it (ToolSandbox's state
  dependency): difficulty 0 cellular off, 1 also low battery mode on (it must go off before cellular can go on),
  2 and 3 add 3 and 8 distraction tools.
"""

from __future__ import annotations

import random

from trace_core.schemas import Instance
from trace_core.synthesis.contract import SyntheticEnv

_FIRST = ("Ada", "Grace", "Linus", "Barbara", "Dennis", "Margaret", "Ken", "Frances", "Alan", "Radia", "Edsger",
          "Sophie", "Tim", "Hedy", "Niklaus", "Katherine")
_LAST = ("Lovelace", "Hopper", "Torvalds", "Liskov", "Ritchie", "Hamilton", "Thompson", "Allen", "Kay", "Perlman",
         "Dijkstra", "Wilson", "Berners", "Lamarr", "Wirth", "Johnson")
_RELATION = ("friend", "coworker", "sister", "brother", "neighbor", "boss", "cousin", "mother")
_CONTENT = ("Running ten minutes late", "Can you pick up milk on the way home", "The meeting moved to 3pm",
            "Happy birthday!", "Call me when you land", "Dinner is at seven tonight", "I left the keys at the desk",
            "Thanks for the book", "See you at the gym tomorrow", "Don't forget the tickets")


def _phone(rng: random.Random) -> tuple[str, str]:
    area, mid, end = rng.randint(201, 989), rng.randint(200, 999), rng.randint(0, 9999)
    return f"+1{area}{mid}{end:04d}", f"({area}) {mid}-{end:04d}"


class ToolSandboxTemplate(SyntheticEnv):
    max_difficulty = 3
    max_scaffold = 0

    def __init__(self, capability_id: str | None = None, difficulty: int = 1, profile: str = "compact",
                 domain: str = "toolsandbox", scaffold: int = 0, blend: bool = False):
        super().__init__(capability_id, difficulty, profile, "toolsandbox", scaffold, blend)

    def _instance(self, seed: int, difficulty: int, spec: dict) -> Instance:
        from trace_core.envs.toolsandbox_synth import reference_actions

        return Instance(
            instance_id=f"{self.template}/d{difficulty}/s{seed}", source="synthetic", domain="toolsandbox",
            family=self.capability, seed=seed, difficulty=difficulty, user_goal=spec["request"],
            opening=spec["request"], reference_actions=reference_actions(spec), requires_write=True,
            meta={"ts_spec": spec},
        )


class ToolSandboxToolCallPrecision(ToolSandboxTemplate):
    template = "toolsandbox_tool_call_precision"
    capability = "tool_call_precision"
    keywords = ("argument", "parameter", "format", "call", "schema", "precise", "precision", "malformed", "exact")

    def generate(self, seed: int, difficulty: int) -> Instance:
        rng = random.Random(f"{self.template}:{seed}:{difficulty}")
        e164, surface = _phone(rng)
        shown = surface if difficulty >= 1 else e164
        distractors = (0, 0, 3, 8)[difficulty]
        if seed % 2 == 0:
            content = rng.choice(_CONTENT)
            spec = {"task": "send_message", "phone_number": e164, "content": content,
                    "request": f"Text {shown} saying: {content}", "distractors": distractors}
        else:
            name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
            relation = rng.choice(_RELATION)
            spec = {"task": "add_contact", "name": name, "phone_number": e164, "relationship": relation,
                    "request": f"Add my {relation} {name} to my contacts, the number is {shown}",
                    "distractors": distractors}
        return self._instance(seed, difficulty, spec)


class ToolSandboxPreconditionVerification(ToolSandboxTemplate):
    template = "toolsandbox_precondition_verification"
    capability = "precondition_verification"
    keywords = ("precondition", "verify", "verification", "check", "state", "before", "dependency", "setting")

    def generate(self, seed: int, difficulty: int) -> Instance:
        rng = random.Random(f"{self.template}:{seed}:{difficulty}")
        e164, _ = _phone(rng)
        content = rng.choice(_CONTENT)
        spec = {"task": "send_message", "phone_number": e164, "content": content,
                "request": f"Send a message to {e164} saying: {content}", "off": ["cellular"],
                "low_battery": difficulty >= 1, "distractors": (0, 0, 3, 8)[difficulty]}
        return self._instance(seed, difficulty, spec)

    def score(self, instance: Instance, messages, termination_reason: str):
        """R_c, but nothing unless the message itself went out exactly as asked: the settings calls alone are
        what a random or tool-spamming policy reaches, and they are only the precondition of the task."""
        from trace_core.schemas import RewardResult
        from trace_core.synthesis.contract import agent_calls

        result = super().score(instance, messages, termination_reason)
        final = instance.reference_actions[-1]
        sent = any(ok and c.name == final.name and c.arguments == final.arguments
                   for c, ok in agent_calls(messages))
        if sent:
            return result
        return RewardResult(reward=0.0, components={**result.components, "sent": 0.0}, info=result.info)


TOOLSANDBOX_TEMPLATES = (ToolSandboxToolCallPrecision, ToolSandboxPreconditionVerification)
