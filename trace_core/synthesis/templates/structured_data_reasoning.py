"""Template `structured_data_reasoning`: pick the one product variant that satisfies the user's option
constraints among its siblings, then exchange or modify to exactly that item id (family `variant_choice`).

The capability is exercised in the final call's `new_item_ids`: the id appears only in the product listing the
agent must read. Difficulty = how many option constraints (1..3) and how many near-miss variants there are.

Scaffolds (calibration's positions below difficulty 0, easiest last):
  1-3  the first 1, 2, 3 look-ups (user, order, product listing) made and answered in the history.
  4    every look-up prefilled, and the user names the current item's id and the payment method id: the only
       argument left to work out is the new item id, read off the listing (the capability's core decision).
  5    as 4, on a product with at most `FEW_VARIANTS` variants (fewer candidate records to choose among), with
       only the product listing in the history (the ids are named, so the user and order look-ups are not needed).
"""

from __future__ import annotations

from typing import ClassVar

from trace_core.envs.procedural import generate as procedural
from trace_core.envs.procedural._retail import db
from trace_core.schemas import Instance
from trace_core.synthesis.contract import _scaffolded
from trace_core.synthesis.templates._base import SEED, FamilyTemplate
from trace_core.synthesis.templates._customers import customer_rng, fresh_customer

LOOKUP_LEVELS = 3  # scaffold levels that prefill look-ups (user, order, product listing)
FEW_VARIANTS = 6  # scaffold 5: products with at most this many variants (the retail DB has 5-20)
_FEW_TRIES = 1000  # procedural indices tried per seed for such a product (about 1 in 6 draws has one)


class StructuredDataReasoning(FamilyTemplate):
    template = "structured_data_reasoning"
    capability = "structured_data_reasoning"
    family = "variant_choice"
    keywords = ("record", "variant", "option", "constraint", "choose", "pick", "select", "attribute", "data", "result", "value")
    max_scaffold = 5
    rungs: ClassVar[dict[int, str]] = {
        4: "every look-up prefilled; the user names the current item id and the payment method id, so only the "
           "new item id is left to pick from the listing",
        5: f"as 4, on products with at most {FEW_VARIANTS} variants (fewer candidate records), and only the product "
           "listing in the history (no user or order look-up)",
    }

    def generate_scaffolded(self, seed: int, difficulty: int, scaffold: int) -> Instance:
        if scaffold <= LOOKUP_LEVELS:
            return super().generate_scaffolded(seed, difficulty, scaffold)
        inst = self._few_variants(seed, difficulty) if scaffold >= 5 else self.generate(seed, difficulty)
        write = inst.reference_actions[-1]
        (item_id,), pm = write.arguments["item_ids"], write.arguments["payment_method_id"]
        said = (f"The item id of the one I have now is {item_id}, and the payment method id for any price "
                f"difference is {pm}.")
        if scaffold >= 5:
            # Only the listing is in the history: with the ids named, the user and order look-ups are not needed,
            # and the dialogue has the read-then-write shape of the warm-start's single_write dialogues (measured:
            # with all three look-ups prefilled, the base agent closed without a write in 88-94% of rollouts).
            listing = next(a for a in inst.reference_actions if a.name == "get_product_details")
            inst = inst.model_copy(update={"reference_actions": [listing, write]})
        inst = _scaffolded(inst, len(inst.reference_actions), self.domain)  # every look-up before the write
        return inst.model_copy(update={
            "opening": f"{inst.opening} {said}",
            "user_facts": {**inst.user_facts, "item_id": item_id, "payment_method_id": pm},
        })

    def _few_variants(self, seed: int, difficulty: int) -> Instance:
        """The first draw (procedural indices of this seed's own block) whose product has few variants."""
        products = db().products
        for k in range(_FEW_TRIES):
            inst = procedural(self.family, SEED, (1 + seed) * _FEW_TRIES + k, difficulty)
            if len(products[inst.meta["product_id"]].variants) <= FEW_VARIANTS:
                return fresh_customer(inst, customer_rng(f"{self.template}/few", seed, difficulty))
        raise RuntimeError(f"{self.template}: no product with at most {FEW_VARIANTS} variants in {_FEW_TRIES} draws "
                           f"for seed {seed}; raise FEW_VARIANTS")
