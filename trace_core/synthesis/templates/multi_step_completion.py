"""Template `multi_step_completion`: one request with 2-4 writes, some depending on each other (family
`compound`). Partial credit per required write made exactly; full credit only for the exact end state.

Difficulty: 0-1 two writes, 2 three writes (paraphrased reasons), 3 four writes and identification by name+zip.

Scaffolds (calibration's positions below difficulty 0, easiest last): 1-2 the look-ups before the first write
(user id, user details) made and answered in the history; 3 two writes of the kinds the warm-start dialogues
teach (a cancellation with the policy's own reason words and an order's payment or shipping address change),
every look-up before the first write prefilled; 4 two cancellations of two different orders for a user who gives
their user id, nothing prefilled (the read-then-write shape of the warm-start's dialogues). Every level keeps
the capability's core decision — the request is not done after the first write — with the agent.
"""

from __future__ import annotations

from typing import ClassVar

from trace_core.envs.procedural import compound
from trace_core.envs.procedural._retail import WRITE_TOOLS
from trace_core.schemas import Instance
from trace_core.synthesis.contract import _scaffolded
from trace_core.synthesis.templates._base import SEED, FamilyTemplate
from trace_core.synthesis.templates._customers import customer_rng, fresh_customer

LOOKUP_LEVELS = 2  # scaffold levels that prefill look-ups (the user id, the user's details)
# Write kinds of the levels below them (family `compound`'s kinds; each tuple in both orders).
RUNG_KINDS = {
    3: (("cancel", "order_payment"), ("order_payment", "cancel"), ("cancel", "order_address"),
        ("order_address", "cancel")),
    4: (("cancel", "cancel"),),
}


class MultiStepCompletion(FamilyTemplate):
    template = "multi_step_completion"
    capability = "multi_step_completion"
    family = "compound"
    keywords = ("multi", "step", "steps", "several", "sequence", "complete", "completion", "remaining", "premature", "finish", "all")
    max_scaffold = 4
    rungs: ClassVar[dict[int, str]] = {
        3: "two writes of kinds the warm-start teaches (a cancellation and a payment or shipping-address change), "
           "every look-up before the first write prefilled",
        4: "two cancellations of two different orders (reasons in the policy's words) for a user who gives their "
           "user id: no identification, nothing prefilled",
    }

    def generate_scaffolded(self, seed: int, difficulty: int, scaffold: int) -> Instance:
        if scaffold <= LOOKUP_LEVELS:
            return super().generate_scaffolded(seed, difficulty, scaffold)
        inst = compound.generate(SEED, seed, difficulty, kinds=RUNG_KINDS[scaffold])
        inst = fresh_customer(inst, customer_rng(f"{self.template}/p{scaffold}", seed, difficulty))
        if scaffold < 4:
            return _scaffolded(inst, len(inst.reference_actions), self.domain)
        # Two cancellations for a user who gives their user id: no identification, nothing prefilled, so the
        # dialogue opens like the warm-start's single_write ones (read the order, write) and goes on to a second
        # one (measured: with the look-ups prefilled, the base agent closed without a write in 94% of rollouts).
        ident = {"find_user_id_by_email", "find_user_id_by_name_zip", "get_user_details"}
        uid = inst.meta["user_id"]
        email = inst.user_facts.get("email", "")
        return inst.model_copy(update={
            "reference_actions": [a for a in inst.reference_actions if a.name not in ident],
            "opening": inst.opening.replace(f"My email is {email}.", f"My user id is {uid}."),
            "user_facts": {**inst.user_facts, "user_id": uid},
        })

    def hint(self, instance: Instance) -> str:
        writes = sum(a.name in WRITE_TOOLS for a in instance.reference_actions)
        return (f"{super().hint(instance)} This request needs {writes} separate changes, each its own tool call; "
                "the conversation is not done until every one of them went through.")
