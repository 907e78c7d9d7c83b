"""Consolidation baseline "one LoRA on a mixture of all synthetic environments" (docs/method.md §5): a single adapter
trained with the same GRPO settings and the same total rollout budget as TRACE's per-capability adapters.

`MixtureEnv` is an `Environment` over several component environments. Seed s picks component
`ids[s % K]` (round robin in the order given, so consecutive GRPO groups alternate capabilities and the
budget is shared evenly) and that component's training seed number `s // K` (cycling through the component's
`train_seeds`, so the mixture only ever draws seeds the per-capability adapters trained on, never their held-out
ones). The instance is the component's own, with the component's id and seed added to `meta`; everything an
episode calls — tool schemas, system prompt, `start` (so a synthetic environment's prefilled calls still run),
state, tool execution and the score R_c — goes to the component that made the instance.

`train_on_mixture` runs `target.train_within_budget` on it (ledger id `mixture`; same outputs and resumption as
the GRPO-on-target baseline, plus each component's share of the rollouts in the record).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trace_core.envs.base import Environment, Episode, EpisodeLimits
from trace_core.schemas import Action, Instance, Message, RewardResult, ToolCall
from trace_core.training.settings import GRPOSettings

MIXTURE_ID = "mixture"  # the ledger's capability id for this baseline
COMPONENT = "mixture_component"  # Instance.meta key: which component made the instance
COMPONENT_SEED = "mixture_seed"  # Instance.meta key: the component seed it was made from


@dataclass
class _State:
    """A component's episode state, with the component it belongs to (`_execute` gets only the state)."""

    component: str
    inner: Any


class MixtureEnv(Environment):
    """One environment over `envs` (capability id -> environment, all of one domain). `train_seeds` (capability id
    -> that environment's training seeds) confines each component to its training seeds; without it, component
    seed n is n itself."""

    def __init__(
        self,
        envs: Mapping[str, Environment],
        train_seeds: Mapping[str, Sequence[int]] | None = None,
        capability_id: str = MIXTURE_ID,
    ):
        if not envs:
            raise ValueError("MixtureEnv needs at least one component environment (capability id -> environment)")
        domains = {getattr(e, "domain", None) for e in envs.values()}
        if len(domains) != 1:
            raise ValueError(f"the components span several domains {sorted(map(str, domains))}; mix one domain only")
        self.envs = dict(envs)
        self.ids = list(self.envs)
        self.domain = domains.pop()
        self.capability_id = capability_id
        self.train_seeds: dict[str, list[int]] | None = None
        if train_seeds is not None:
            missing = [c for c in self.ids if not list(train_seeds.get(c, ()))]
            if missing:
                raise ValueError(f"train_seeds has no seeds for {missing}; give every component its training seeds")
            self.train_seeds = {c: list(train_seeds[c]) for c in self.ids}

    # -- which component ---------------------------------------------------------------------------------
    def locate(self, seed: int) -> tuple[str, int]:
        """The component and component seed of mixture seed `seed`."""
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        cid = self.ids[seed % len(self.ids)]
        n = seed // len(self.ids)
        if self.train_seeds is not None:
            own = self.train_seeds[cid]
            n = own[n % len(own)]
        return cid, n

    def component_of(self, instance: Instance) -> str:
        cid = instance.meta.get(COMPONENT)
        if cid not in self.envs:
            raise ValueError(
                f"instance {instance.instance_id} was not made by this MixtureEnv (meta[{COMPONENT!r}]={cid!r}); "
                "get instances from MixtureEnv.reset"
            )
        return cid

    def _env(self, instance: Instance) -> Environment:
        return self.envs[self.component_of(instance)]

    def component_counts(self, seeds: Sequence[int]) -> dict[str, int]:
        """How many of `seeds` each component gets."""
        counts = Counter(self.locate(s)[0] for s in seeds)
        return {c: counts.get(c, 0) for c in self.ids}

    # -- the Environment API, delegated --------------------------------------------------------------------
    def reset(self, seed: int) -> Instance:
        cid, own = self.locate(seed)
        inst = self.envs[cid].reset(own)
        return inst.model_copy(update={"meta": {**inst.meta, COMPONENT: cid, COMPONENT_SEED: own}})

    def hint(self, instance: Instance) -> str:
        """The hint of the instance's component (hint injection, `training.hint_fraction`)."""
        return self._env(instance).hint(instance)

    def tool_schemas(self, instance: Instance | None = None) -> list[dict[str, Any]]:
        if instance is None:
            return self._common("tool_schemas")
        return self._env(instance).tool_schemas(instance)

    def system_prompt(self, instance: Instance | None = None) -> str:
        if instance is None:
            return self._common("system_prompt")
        return self._env(instance).system_prompt(instance)

    def _common(self, method: str) -> Any:
        """What every component answers without an instance; an error when they differ."""
        answers = [getattr(e, method)(None) for e in self.envs.values()]
        if any(a != answers[0] for a in answers[1:]):
            raise ValueError(f"the components' {method}() differ; call it with an instance from MixtureEnv.reset")
        return answers[0]

    def start(
        self,
        instance: Instance,
        user: Any,
        limits: EpisodeLimits,
        system_prompt: str | None = None,
    ) -> Episode:
        # The component starts its own episode: its start() may do more than the base class (prefilled calls).
        return self._env(instance).start(instance, user, limits, system_prompt)

    def _new_state(self, instance: Instance) -> _State:
        cid = self.component_of(instance)
        return _State(cid, self.envs[cid]._new_state(instance))

    def _execute(self, state: Any, call: ToolCall) -> tuple[str, bool]:
        if not isinstance(state, _State):
            return "Error: internal: a mixture tool call got a state not made by MixtureEnv._new_state", True
        return self.envs[state.component]._execute(state.inner, call)

    def score(self, instance: Instance, messages: list[Message], termination_reason: str) -> RewardResult:
        return self._env(instance).score(instance, messages, termination_reason)

    def reference(self, instance: Instance) -> list[Action]:
        """The component's reference solution (synthetic environments define one)."""
        env = self._env(instance)
        if not hasattr(env, "reference"):
            raise AttributeError(f"component {self.component_of(instance)} has no reference solution")
        return env.reference(instance)

    def describe(self) -> dict[str, Any]:
        """What the instances depend on (part of the run key)."""
        from trace_core.baselines.target import describe_env

        return {
            "kind": "mixture",
            "components": {c: describe_env(e) for c, e in self.envs.items()},
            "train_seeds": self.train_seeds,
        }


