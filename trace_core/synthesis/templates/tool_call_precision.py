"""Template `tool_call_precision`: the conversation starts after the look-ups (docs/method.md §2's example): the user's
request, the read calls and their results are already in the history, and the agent must emit one exactly right
mutating call — every argument present, in the tool's format (ids with '#', lists as lists, exact enum strings).

Instances come from the one-write families; the reference's read actions become the prefilled history
(`meta["prefill"]`), so the agent's own reference solution is the write alone. Difficulty: 0-1 `single_write`
(every identifier in the request), 2-3 `identify_then_act` (the ids are in the prefilled tool results only).
"""

from __future__ import annotations

from trace_core.envs.procedural import generate as procedural
from trace_core.envs.procedural._retail import WRITE_TOOLS
from trace_core.schemas import Instance
from trace_core.synthesis.contract import SyntheticEnv
from trace_core.synthesis.templates._base import SEED
from trace_core.synthesis.templates._customers import customer_rng, fresh_customer


class ToolCallPrecision(SyntheticEnv):
    template = "tool_call_precision"
    capability = "tool_call_precision"
    keywords = ("argument", "parameter", "format", "call", "schema", "precise", "precision", "malformed", "json", "exact")
    max_scaffold = 0  # every look-up is prefilled already

    def generate(self, seed: int, difficulty: int) -> Instance:
        family = "single_write" if difficulty < 2 else "identify_then_act"
        inst = procedural(family, SEED, seed, min(difficulty, 1) if family == "single_write" else difficulty - 1)
        first_write = next(i for i, a in enumerate(inst.reference_actions) if a.name in WRITE_TOOLS)
        prefill = [a.model_dump(include={"name", "arguments"}) for a in inst.reference_actions[:first_write]]
        inst = inst.model_copy(update={"meta": {**inst.meta, "prefill": prefill}})
        return fresh_customer(inst, customer_rng(self.template, seed, difficulty))
