"""Template `structured_data_reasoning`: pick the one product variant that satisfies the user's option
constraints among its siblings, then exchange or modify to exactly that item id (family `variant_choice`).

The capability is exercised in the final call's `new_item_ids`: the id appears only in the product listing the
agent must read. Difficulty = how many option constraints (1..3) and how many near-miss variants there are.
"""

from __future__ import annotations

from trace_core.synthesis.templates._base import FamilyTemplate


class StructuredDataReasoning(FamilyTemplate):
    template = "structured_data_reasoning"
    capability = "structured_data_reasoning"
    family = "variant_choice"
    keywords = ("record", "variant", "option", "constraint", "choose", "pick", "select", "attribute", "data", "result", "value")
