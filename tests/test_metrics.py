"""pass^k and the run summary agree with τ²-bench's own metric code and with hand-computed values."""

from __future__ import annotations

import math
import os
import random

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # tau2 imports litellm: no cost-map download

from trace_core.metrics import flat_metrics, format_table, is_success, pass_hat_k, pass_k, summarize
from trace_core.schemas import Trajectory


def _traj(task: str, reward: float, trial: int = 0, family: str = "fam", reason: str = "agent_stop") -> Trajectory:
    return Trajectory(
        trajectory_id=f"{task}/t{trial}",
        instance_id=task,
        domain="retail",
        family=family,
        source="procedural",
        trial=trial,
        messages=[],
        termination_reason=reason,
        reward=reward,
        success=reward >= 1.0,
    )


# -- hand-computed --------------------------------------------------------------------------------------------
def test_pass_hat_k_hand_values():
    assert pass_hat_k(4, 4, 4) == 1.0
    assert pass_hat_k(4, 3, 4) == 0.0
    assert pass_hat_k(4, 2, 1) == 0.5
    assert pass_hat_k(4, 2, 2) == pytest.approx(1 / 6)  # C(2,2)/C(4,2)
    assert pass_hat_k(5, 3, 2) == pytest.approx(3 / 10)  # C(3,2)/C(5,2)
    assert pass_hat_k(3, 0, 1) == 0.0
    with pytest.raises(ValueError):
        pass_hat_k(2, 2, 3)  # fewer trials than k, as in τ²
    with pytest.raises(ValueError):
        pass_hat_k(2, 3, 1)
    with pytest.raises(ValueError):
        pass_hat_k(2, 1, 0)


def test_pass_k_is_mean_over_tasks():
    # task a: 2/2, task b: 1/2, task c: 0/2 -> pass^1 = (1 + .5 + 0)/3, pass^2 = (1 + 0 + 0)/3
    counts = [(2, 2), (2, 1), (2, 0)]
    assert pass_k(counts, 1) == pytest.approx(0.5)
    assert pass_k(counts, 2) == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        pass_k([], 1)


def test_success_tolerance_is_tau2s():
    assert is_success(1.0) and is_success(1 - 1e-7) and is_success(1 + 1e-7)
    assert not is_success(1 - 1e-5) and not is_success(0.0) and not is_success(1 + 1e-5)


def test_summarize_hand_case():
    trajs = [
        _traj("a", 1.0, 0, "retail-cancel"),
        _traj("a", 1.0, 1, "retail-cancel"),
        _traj("b", 1.0, 0, "retail-cancel", "user_stop"),
        _traj("b", 0.0, 1, "retail-cancel", "max_steps"),
        _traj("c", 0.0, 0, "retail-return"),
        _traj("c", 1 - 1e-7, 1, "retail-return"),  # a success within τ²'s tolerance
    ]
    s = summarize(trajs, ks=(1, 2, 3))
    assert s["n_trajectories"] == 6 and s["n_tasks"] == 3
    assert s["min_trials"] == s["max_trials"] == 2
    assert set(s["pass_hat_k"]) == {"1", "2"}  # k=3 exceeds the trials per task, as τ² caps it
    assert s["pass_hat_k"]["1"] == pytest.approx((1 + 0.5 + 0.5) / 3)
    assert s["pass_hat_k"]["2"] == pytest.approx(1 / 3)
    assert s["mean_reward"] == pytest.approx((4 - 1e-7) / 6)
    assert s["success_rate"] == pytest.approx(4 / 6)
    assert s["families"]["retail-cancel"] == {"n": 4, "n_tasks": 2, "pass_hat_1": 0.75, "mean_reward": 0.75}
    assert s["families"]["retail-return"]["pass_hat_1"] == 0.5
    assert s["tasks"]["b"] == {"family": "retail-cancel", "trials": 2, "successes": 1}
    assert s["termination"] == {"agent_stop": 4, "max_steps": 1, "user_stop": 1}
    flat = flat_metrics(s, prefix="eval/")
    assert flat["eval/pass_hat_1"] == s["pass_hat_k"]["1"]
    assert flat["eval/family/retail-cancel/pass_hat_1"] == 0.75

    table = format_table(s)
    lines = table.splitlines()
    assert lines[0] == "| family | n | pass^1 | mean reward |"
    assert "| retail-cancel | 4 | 0.750 | 0.750 |" in lines
    assert "| retail-return | 2 | 0.500 | 0.500 |" in lines
    assert "| **all** | 6 | 0.667 | 0.667 |" in lines
    assert "pass^2 = 0.333" in table


