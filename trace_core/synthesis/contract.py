"""The synthetic-environment contract (docs/method.md §2): a seeded generator G_c(z) -> x_c over the target's own tools
and state, a programmatic reward R_c with partial credit, and a reference solution per instance.

A `SyntheticEnv` *is* an `Environment`: the rollout engine, the policies and the episode API run on it unchanged.
Tools, their execution and the state are the target's (the real τ² retail toolkit on a private copy of the real
database); only the instances and the reward are new. Subclasses implement `generate(seed, difficulty)`.
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from typing import Any, ClassVar

from trace_core.envs.base import Environment, Episode, EpisodeLimits
from trace_core.schemas import Action, Instance, Message, RewardResult, ToolCall, answered_calls

# Partial credit (docs/method.md §2: "e.g. 0.6 actions + 0.4 communication"): the actions share is split evenly over the
# reference writes; with nothing to communicate, the actions carry the whole weight. A run that does not end the
# way τ² requires (a stop by agent or user) keeps half of its partial credit; only an exact end state earns 1.0.
ACTIONS_WEIGHT = 0.6
COMMUNICATE_WEIGHT = 0.4
PARTIAL_CAP = 0.9
UNFINISHED_FACTOR = 0.5
FINISHED = ("agent_stop", "user_stop")
STRAY_CREDIT = 0.5  # the right end state reached after write attempts that match no reference write
# A reference write attempted with the right tool but some wrong arguments earns this share of the write's credit
# times the share of its arguments that are right, so that GRPO can tell "one field wrong" from "nothing right".
# Only while the agent attempted at most MAX_ATTEMPTS_PER_WRITE writes per reference write (spam earns nothing), and
# only for an attempt that gives every argument the reference write has: one that leaves an argument out earns
# nothing. Measured (docs/results.md, "The profile's training"): when leaving `reason` out of a cancellation paid as
# much as a wrong reason, 11 GRPO steps taught the precondition_verification adapter to leave it out (16 of 26
# allowed held-out requests), losing every success the base agent had there.
NEAR_MISS_CREDIT = 0.5
MAX_ATTEMPTS_PER_WRITE = 2


class SyntheticEnv(Environment):
    """One capability's training environment. `reset(seed)` gives the instance for a seed; `score` is R_c.

    Attributes subclasses set: `template` (the file name), `capability` (the capability id the template trains
    by default), `max_difficulty`, and a docstring describing what each difficulty adds.

    `scaffold` s (below the easiest difficulty, for agents that fail even there): each instance starts after the
    first s of the reference's look-ups before its first write, made and answered in the history (`meta["prefill"]`,
    as docs/method.md §2's tool-call example); the agent still owns every write and the end of the conversation.
    Refusal instances are never scaffolded (see `_scaffolded`). A template may extend the ladder further down with
    levels of its own above its look-up levels (`generate_scaffolded`, described in `rungs`): easier instances that
    keep the capability's core decision but remove another hurdle (ids named, fewer candidates, simpler writes).

    `blend` (between two difficulties, for agents too good at one and too weak at the next): odd seeds are made at
    `difficulty + 1`, even seeds at `difficulty`; calibration tries it when adjacent difficulties bracket the band."""

    template: str = ""
    capability: str = ""
    max_difficulty: int = 3
    max_scaffold: int = 3  # prefilled look-ups at most (an instance with fewer prefills all it has)
    # What each scaffold level above the look-up ones removes (scaffold level -> words), for templates that extend
    # the ladder below their last look-up level (`generate_scaffolded`); the spec and docs quote it.
    rungs: ClassVar[dict[int, str]] = {}
    keywords: tuple[str, ...] = ()  # words that describe the capability it trains (for definition matching)

    def __init__(self, capability_id: str | None, difficulty: int, profile: str, domain: str = "retail",
                 scaffold: int = 0, blend: bool = False):
        if not 0 <= difficulty <= self.max_difficulty:
            raise ValueError(f"{self.template}: difficulty {difficulty} outside 0..{self.max_difficulty}")
        if not 0 <= scaffold <= self.max_scaffold:
            raise ValueError(f"{self.template}: scaffold {scaffold} outside 0..{self.max_scaffold}")
        if blend and (scaffold or difficulty >= self.max_difficulty):
            raise ValueError(f"{self.template}: a blend needs scaffold 0 and a difficulty below {self.max_difficulty}")
        self.blend = blend
        self.capability_id = capability_id or self.capability
        self.difficulty = difficulty
        self.scaffold = scaffold
        self.profile = profile
        self.domain = domain

    # -- the generator -------------------------------------------------------------------------------------------
    @abstractmethod
    def generate(self, seed: int, difficulty: int) -> Instance:
        """A pure function of (seed, difficulty): same arguments, byte-identical instance."""

    def generate_scaffolded(self, seed: int, difficulty: int, scaffold: int) -> Instance:
        """The instance of `seed` at scaffold level `scaffold` (1..max_scaffold). By default, the first `scaffold`
        look-ups before the first write prefilled (`_scaffolded`); a template whose ladder goes lower overrides it
        for the levels above its look-up count (`rungs` says what each removes) and must keep the capability's
        core decision with the agent."""
        return _scaffolded(self.generate(seed, difficulty), scaffold, self.domain)

    def reset(self, seed: int) -> Instance:
        difficulty = self.difficulty + (seed % 2 if self.blend else 0)
        if self.scaffold:
            inst = self.generate_scaffolded(seed, difficulty, self.scaffold)
        else:
            inst = self.generate(seed, difficulty)
        return inst.model_copy(
            update={
                "instance_id": f"syn/{self.capability_id}/{self.template}/{label(self.difficulty, self.scaffold, self.blend)}/s{seed}",
                "source": "synthetic",
                "family": self.capability_id,
                "seed": seed,
                "index": 0,
                "difficulty": difficulty,
                "meta": {**inst.meta, "template": self.template, "base_instance_id": inst.instance_id},
            }
        )

    def reference(self, instance: Instance) -> list[Action]:
        """The reference solution: the actions a correct agent takes (after any prefilled ones)."""
        prefilled = len(instance.meta.get("prefill", []))
        return list(instance.reference_actions[prefilled:])

    def hint(self, instance: Instance) -> str:
        """Non-revealing expert guidance for hint injection (docs/method.md §2): appended to the system prompt of a
        share of each group's rollouts (`training.hint_fraction`; calibration measures the same mix). It never
        contains a reference argument value (the harness checks it); templates may say more about their capability."""
        from trace_core.envs.base import plan_hint
        from trace_core.envs.targets import write_tools

        return plan_hint(instance, write_tools(self.domain), done=len(instance.meta.get("prefill", [])))

    # -- the target's tools and state ----------------------------------------------------------------------------
    @functools.cached_property
    def target(self):
        from trace_core.envs.targets import target_env

        return target_env(self.domain, self.profile)

    def tool_schemas(self, instance: Instance | None = None) -> list[dict[str, Any]]:
        return self.target.tool_schemas(instance)

    def system_prompt(self, instance: Instance | None = None) -> str:
        return self.target.system_prompt(instance)

    def _new_state(self, instance: Instance) -> Any:
        return self.target._new_state(instance)

    def _execute(self, state: Any, call: ToolCall) -> tuple[str, bool]:
        return self.target._execute(state, call)

    def start(self, instance: Instance, user, limits: EpisodeLimits, system_prompt: str | None = None) -> Episode:
        """A new episode; an instance with `meta["prefill"]` (actions) starts mid-conversation, after those calls
        were made and answered (they do not count as agent steps)."""
        ep = super().start(instance, user, limits, system_prompt)
        for i, spec in enumerate(instance.meta.get("prefill", [])):
            call = ToolCall(id=f"prefill_{i}", name=spec["name"], arguments=spec["arguments"])
            ep.messages.append(Message(role="assistant", tool_calls=[call]))
            ep.messages.append(ep._run_call(call))
        return ep

    # -- R_c ------------------------------------------------------------------------------------------------------
    def score(self, instance: Instance, messages: list[Message], termination_reason: str) -> RewardResult:
        return partial_credit(self.target, instance, messages, termination_reason)


def label(difficulty: int, scaffold: int = 0, blend: bool = False) -> str:
    """How instance ids and reports name a knob position: d1, d0p2 (difficulty 0, two look-ups prefilled), or
    d2-3 (a blend: even seeds at difficulty 2, odd ones at 3)."""
    return f"d{difficulty}" + (f"p{scaffold}" if scaffold else "") + (f"-{difficulty + 1}" if blend else "")


def parse_label(text: str) -> tuple[int, int, bool]:
    """(difficulty, scaffold, blend) of a position's label (`label`'s inverse): "d0p2" -> (0, 2, False)."""
    import re

    m = re.fullmatch(r"d(\d+)(?:p(\d+))?(?:-(\d+))?", text.strip())
    if m is None or (m[3] is not None and (int(m[3]) != int(m[1]) + 1 or m[2] is not None)):
        raise ValueError(f"{text!r} is not a knob position: write d<difficulty>, d<difficulty>p<scaffold> or "
                         "d<difficulty>-<difficulty + 1> (a blend), e.g. d1, d0p4, d2-3")
    return int(m[1]), int(m[2] or 0), m[3] is not None


def _scaffolded(inst: Instance, scaffold: int, domain: str) -> Instance:
    """`inst` with up to `scaffold` more of its reference look-ups (those before the first write, after any the
    template prefilled) moved into `meta["prefill"]`. A refusal instance is left as it is: it has no write, its
    look-ups are the checks the capability is about (and prefilled, they would pay a do-nothing agent)."""
    from trace_core.envs.targets import write_tools

    if inst.must_refuse:
        return inst
    writes = write_tools(domain)
    prefill = list(inst.meta.get("prefill", []))
    for action in inst.reference_actions[len(prefill):]:
        if action.name in writes or scaffold == 0:
            break
        prefill.append(action.model_dump(include={"name", "arguments"}))
        scaffold -= 1
    return inst.model_copy(update={"meta": {**inst.meta, "prefill": prefill}})


def agent_calls(messages: list[Message]) -> list[tuple[ToolCall, bool]]:
    """The agent's tool calls (not the prefilled ones), each with whether its answer was not an error."""
    return [(call, answer is not None and not answer.error) for _, call, answer in answered_calls(messages)
            if not (call.id and call.id.startswith("prefill_"))]


