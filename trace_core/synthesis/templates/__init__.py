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
# Templates on ToolSandbox (trace_core.synthesis.templates.toolsandbox, imported only there: it needs the extra).
TOOLSANDBOX_TEMPLATES = ("toolsandbox_tool_call_precision", "toolsandbox_precondition_verification")


def templates_for(domain: str) -> dict[str, type[SyntheticEnv]]:
    """The templates a target offers: ToolSandbox's own for env.domain=toolsandbox, the retail ones otherwise."""
    if domain == "toolsandbox":
        from trace_core.synthesis.templates.toolsandbox import TOOLSANDBOX_TEMPLATES as classes

        return {cls.template: cls for cls in classes}
    return dict(TEMPLATES)


def make(template: str, capability_id: str | None = None, difficulty: int = 1, profile: str = "compact",
         scaffold: int = 0, blend: bool = False) -> SyntheticEnv:
    registry = templates_for("toolsandbox") if template in TOOLSANDBOX_TEMPLATES else TEMPLATES
    if template not in registry:
        known = sorted([*TEMPLATES, *TOOLSANDBOX_TEMPLATES])
        raise ValueError(f"unknown template {template!r}; templates: {', '.join(known)}")
    return registry[template](capability_id, difficulty=difficulty, profile=profile, scaffold=scaffold,
                                blend=blend)


__all__ = ["TEMPLATES", "TOOLSANDBOX_TEMPLATES", "make", "templates_for"]
