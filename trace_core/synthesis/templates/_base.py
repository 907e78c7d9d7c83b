"""Shared by the templates that reuse a procedural retail family as their instance source."""

from __future__ import annotations

from trace_core.envs.procedural import generate as procedural
from trace_core.schemas import Instance
from trace_core.synthesis.contract import SyntheticEnv
from trace_core.synthesis.templates._customers import customer_rng, fresh_customer

# Procedural coordinates of synthetic instances: (family, SEED, index = the synthetic seed, difficulty). The
# procedural RNG mixes in the family name and this seed, so synthetic instances never share coordinates with the
# baseline's held-out instances (baseline.seed) or the warm-start's (bootstrap.seed); the stage checks both.
SEED = 424_242


class FamilyTemplate(SyntheticEnv):
    """A template whose instances come from procedural family `family` at the template's difficulty, each with a
    customer account of its own (`fresh_customer`: a generated DB state over the real retail data)."""

    family: str = ""

    def generate(self, seed: int, difficulty: int) -> Instance:
        inst = procedural(self.family, SEED, seed, difficulty)
        return fresh_customer(inst, customer_rng(self.template, seed, difficulty))
