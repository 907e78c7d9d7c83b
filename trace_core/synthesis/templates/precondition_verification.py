"""Template `precondition_verification`: requests the policy forbids (~60%, the agent must refuse without calling
the mutating tool) mixed with look-alikes it allows (the agent must do the write) — family `policy_refusal`.

Difficulty: 0 the violation is in the user's words; 1 the order status must be looked up; 2 rule details (reasons,
item removal, gift-card balance); 3 ownership and product rules.
"""

from __future__ import annotations

from trace_core.synthesis.templates._base import FamilyTemplate


class PreconditionVerification(FamilyTemplate):
    template = "precondition_verification"
    capability = "precondition_verification"
    family = "policy_refusal"
    keywords = ("policy", "precondition", "verify", "verification", "check", "allowed", "forbid", "refuse", "rule", "eligible", "status")
    # No scaffolds: the look-ups are the checks this capability is about, and refusal instances cannot be
    # scaffolded (SyntheticEnv), so prefilled history on the allowed look-alikes alone would give the answer away.
    max_scaffold = 0
