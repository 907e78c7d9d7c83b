"""Group rollouts for GRPO (docs/method.md §3): G episodes per seed, group-relative advantages, and the DAPO-style
refill.

A group is `num_generations` rollouts of one instance. Its advantages are (r - mean) / (std + eps): a group whose
rewards are all equal has no signal, so `collect_groups` drops it and draws fresh seeds until `groups_per_step`
informative groups are in hand or `max_resample_rounds` extra rounds were tried. If still short, the last round's
constant groups fill the batch; the trainer masks them out of the loss (their advantages are 0 anyway). Every
episode run is counted in the `RolloutLedger`.

Optional hint injection (from the released code): `hinted_per_group` rollouts of each group see a hint appended to
the system prompt; training later uses the un-hinted prompt for all of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from trace_core.agents.policy import Sampling
from trace_core.agents.rollout import run_episodes
from trace_core.envs.base import Environment, EpisodeLimits, Hinted
from trace_core.schemas import Instance, Trajectory
from trace_core.training.ledger import RolloutLedger
from trace_core.training.settings import GRPOSettings

# The same epsilon and the same (Bessel-corrected) std as TRL's `scale_rewards="group"`, so the advantages we
# log and test are the ones its loss uses.
ADVANTAGE_EPS = 1e-4
# Rewards closer than this count as equal (R_c is rounded to 6 decimals).
REWARD_TOLERANCE = 1e-9


def group_advantages(rewards: list[float], eps: float = ADVANTAGE_EPS) -> list[float]:
    """Â_i = (r_i - mean(r)) / (std(r) + eps), with the sample standard deviation."""
    n = len(rewards)
    if n < 2:
        raise ValueError(f"a group needs at least 2 rewards to compare, got {n}")
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
    return [(r - mean) / (std + eps) for r in rewards]


def is_informative(rewards: list[float]) -> bool:
    """Whether a group's rewards differ (a constant group has zero advantages: no learning signal)."""
    return max(rewards) - min(rewards) > REWARD_TOLERANCE


@dataclass
class Group:
    """The rollouts of one instance. `system_prompt` and `tools` are what the un-hinted rollouts saw: training
    renders every rollout of the group with them."""

    seed: int
    instance: Instance
    system_prompt: str
    tools: list[dict]
    trajectories: list[Trajectory]
    hinted: list[bool]

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def informative(self) -> bool:
        return is_informative(self.rewards)

    def advantages(self) -> list[float]:
        return group_advantages(self.rewards)


def informative(groups: list[Group]) -> list[Group]:
    """The groups whose rewards are not all equal, in order."""
    return [g for g in groups if g.informative]


@dataclass
class Collection:
    """One optimiser step's groups: the informative ones first, then `fillers` constant groups if the refill rounds
    ran out (the trainer masks those out of the loss)."""

    groups: list[Group]
    fillers: int
    rounds: int  # rollout rounds run (1 + refills)
    rollouts: int  # episodes run, dropped groups included
    dropped: int  # groups discarded: constant-reward ones, and informative ones beyond groups_per_step

    @property
    def num_informative(self) -> int:
        return len(self.groups) - self.fillers

    def stats(self) -> dict[str, float]:
        rewards = [r for g in self.groups for r in g.rewards]
        return {
            "rounds": float(self.rounds),
            "rollouts": float(self.rollouts),
            "informative_groups": float(self.num_informative),
            "filler_groups": float(self.fillers),
            "dropped_groups": float(self.dropped),
            # must-refuse instances among the informative groups (0 where the environment has none)
            "informative_refusals": float(sum(map(_must_refuse, self.groups[: self.num_informative]))),
            "mean_reward": sum(rewards) / len(rewards) if rewards else 0.0,
            "success_rate": sum(t.success for g in self.groups for t in g.trajectories) / max(1, len(rewards)),
        }


def run_groups(
    env: Environment,
    policy: Any,
    seeds: list[int],
    settings: GRPOSettings,
    *,
    make_user: Callable[[], Any],
    limits: EpisodeLimits,
    hint: Callable[[Instance], str] | None = None,
    progress: bool = False,
) -> list[Group]:
    """One group of `num_generations` rollouts per seed, all seeds' episodes batched together."""
    G = settings.num_generations
    n_hint = settings.hinted_per_group if hint is not None else 0
    n_plain = G - n_hint
    instances = [env.reset(s) for s in seeds]
    # Sampling seeds differ per round (they follow the round's first environment seed); the hinted run gets its own.
    sampling = Sampling(
        temperature=settings.temperature,
        top_p=1.0,  # untruncated: the GRPO loss's log-probabilities are of the full distribution
        max_new_tokens=settings.max_new_tokens,
        seed=settings.seed * 1_000_003 + 2 * seeds[0],
    )

    def run(target: Any, trials: int, sampling: Sampling) -> list[Trajectory]:
        if trials == 0:
            return []
        return run_episodes(
            target,
            instances,
            policy,
            make_user,
            sampling,
            limits,
            trials=trials,
            batch_size=settings.rollout_batch_size,
            progress=progress,
        )

    plain = run(env, n_plain, sampling)
    hinted = run(Hinted(env, hint), n_hint, replace(sampling, seed=sampling.seed + 1)) if n_hint else []
    groups = []
    for k, (seed, inst) in enumerate(zip(seeds, instances, strict=True)):
        mine = plain[k * n_plain : (k + 1) * n_plain]
        extra = [
            t.model_copy(update={"trial": n_plain + t.trial, "meta": {**t.meta, "hinted": True}})
            for t in hinted[k * n_hint : (k + 1) * n_hint]
        ]
        trajectories = mine + extra
        if any(t.instance_id != inst.instance_id for t in trajectories):
            raise RuntimeError("run_episodes returned trajectories out of schedule order")
        group = Group(
            seed=seed,
            instance=inst,
            system_prompt=env.system_prompt(inst),
            tools=env.tool_schemas(inst),
            trajectories=trajectories,
            hinted=[False] * len(mine) + [True] * len(extra),
        )
        groups.append(group)
    return groups


