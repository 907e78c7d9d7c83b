"""The study's power calculation (issue #31): exact sign-test power under the paired flip model."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from trace_core.evaluation.power import minimum_detectable_difference, sign_test_power


def test_no_difference_is_rejected_at_most_alpha_of_the_time():
    # gain and regress balanced so that p01 == p10: the exact (conservative) test's size stays below alpha.
    for n in (20, 80, 200):
        assert sign_test_power(n, p0=0.5, gain=0.2, regress=0.2, alpha=0.05) <= 0.05


def test_exact_power_matches_a_simulation_of_the_sign_test():
    n, p0, gain, regress = 60, 0.3, 0.35, 0.05
    rng = np.random.default_rng(0)
    base = rng.random((3000, n)) < p0
    flip = rng.random((3000, n))
    method = np.where(base, flip >= regress, flip < gain)
    rejected = 0
    for b, m in zip(base, method):
        wins, losses = int((m & ~b).sum()), int((b & ~m).sum())
        if wins + losses and stats.binomtest(wins, wins + losses, 0.5).pvalue < 0.05:
            rejected += 1
    exact = sign_test_power(n, p0, gain, regress, 0.05)
    assert abs(rejected / 3000 - exact) < 0.03, (rejected / 3000, exact)


def test_the_mde_reaches_the_power_and_shrinks_with_n():
    small = minimum_detectable_difference(100, p0=0.25, regress=0.06, alpha=0.05, power=0.8)
    big = minimum_detectable_difference(400, p0=0.25, regress=0.06, alpha=0.05, power=0.8)
    assert small.power >= 0.8 and big.power >= 0.8
    assert sign_test_power(100, 0.25, small.gain - 0.01, 0.06, 0.05) < 0.8  # the smallest such gain
    assert 0 < big.mde < small.mde
    assert small.mde == pytest.approx(0.75 * small.gain - 0.25 * 0.06)


def test_an_undetectable_difference_is_nan_not_a_number_that_looks_real():
    assert np.isnan(minimum_detectable_difference(5, p0=0.5, regress=0.0, alpha=0.05, power=0.8).mde)
    assert np.isnan(minimum_detectable_difference(50, p0=1.0, regress=0.0, alpha=0.05, power=0.8).mde)


def test_inputs_outside_their_range_are_refused_by_name():
    with pytest.raises(ValueError, match="gain"):
        sign_test_power(10, 0.5, 1.5, 0.0, 0.05)
    with pytest.raises(ValueError, match="n must be"):
        sign_test_power(0, 0.5, 0.5, 0.0, 0.05)


def test_the_script_reads_a_baseline_metrics_file_and_writes_the_chosen_size(tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("power_script", Path(__file__).parents[2] / "scripts" / "power.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    families = {f: {"pass_hat_1": p, "n_tasks": 24, "n": 24, "mean_reward": p} for f, p in
                [("a", 0.5), ("b", 0.25), ("c", 0.0), ("d", 0.0), ("e", 0.25)]}
    (tmp_path / "metrics.json").write_text(json.dumps({"families": families}))
    out = tmp_path / "power.json"
    assert script.main(["--baseline", str(tmp_path / "metrics.json"), "--per-family", "24,40,64",
                        "--out", str(out)]) == 0
    chosen = json.loads(out.read_text())
    assert chosen["instances"] >= 200 and chosen["mde"] <= 0.08
    assert chosen["base_success"] == {"a": 0.5, "b": 0.25, "c": 0.0, "d": 0.0, "e": 0.25}
