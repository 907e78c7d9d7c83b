"""Held-out evaluation of one capability's adapter against the base agent it was trained from.

Both models play the same held-out instances of the capability's environment, greedily, through the same rollout
engine and policy class, so every seed yields a pair of outcomes. Reported:

- per model: the success rate with a Wilson 95% interval (sensible at the small counts a CPU run affords, where the
  normal approximation gives intervals outside [0, 1]) and the mean reward R_c;
- for the pair: the mean per-seed difference in success with a paired bootstrap 95% interval (seeds are resampled
  with both outcomes, so the pairing is kept), and how many seeds improved or regressed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from statistics import NormalDist
from typing import Any

from trace_core.envs.base import Environment, EpisodeLimits
from trace_core.schemas import Trajectory

Z_95 = 1.959963984540054  # standard normal quantile for a two-sided 95% interval


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (the whole [0, 1] when n is 0)."""
    if not 0 <= successes <= n:
        raise ValueError(f"successes={successes} must be within 0..n={n}")
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_bootstrap_interval(
    differences: Sequence[float], *, samples: int, level: float, seed: int
) -> tuple[float, float]:
    """A percentile bootstrap interval of the mean of paired differences (one per seed)."""
    n = len(differences)
    if n == 0:
        raise ValueError("a paired interval needs at least one pair")
    rng = random.Random(seed)
    means = sorted(sum(differences[rng.randrange(n)] for _ in range(n)) / n for _ in range(samples))
    tail = (1 - level) / 2
    return (means[round(tail * (samples - 1))], means[round((1 - tail) * (samples - 1))])


def play(
    env: Environment,
    policy: Any,
    seeds: Sequence[int],
    *,
    make_user: Callable[[], Any],
    sampling: Any,
    limits: EpisodeLimits,
    batch_size: int,
    progress: bool = False,
) -> list[Trajectory]:
    """One episode per seed, in seed order."""
    from trace_core.agents.rollout import run_episodes

    instances = [env.reset(s) for s in seeds]
    return run_episodes(env, instances, policy, make_user, sampling, limits, trials=1, batch_size=batch_size,
                        progress=progress)


def play_greedy_model(
    env: Environment,
    model: Any,
    tokenizer: Any,
    seeds: Sequence[int],
    *,
    name: str,
    make_user: Callable[[], Any],
    limits: EpisodeLimits,
    batch_size: int,
    max_context: int,
    max_new_tokens: int,
    seed: int,
    progress: bool = False,
) -> list[Trajectory]:
    """One greedy (temperature 0) episode per seed with a loaded model through the deployed policy class
    (`LocalPolicy`, as the baseline plays): the held-out evaluation and best-step validation both play this way."""
    from trace_core.agents.local import LocalPolicy
    from trace_core.agents.policy import Sampling

    # top_p 1: greedy decoding takes the argmax and never applies nucleus truncation (LocalPolicy.generate)
    sampling = Sampling(temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens, seed=seed)
    policy = LocalPolicy.from_model(model, tokenizer, batch_size=batch_size, max_context=max_context, name=name)
    return play(env, policy, seeds, make_user=make_user, sampling=sampling, limits=limits, batch_size=batch_size,
                progress=progress)


def _side(trajectories: Sequence[Trajectory], z: float) -> dict[str, Any]:
    n = len(trajectories)
    successes = sum(t.success for t in trajectories)
    low, high = wilson_interval(successes, n, z=z)
    return {
        "episodes": n,
        "successes": successes,
        "success_rate": successes / n if n else 0.0,
        "success_ci": [low, high],
        "mean_reward": sum(t.reward for t in trajectories) / n if n else 0.0,
    }


def compare(
    seeds: Sequence[int], base: Sequence[Trajectory], adapter: Sequence[Trajectory], *, samples: int, level: float,
    seed: int,
) -> dict[str, Any]:
    """The evaluation report of paired episodes (`base[i]` and `adapter[i]` played `seeds[i]`): Wilson intervals
    per side and a paired bootstrap interval of the difference, both at confidence `level`, `samples` resamples."""
    if not len(seeds) == len(base) == len(adapter):
        raise ValueError(f"need one base and one adapter episode per seed, got {len(seeds)}, {len(base)}, {len(adapter)}")
    differences = [float(a.success) - float(b.success) for b, a in zip(base, adapter)]
    low, high = paired_bootstrap_interval(differences, samples=samples, level=level, seed=seed)
    z = NormalDist().inv_cdf(0.5 + level / 2)
    return {
        "seeds": list(seeds),
        "base": _side(base, z),
        "adapter": _side(adapter, z),
        "difference": {
            "success_rate": sum(differences) / len(differences),
            "ci": [low, high],
            "improved": sum(d > 0 for d in differences),
            "regressed": sum(d < 0 for d in differences),
            "method": f"paired percentile bootstrap over seeds, {samples} resamples, {level:.0%}",
        },
        "per_seed": [
            {
                "seed": s,
                "base_reward": b.reward,
                "adapter_reward": a.reward,
                "base_success": b.success,
                "adapter_success": a.success,
            }
            for s, b, a in zip(seeds, base, adapter)
        ],
    }
