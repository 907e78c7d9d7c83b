"""The held-out comparison's statistics: Wilson intervals, the paired bootstrap, the report of paired episodes."""

from __future__ import annotations

import pytest

from trace_core.schemas import Trajectory
from trace_core.training.evaluation import compare, paired_bootstrap_interval, wilson_interval
from tests.defaults import PARAMS

# The intervals the training stage asks for (params.yaml evaluation.bootstrap_samples, evaluation.ci)
INTERVALS = {"samples": PARAMS.evaluation.bootstrap_samples, "level": PARAMS.evaluation.ci}


def test_wilson_interval_known_values():
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson_interval(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="within"):
        wilson_interval(3, 2)


def test_paired_bootstrap_interval():
    assert paired_bootstrap_interval([1.0] * 8, **INTERVALS, seed=0) == (1.0, 1.0)
    low, high = paired_bootstrap_interval([1.0, 0.0, 0.0, -1.0, 1.0, 0.0, 1.0, 0.0], **INTERVALS, seed=0)
    assert -1 < low < 0.25 < high < 1
    again = [paired_bootstrap_interval([1.0, 0.0, -1.0], **INTERVALS, seed=3) for _ in range(2)]
    assert again[0] == again[1]
    with pytest.raises(ValueError):
        paired_bootstrap_interval([], **INTERVALS, seed=0)


def _episode(seed: int, reward: float) -> Trajectory:
    return Trajectory(trajectory_id=f"t{seed}", instance_id=f"i{seed}", domain="retail", family="f", source="synthetic",
                      messages=[], termination_reason="agent_stop", reward=reward, success=reward == 1.0)


def test_compare_pairs_episodes_by_seed():
    seeds = [10, 11, 12, 13]
    base = [_episode(s, r) for s, r in zip(seeds, [1.0, 0.0, 0.0, 0.5])]
    adapter = [_episode(s, r) for s, r in zip(seeds, [1.0, 1.0, 1.0, 0.0])]
    report = compare(seeds, base, adapter, **INTERVALS, seed=0)
    assert report["base"]["success_rate"] == 0.25 and report["adapter"]["success_rate"] == 0.75
    assert report["base"]["mean_reward"] == 0.375
    assert report["difference"]["success_rate"] == 0.5
    assert (report["difference"]["improved"], report["difference"]["regressed"]) == (2, 0)
    assert report["per_seed"][1] == {"seed": 11, "base_reward": 0.0, "adapter_reward": 1.0, "base_success": False,
                                     "adapter_success": True}
    with pytest.raises(ValueError, match="one base and one adapter"):
        compare(seeds, base, adapter[:3], **INTERVALS, seed=0)
    # The confidence level is the caller's (params evaluation.ci): a 50% report is narrower on both sides.
    half = compare(seeds, base, adapter, samples=PARAMS.evaluation.bootstrap_samples, level=0.5, seed=0)
    for key in ("base", "adapter"):
        assert half[key]["success_ci"][1] - half[key]["success_ci"][0] < report[key]["success_ci"][1] - \
            report[key]["success_ci"][0]
    assert half["difference"]["ci"][1] - half["difference"]["ci"][0] < report["difference"]["ci"][1] - \
        report["difference"]["ci"][0]
    assert half["difference"]["method"].endswith("50%") and report["difference"]["method"].endswith("95%")
