"""Evaluation metrics with τ²-bench's exact definitions, on recorded `Trajectory` lists.

- success: a reward within 1e-6 of 1.0 (τ²'s tolerance), decided from `Trajectory.reward`.
- pass^k of one task with n trials and c successes: C(c, k) / C(n, k) — the chance that k trials drawn without
  replacement all succeed; n < k is an error. The overall pass^k is the plain mean over tasks.
- Like τ², pass^k is reported only for k up to the smallest number of trials any task has.

No τ² import: this module is cheap and used by every stage that reports results.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from trace_core.schemas import Trajectory

SUCCESS_TOLERANCE = 1e-6


def is_success(reward: float) -> bool:
    """τ²'s success test: the reward is 1.0 up to `SUCCESS_TOLERANCE` either way."""
    return (1.0 - SUCCESS_TOLERANCE) <= reward <= (1.0 + SUCCESS_TOLERANCE)


def pass_hat_k(num_trials: int, success_count: int, k: int) -> float:
    """pass^k for one task: C(success_count, k) / C(num_trials, k)."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if not 0 <= success_count <= num_trials:
        raise ValueError(f"success count {success_count} is not within 0..{num_trials}")
    if num_trials < k:
        raise ValueError(f"number of trials {num_trials} is less than k {k}")
    return math.comb(success_count, k) / math.comb(num_trials, k)


def pass_k(counts: Iterable[tuple[int, int]], k: int) -> float:
    """The mean over tasks of pass^k, from one (num_trials, success_count) pair per task."""
    values = [pass_hat_k(n, c, k) for n, c in counts]
    if not values:
        raise ValueError("pass^k needs at least one task")
    return sum(values) / len(values)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def summarize(trajectories: Sequence[Trajectory], ks: Iterable[int] = (1, 2, 3, 4)) -> dict[str, Any]:
    """Overall and per-family results of a set of trajectories (several trials of a task share its instance_id).

    Returns a JSON-friendly dict:
      n_trajectories, n_tasks, min_trials, max_trials, mean_reward, success_rate,
      pass_hat_k: {"1": ..., "2": ...} — overall pass^k for each requested k not above min_trials,
      families: {family: {n, n_tasks, pass_hat_1, mean_reward}},
      tasks: {instance_id: {family, trials, successes}},
      termination: {reason: count}.
    """
    trajectories = list(trajectories)
    tasks: dict[str, dict[str, Any]] = {}
    rewards_by_family: dict[str, list[float]] = {}
    for t in trajectories:
        entry = tasks.setdefault(t.instance_id, {"family": t.family, "trials": 0, "successes": 0})
        entry["trials"] += 1
        entry["successes"] += int(is_success(t.reward))
        rewards_by_family.setdefault(t.family, []).append(t.reward)

    trials = [e["trials"] for e in tasks.values()]
    min_trials = min(trials) if trials else 0
    counts = [(e["trials"], e["successes"]) for e in tasks.values()]
    pass_hat = {str(k): pass_k(counts, k) for k in sorted(set(ks)) if 1 <= k <= min_trials}

    families: dict[str, dict[str, Any]] = {}
    for family in sorted(rewards_by_family):
        fam_counts = [(e["trials"], e["successes"]) for e in tasks.values() if e["family"] == family]
        families[family] = {
            "n": len(rewards_by_family[family]),
            "n_tasks": len(fam_counts),
            "pass_hat_1": pass_k(fam_counts, 1),
            "mean_reward": _mean(rewards_by_family[family]),
        }

    return {
        "n_trajectories": len(trajectories),
        "n_tasks": len(tasks),
        "min_trials": min_trials,
        "max_trials": max(trials) if trials else 0,
        "mean_reward": _mean([t.reward for t in trajectories]),
        "success_rate": _mean([float(is_success(t.reward)) for t in trajectories]),
        "pass_hat_k": pass_hat,
        "families": families,
        "tasks": {tid: dict(e) for tid, e in sorted(tasks.items())},
        "termination": dict(sorted(Counter(t.termination_reason for t in trajectories).items())),
    }


def flat_metrics(summary: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Scalar metrics of a summary under names a tracker accepts (letters, digits, `_`, `.`, `-`, `/`)."""
    out: dict[str, float] = {
        f"{prefix}mean_reward": float(summary["mean_reward"]),
        f"{prefix}success_rate": float(summary["success_rate"]),
        f"{prefix}n_trajectories": float(summary["n_trajectories"]),
    }
    for k, v in summary["pass_hat_k"].items():
        out[f"{prefix}pass_hat_{k}"] = float(v)
    for family, f in summary["families"].items():
        safe = "".join(ch if ch.isalnum() or ch in "_.-" else "_" for ch in family)
        out[f"{prefix}family/{safe}/pass_hat_1"] = float(f["pass_hat_1"])
        out[f"{prefix}family/{safe}/mean_reward"] = float(f["mean_reward"])
    return out


def format_table(summary: Mapping[str, Any]) -> str:
    """A markdown table: one row per family and an "all" row, then the overall pass^k line."""
    lines = ["| family | n | pass^1 | mean reward |", "| --- | ---: | ---: | ---: |"]
    for family, f in summary["families"].items():
        lines.append(f"| {family} | {f['n']} | {f['pass_hat_1']:.3f} | {f['mean_reward']:.3f} |")
    overall_p1 = summary["pass_hat_k"].get("1")
    p1 = f"{overall_p1:.3f}" if overall_p1 is not None else "-"
    lines.append(f"| **all** | {summary['n_trajectories']} | {p1} | {summary['mean_reward']:.3f} |")
    if summary["pass_hat_k"]:
        ks = ", ".join(f"pass^{k} = {v:.3f}" for k, v in summary["pass_hat_k"].items())
        lines.append("")
        lines.append(f"{summary['n_tasks']} tasks, {summary['min_trials']}-{summary['max_trials']} trials each: {ks}")
    return "\n".join(lines)


__all__ = ["SUCCESS_TOLERANCE", "flat_metrics", "format_table", "is_success", "pass_hat_k", "pass_k", "summarize"]
