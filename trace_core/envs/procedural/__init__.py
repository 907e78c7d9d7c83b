"""Procedural task families over the real τ² retail database.

Each family is a pure function `generate(seed, index, difficulty) -> Instance`: the same coordinates always give a
byte-identical instance (see `_retail.make_rng`). Every instance is solvable: replaying its reference actions in
`Tau2Environment("retail", "compact")` scores 1.0, and when it requires a write, doing nothing scores 0.0.

Families (difficulty 0..3 makes each measurably harder; see each module's docstring):
  single_write       one write, every identifier given in the opening
  identify_then_act  find the user by e-mail or name+zip (and at 2+ the order by its contents), then act
  variant_choice     exchange / modify an item to the one variant matching 1-3 option constraints
  compound           2-4 writes in one request
  policy_refusal     requests the policy forbids (~60%) mixed with look-alikes it allows
"""

from __future__ import annotations

from collections.abc import Callable

from trace_core.envs.procedural import compound, identify_then_act, policy_refusal, single_write, variant_choice
from trace_core.envs.procedural._retail import MAX_DIFFICULTY, check_difficulty
from trace_core.schemas import Instance

FAMILIES: dict[str, Callable[[int, int, int], Instance]] = {
    single_write.FAMILY: single_write.generate,
    identify_then_act.FAMILY: identify_then_act.generate,
    variant_choice.FAMILY: variant_choice.generate,
    compound.FAMILY: compound.generate,
    policy_refusal.FAMILY: policy_refusal.generate,
}
def _family(name: str) -> Callable[[int, int, int], Instance]:
    if name not in FAMILIES:
        raise ValueError(f"unknown procedural family {name!r}; choose one of {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


def generate(family: str, seed: int, index: int, difficulty: int) -> Instance:
    """One instance of `family`: a pure function of (family, seed, index, difficulty)."""
    fn = _family(family)
    check_difficulty(difficulty)
    return fn(seed, index, difficulty)


def generate_set(families: list[str], seed: int, per_family: int, difficulty: int) -> list[Instance]:
    """`per_family` instances (indices 0..per_family-1) of each family, ordered by family then index."""
    fns = [(name, _family(name)) for name in families]  # validate every name before generating anything
    check_difficulty(difficulty)
    if per_family < 0:
        raise ValueError(f"per_family must be >= 0, got {per_family}")
    return [fn(seed, i, difficulty) for _, fn in fns for i in range(per_family)]


__all__ = ["FAMILIES", "MAX_DIFFICULTY", "generate", "generate_set"]
