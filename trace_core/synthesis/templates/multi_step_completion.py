"""Template `multi_step_completion`: one request with 2-4 writes, some depending on each other (family
`compound`). Partial credit per required write made exactly; full credit only for the exact end state.

Difficulty: 0-1 two writes, 2 three writes (paraphrased reasons), 3 four writes and identification by name+zip.
"""

from __future__ import annotations

from trace_core.envs.procedural._retail import WRITE_TOOLS
from trace_core.schemas import Instance
from trace_core.synthesis.templates._base import FamilyTemplate


class MultiStepCompletion(FamilyTemplate):
    template = "multi_step_completion"
    capability = "multi_step_completion"
    family = "compound"
    keywords = ("multi", "step", "steps", "several", "sequence", "complete", "completion", "remaining", "premature", "finish", "all")

    def hint(self, instance: Instance) -> str:
        writes = sum(a.name in WRITE_TOOLS for a in instance.reference_actions)
        return (f"{super().hint(instance)} This request needs {writes} separate changes, each its own tool call; "
                "the conversation is not done until every one of them went through.")