def argument_share(reference: dict[str, Any], made: dict[str, Any]) -> float:
    """The share of arguments (over both calls' names) a call got exactly right."""
    keys = reference.keys() | made.keys()
    return sum(k in reference and k in made and reference[k] == made[k] for k in keys) / len(keys) if keys else 1.0


def partial_credit(target, instance: Instance, messages: list[Message], termination_reason: str) -> RewardResult:
    """R_c: 1.0 exactly when the target's own evaluator says the task is solved; otherwise partial credit for the
    reference writes made with exactly the right arguments (a reference write attempted with every argument given but
    some wrong: `NEAR_MISS_CREDIT` x its share of right arguments) and the facts communicated, capped below 1 and zeroed by
    any successful write of a tool the reference does not call (tool spam cannot earn credit). A refusal instance earns the share
    of the reference's checks (reads) the agent made, and only if no write tool was called at all (a write that the
    tool itself rejects still shows the agent tried)."""
    from trace_core.envs.targets import write_tools

    writes = write_tools(instance.domain)
    calls = agent_calls(messages)
    write_calls = [(c, ok) for c, ok in calls if c.name in writes and not c.parse_error]
    finished = termination_reason in FINISHED
    ref_writes = [a for a in instance.reference_actions if a.name in writes]
    if ref_writes and not any(ok for _, ok in write_calls):
        # No write went through, so the database is untouched and cannot match the reference's (generators
        # guarantee their reference writes change it: do-nothing scores 0 in their tests) — skip τ²'s replay.
        exact = RewardResult(reward=0.0)
    else:
        exact = target.score(instance, messages, termination_reason)
    components: dict[str, float] = {"target": exact.reward}

    if instance.must_refuse:
        # Refusing is only credited after the checks the reference makes (reading the user and the order):
        # otherwise an agent that does nothing would collect every refusal instance.
        reads = [a for a in instance.reference_actions if a.name not in writes]
        made = [(c.name, c.arguments) for c, ok in calls if ok]
        checked = sum((a.name, a.arguments) in made for a in reads) / len(reads) if reads else 1.0
        refused = not write_calls
        reward = checked if (refused and exact.reward >= 1.0) else 0.0
        components.update(refused=float(refused), checked=checked)
        return RewardResult(reward=round(reward, 6), components=components, info={"termination": termination_reason})
    # Write attempts (successful or not) that match no reference write exactly: guessing by trying values until
    # one sticks reaches the right end state too, so it must not earn full credit.
    stray = sum(1 for c, _ in write_calls if not any(a.name == c.name and a.arguments == c.arguments for a in ref_writes))
    components["stray_writes"] = float(stray)
    if exact.reward >= 1.0:
        reward = 1.0 if stray == 0 else STRAY_CREDIT
        components.update(actions=1.0, communicate=1.0)
        return RewardResult(reward=reward, components=components, info={"termination": termination_reason})

    remaining = list(ref_writes)
    extra = 0
    near: list[ToolCall] = []  # attempts at a reference tool that did not make a reference write exactly
    for call, ok in write_calls:
        match = next((a for a in remaining if a.name == call.name and a.arguments == call.arguments), None)
        if ok and match is not None:
            remaining.remove(match)
        elif any(a.name == call.name for a in ref_writes):
            near.append(call)
        elif ok:
            extra += 1
    exact_share = len(ref_writes) - len(remaining)
    near_share = 0.0
    if near and len(write_calls) <= MAX_ATTEMPTS_PER_WRITE * len(ref_writes):
        # each missing reference write takes the credit of its best attempt (failed attempts count: the arguments
        # are what is judged, and a tool error already costs the agent a step)
        for ref in remaining:
            shares = [argument_share(ref.arguments, c.arguments) for c in near
                      if c.name == ref.name and ref.arguments.keys() <= c.arguments.keys()]
            near_share += NEAR_MISS_CREDIT * max(shares, default=0.0)
    actions = (exact_share + near_share) / len(ref_writes) if ref_writes else 0.0
    said = " ".join((m.content or "").lower().replace(",", "") for m in messages if m.role == "assistant")
    info = instance.communicate_info
    communicate = sum(x.lower().replace(",", "") in said for x in info) / len(info) if info else None
    if communicate is None:
        partial = actions
    else:
        partial = ACTIONS_WEIGHT * actions + COMMUNICATE_WEIGHT * communicate
    if extra:
        partial = 0.0
    if not finished:
        partial *= UNFINISHED_FACTOR
    components.update(actions=actions, extra_writes=float(extra), near_miss=near_share)
    if communicate is not None:
        components["communicate"] = communicate
    return RewardResult(reward=round(min(partial, PARTIAL_CAP), 6), components=components, info={"termination": termination_reason})
