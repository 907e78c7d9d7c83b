"""Calibration of a synthetic environment against the base agent (method.md §2): roll the agent out on `seeds`
seeds x `samples` samples, and require mean reward and success rate in [low, high], reward std ≥ min_std, at most
`max_all_success` / `max_all_zero` of groups constant at 1 / 0, and ≥ `min_informative` groups not constant.
Too easy moves the difficulty knob up, too hard moves it down, at most `max_adjustments` times. Below difficulty 0
the knob goes on into scaffolds (`SyntheticEnv.scaffold`: 1, 2, ... of the reference's look-ups prefilled), so an
agent that fails even the easiest instances still gets an environment with reward signal, on the same tools.
Polarized and flat verdicts (constant groups of both kinds: per-seed outcomes barely depend on sampling) move the
knob only while the mean lies outside [low, high], toward it; inside, no difficulty would make groups informative."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trace_core.synthesis.contract import SyntheticEnv


@dataclass(frozen=True)
class CalibrationConfig:
    seeds: int = 100
    samples: int = 16
    low: float = 0.2
    high: float = 0.6
    min_std: float = 0.05
    max_all_success: float = 0.2
    max_all_zero: float = 0.2
    min_informative: float = 0.5
    max_adjustments: int = 5
    seed_offset: int = 1_000_000  # calibration seeds are disjoint from the train/eval manifests' seeds


def group_statistics(groups: list[list[float]]) -> dict[str, float]:
    """Statistics of reward groups (one list of sample rewards per seed)."""
    rewards = [r for g in groups for r in g]
    n = max(1, len(rewards))
    mean = sum(rewards) / n
    std = (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5
    g = max(1, len(groups))
    return {
        "mean_reward": round(mean, 6),
        "success_rate": round(sum(r >= 1.0 - 1e-9 for r in rewards) / n, 6),
        "reward_std": round(std, 6),
        "all_success": round(sum(all(r >= 1.0 - 1e-9 for r in grp) for grp in groups) / g, 6),
        "all_zero": round(sum(all(r <= 1e-9 for r in grp) for grp in groups) / g, 6),
        "informative": round(sum(max(grp) - min(grp) > 1e-9 for grp in groups if grp) / g, 6),
    }


def verdict(stats: dict[str, float], cfg: CalibrationConfig) -> tuple[str, list[str]]:
    """("ok" | "too_easy" | "too_hard" | "polarized" | "flat", reasons). Polarized: signs of both (e.g. many
    all-success and many all-zero groups) — moving the difficulty would not help; flat: too little variance."""
    easy, hard = [], []
    for key in ("mean_reward", "success_rate"):
        if stats[key] > cfg.high:
            easy.append(f"{key} {stats[key]:.2f} > {cfg.high}")
        if stats[key] < cfg.low:
            hard.append(f"{key} {stats[key]:.2f} < {cfg.low}")
    if stats["all_success"] > cfg.max_all_success:
        easy.append(f"all-success groups {stats['all_success']:.0%} > {cfg.max_all_success:.0%}")
    if stats["all_zero"] > cfg.max_all_zero:
        hard.append(f"all-zero groups {stats['all_zero']:.0%} > {cfg.max_all_zero:.0%}")
    flat = []
    if stats["reward_std"] < cfg.min_std:
        flat.append(f"reward std {stats['reward_std']:.3f} < {cfg.min_std}")
    if stats["informative"] < cfg.min_informative:
        flat.append(f"informative groups {stats['informative']:.0%} < {cfg.min_informative:.0%}")
    if easy and hard:
        return "polarized", easy + hard + flat
    if easy:
        return "too_easy", easy + flat
    if hard:
        return "too_hard", hard + flat
    if flat:
        return "flat", flat
    return "ok", []


def ladder(max_difficulty: int, max_scaffold: int) -> list[tuple[int, int]]:
    """The knob's positions, easiest first: (0, max_scaffold) ... (0, 1), then (0, 0) ... (max_difficulty, 0)."""
    return [(0, s) for s in range(max_scaffold, 0, -1)] + [(d, 0) for d in range(max_difficulty + 1)]


def _step(outcome: str, stats: dict[str, float], cfg: CalibrationConfig) -> int:
    if outcome == "too_easy":
        return 1
    if outcome == "too_hard":
        return -1
    # polarized / flat: only the mean can still be moved into the band
    return 1 if stats["mean_reward"] > cfg.high else -1 if stats["mean_reward"] < cfg.low else 0


def calibrate(
    make_env: Callable[[int, int], SyntheticEnv],
    start_difficulty: int,
    rollout: Callable[[SyntheticEnv, list[int], int], list[list[float]]],
    cfg: CalibrationConfig,
    on_try: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[int, int, bool, list[dict[str, Any]]]:
    """Try knob positions from (`start_difficulty`, scaffold 0), one step per verdict along `ladder`, until one is
    in the band or the ladder or `max_adjustments` runs out. `make_env(difficulty, scaffold)` builds the
    environment; `rollout(env, seeds, samples)` returns one reward group per seed; `on_try` sees each record as it
    is made. Returns (difficulty, scaffold, calibrated?, one record per position tried)."""
    probe = make_env(start_difficulty, 0)
    steps = ladder(probe.max_difficulty, probe.max_scaffold)
    at = steps.index((start_difficulty, 0))
    tried: list[dict[str, Any]] = []
    seeds = [cfg.seed_offset + i for i in range(cfg.seeds)]
    for _ in range(cfg.max_adjustments + 1):
        difficulty, scaffold = steps[at]
        env = probe if (difficulty, scaffold) == (start_difficulty, 0) else make_env(difficulty, scaffold)
        stats = group_statistics(rollout(env, seeds, cfg.samples))
        outcome, reasons = verdict(stats, cfg)
        record = {"difficulty": difficulty, "scaffold": scaffold, "verdict": outcome, "reasons": reasons,
                  "rollouts": len(seeds) * cfg.samples, **stats}
        tried.append(record)
        if on_try is not None:
            on_try(record)
        if outcome == "ok":
            return difficulty, scaffold, True, tried
        nxt = at + _step(outcome, stats, cfg)
        if nxt == at or not 0 <= nxt < len(steps) or any((t["difficulty"], t["scaffold"]) == steps[nxt] for t in tried):
            break
        at = nxt
    # Out of room: keep the position tried closest to the band's middle.
    middle = (cfg.low + cfg.high) / 2
    best = min(tried, key=lambda t: (abs(t["mean_reward"] - middle), -t["informative"]))
    return best["difficulty"], best["scaffold"], False, tried


def policy_rollout(policy, sampling, limits, batch_size: int = 16, progress: bool = False):
    """A `rollout` for `calibrate` that runs the agent with the rollout engine (scripted user, `samples` trials)."""
    from trace_core.agents.rollout import run_episodes
    from trace_core.envs.users import ScriptedUser

    def rollout(env: SyntheticEnv, seeds: list[int], samples: int) -> list[list[float]]:
        instances = [env.reset(s) for s in seeds]
        trajs = run_episodes(
            env, instances, policy, ScriptedUser, sampling, limits, trials=samples, batch_size=batch_size, progress=progress
        )
        groups: dict[str, list[float]] = {}
        for t in trajs:
            groups.setdefault(t.instance_id, []).append(t.reward)
        return [groups.get(i.instance_id, []) for i in instances]

    return rollout