def train_on_mixture(
    env: MixtureEnv,
    model: Any,
    tokenizer: Any,
    settings: GRPOSettings,
    out_dir: str | os.PathLike,
    budget_rollouts: int,
    *,
    train_seeds: Sequence[int] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """One LoRA trained with GRPO on `env` within `budget_rollouts` (`target.train_within_budget`, ledger id
    `mixture`; `options` are its other keyword arguments). `train_seeds` are mixture seeds (default: enough for the
    budget without cycling, so every group is a fresh instance). The record adds `component_rollouts`: the rollouts
    each component's seeds took."""
    from trace_core.baselines.target import train_within_budget
    from trace_core.training.stage import RECORD, write_record

    if not isinstance(env, MixtureEnv):
        raise TypeError(f"train_on_mixture needs a MixtureEnv, got {type(env).__name__}")
    seeds = list(train_seeds) if train_seeds is not None else list(range(max(1, budget_rollouts)))
    record = train_within_budget(
        env, model, tokenizer, settings, out_dir, budget_rollouts, env.capability_id, train_seeds=seeds, **options
    )
    # The trainer draws seeds in order from cycle(seeds) and runs num_generations rollouts per seed.
    drawn = [seeds[i % len(seeds)] for i in range(int(record["seeds"]))]
    per_seed = settings.num_generations
    record["component_rollouts"] = {c: n * per_seed for c, n in env.component_counts(drawn).items()}
    return write_record(Path(out_dir) / RECORD, record)


__all__ = ["COMPONENT", "COMPONENT_SEED", "MIXTURE_ID", "MixtureEnv", "train_on_mixture"]
