"""The template library: one synthetic-environment generator per file, keyed by template name.

A template's `capability` is the capability id it trains by default; params.yaml `synthesis.templates` maps other
capability ids onto templates, and unmapped capabilities are matched by definition (see `synthesis.mapping`)."""

from __future__ import annotations

from trace_core.synthesis.contract import SyntheticEnv
from trace_core.synthesis.templates.identification import Identification
from trace_core.synthesis.templates.multi_step_completion import MultiStepCompletion
from trace_core.synthesis.templates.precondition_verification import PreconditionVerification
from trace_core.synthesis.templates.structured_data_reasoning import StructuredDataReasoning
from trace_core.synthesis.templates.tool_call_precision import ToolCallPrecision

TEMPLATES: dict[str, type[SyntheticEnv]] = {
    cls.template: cls
    for cls in (StructuredDataReasoning, ToolCallPrecision, MultiStepCompletion, PreconditionVerification, Identification)
}


def make(template: str, capability_id: str | None = None, difficulty: int = 1, profile: str = "compact",
         scaffold: int = 0, blend: bool = False) -> SyntheticEnv:
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; templates: {', '.join(sorted(TEMPLATES))}")
    return TEMPLATES[template](capability_id, difficulty=difficulty, profile=profile, scaffold=scaffold,
                                blend=blend)


__all__ = ["TEMPLATES", "make"]