def collect_groups(
    env: Environment,
    policy: Any,
    seeds: Iterator[int],
    settings: GRPOSettings,
    *,
    make_user: Callable[[], Any],
    limits: EpisodeLimits,
    ledger: RolloutLedger | None = None,
    capability_id: str | None = None,
    stage: str = "training",
    hint: Callable[[Instance], str] | None = None,
    progress: bool = False,
    fill_batch: bool = True,
) -> Collection:
    """Roll out groups for fresh seeds from `seeds` until `groups_per_step` are informative or
    `max_resample_rounds` refill rounds were run; count every rollout and seed in `ledger`.

    With `fill_batch`, a round runs at least as many groups as one rollout batch holds (`rollout_batch_size //
    num_generations`): a refill for one missing group would otherwise generate a half-empty batch, which costs a
    local model nearly as much wall time as a full one (SmolLM2, CPU: 8 episodes 93 s, 16 episodes 107 s) for half
    the chances of an informative group. Informative groups beyond `groups_per_step` are dropped (and counted).
    Without it (rollout-budgeted runs), a round runs only the groups still missing."""
    if settings.hint_fraction > 0 and hint is None:
        raise ValueError(
            f"hint_fraction={settings.hint_fraction} but no hint function was given; pass hint=callable(instance) "
            "-> str or set training.hint_fraction: 0"
        )
    capability_id = capability_id or getattr(env, "capability_id", None) or "unknown"
    need = settings.groups_per_step
    # With balance_refusals each kind (must-refuse, must-act) has half the step's places; otherwise one pool.
    half = need // 2 if settings.balance_refusals else None
    kept: list[Group] = []
    surplus: list[Group] = []  # informative groups over their kind's quota (balance_refusals only)
    constant: list[Group] = []
    rounds = rollouts = ran = 0
    while len(kept) < need and rounds <= settings.max_resample_rounds:
        batch = []
        for _ in range(max(need - len(kept), settings.rollout_batch_size // settings.num_generations if fill_batch else 0)):
            try:
                batch.append(next(seeds))
            except StopIteration:
                raise ValueError(
                    f"the seed iterator ran out after {rounds} rounds; pass an endless one, e.g. "
                    "itertools.cycle(train_seeds)"
                ) from None
        groups = run_groups(
            env, policy, batch, settings, make_user=make_user, limits=limits, hint=hint, progress=progress
        )
        spent = sum(len(g.trajectories) for g in groups)
        rollouts += spent
        ran += len(groups)
        rounds += 1
        if ledger is not None:
            ledger.add(stage, capability_id, rollouts=spent, seeds=len(batch))
        constant = [g for g in groups if not g.informative]  # this round's replace an earlier round's
        for g in informative(groups):
            if half is None:
                (kept if len(kept) < need else surplus).append(g)
            elif sum(_must_refuse(k) == _must_refuse(g) for k in kept) < half:
                kept.append(g)
            else:
                surplus.append(g)
    spare: list[Group] = []
    if half is not None:
        # Both kinds equally, or the step pushes the agent towards the kind whose groups happened to vary more
        # often (measured: precondition_verification's adapter learnt "never write"; docs/results.md). Kept groups
        # beyond the scarcer kind's count, and the surplus, may fill the step: a filler's rows carry no loss.
        per_kind = min(sum(_must_refuse(k) == kind for k in kept) for kind in (True, False))
        taken = {True: 0, False: 0}
        balanced = []
        for g in kept:
            kind = _must_refuse(g)
            (balanced if taken[kind] < per_kind else spare).append(g)
            taken[kind] += 1
        kept, spare = balanced, spare + surplus
    fillers = (spare + constant)[: need - len(kept)]
    return Collection(kept + fillers, len(fillers), rounds, rollouts, ran - len(kept) - len(fillers))


def _must_refuse(group: Group) -> bool:
    return bool(group.instance.must_refuse)


def mixes_refusals(env: Environment, seeds: Iterable[int]) -> bool:
    """Whether `seeds` give `env` both must-refuse and must-act instances: only then has `balance_refusals` two kinds
    to balance (in an environment of one kind, a balanced step would find one kind only and train on nothing).
    Instances are pure functions of their seed; scanning stops at the first seed of the second kind."""
    seen: set[bool] = set()
    for seed in seeds:
        seen.add(bool(env.reset(seed).must_refuse))
        if len(seen) == 2:
            return True
    return False