def test_summarize_empty_and_uneven_trials():
    s = summarize([])
    assert s["n_trajectories"] == 0 and s["pass_hat_k"] == {} and s["families"] == {}
    assert "| **all** | 0 | - |" in format_table(s)
    # uneven trials: pass^k only up to the smallest count (τ² warns and caps max k the same way)
    s = summarize([_traj("a", 1.0, 0), _traj("a", 1.0, 1), _traj("b", 0.0, 0)], ks=(1, 2))
    assert s["min_trials"] == 1 and s["max_trials"] == 2
    assert list(s["pass_hat_k"]) == ["1"]
    assert s["pass_hat_k"]["1"] == pytest.approx(0.5)


# -- against τ²'s own code --------------------------------------------------------------------------------------
def test_pass_hat_k_equals_tau2_function():
    from tau2.metrics.agent_metrics import pass_hat_k as tau2_pass_hat_k

    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_hat_k(n, c, k) == tau2_pass_hat_k(n, c, k)


def _tau2_results(matrix: list[list[float]]):
    """A τ² `Results` with one task per row and one simulation per trial, carrying the given rewards."""
    from tau2.data_model.simulation import Results, RewardInfo, SimulationRun
    from tau2.data_model.tasks import Task

    tasks = [
        Task.model_validate(
            {
                "id": str(i),
                "user_scenario": {"instructions": "x"},
                "evaluation_criteria": {"actions": [], "reward_basis": ["DB"]},
            }
        )
        for i in range(len(matrix))
    ]
    sims = [
        SimulationRun(
            id=f"{i}-{j}",
            task_id=str(i),
            start_time="",
            end_time="",
            duration=0.0,
            termination_reason="agent_stop",
            reward_info=RewardInfo(reward=r),
            agent_cost=0.0,
            messages=[],
            trial=j,
        )
        for i, row in enumerate(matrix)
        for j, r in enumerate(row)
    ]
    info = {
        "git_commit": "",
        "num_trials": max(len(r) for r in matrix),
        "max_steps": 1,
        "max_errors": 1,
        "user_info": {"implementation": "u"},
        "agent_info": {"implementation": "a"},
        "environment_info": {"domain_name": "retail", "policy": ""},
    }
    return Results(info=info, tasks=tasks, simulations=sims)


@pytest.mark.parametrize("seed", range(8))
def test_summary_equals_tau2_compute_metrics_on_random_matrices(seed):
    from loguru import logger
    from tau2.metrics.agent_metrics import compute_metrics

    logger.disable("tau2")
    rng = random.Random(seed)
    n_tasks, n_trials = rng.randint(1, 12), rng.randint(1, 5)
    p = rng.random()
    # rewards near, at and away from 1.0 so that the success tolerance is exercised too
    choices = [1.0, 1.0 - 1e-7, 1.0 + 1e-7, 1.0 - 1e-4, 0.0, 0.5]
    matrix = [
        [rng.choice(choices[:3]) if rng.random() < p else rng.choice(choices[3:]) for _ in range(n_trials)]
        for _ in range(n_tasks)
    ]
    if seed % 3 == 0 and n_tasks > 1 and n_trials > 1:
        matrix[0] = matrix[0][:-1]  # one task short of trials: τ² then caps k at the smallest count

    ours = summarize([_traj(str(i), r, j) for i, row in enumerate(matrix) for j, r in enumerate(row)], ks=range(1, 6))
    theirs = compute_metrics(_tau2_results(matrix))
    assert ours["mean_reward"] == pytest.approx(theirs.avg_reward, abs=1e-12)
    assert {int(k) for k in ours["pass_hat_k"]} == set(theirs.pass_hat_ks)
    for k, v in theirs.pass_hat_ks.items():
        assert ours["pass_hat_k"][str(k)] == pytest.approx(v, abs=1e-12)


def test_math_comb_matches_closed_form():
    # a guard that the definition is the unbiased estimator of the paper: C(c,k)/C(n,k) == prod (c-i)/(n-i)
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                prod = math.prod((c - i) / (n - i) for i in range(k))
                assert pass_hat_k(n, c, k) == pytest.approx(prod)
