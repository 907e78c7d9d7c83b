"""Stage evaluation's statistics: pass^k with bootstrap intervals, per-family rows, paired comparisons with the
sign test, the coverage check and the results table — on hand-computed cases."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from trace_core.evaluation.stats import (
    CoverageError,
    check_coverage,
    evaluate,
    method_scores,
    paired_comparison,
    results_table,
    score,
    sign_test_p,
    table_rows,
)
from trace_core.metrics import pass_k, summarize
from trace_core.schemas import Trajectory
from trace_core.training.evaluation import wilson_interval
from tests.defaults import PARAMS

# The bootstrap settings the evaluation stage passes from params.yaml (evaluation.ci, seed)
STATS = {"level": PARAMS.evaluation.ci, "seed": PARAMS.seed}

FAMILY = {"a1": "airline", "a2": "airline", "r1": "retail", "r2": "retail"}


def _traj(instance: str, trial: int, reward: float, family: str | None = None, success: bool | None = None):
    return Trajectory(trajectory_id=f"{instance}#{trial}", instance_id=instance, domain="retail",
                      family=family or FAMILY[instance], source="tau2", trial=trial, messages=[],
                      termination_reason="agent_stop", reward=reward,
                      success=(reward == 1.0) if success is None else success)


def _method(outcomes: dict[str, list[int]]) -> list[Trajectory]:
    """Trajectories from instance -> [1/0 per trial]."""
    return [_traj(i, k, float(s)) for i, trials in outcomes.items() for k, s in enumerate(trials)]


# base solves 3 of 8 episodes; trace 6 of 8; instance r2 is solved by base only (one regression)
BASE = {"a1": [1, 0], "a2": [0, 0], "r1": [1, 0], "r2": [1, 0]}
TRACE = {"a1": [1, 1], "a2": [1, 1], "r1": [1, 1], "r2": [0, 0]}


def test_pass_hat_k_hand_values_and_metrics_agree():
    s = method_scores(_method(BASE), samples=200, **STATS)
    # pass^1 = mean(1/2, 0, 1/2, 1/2) = 0.375; pass^2 = mean(C(c,2)/C(2,2)) = 0
    assert s["pass_hat_k"]["1"]["value"] == 0.375 and s["pass_hat_k"]["2"]["value"] == 0.0
    assert s["families"]["airline"]["value"] == 0.25 and s["families"]["retail"]["value"] == 0.5
    trace = method_scores(_method(TRACE), samples=200, **STATS)
    assert trace["pass_hat_k"]["1"]["value"] == 0.75 and trace["pass_hat_k"]["2"]["value"] == 0.75
    summary = summarize(_method(TRACE))  # the project's reference implementation of τ²'s definitions
    assert trace["pass_hat_k"]["2"]["value"] == pytest.approx(summary["pass_hat_k"]["2"])
    assert trace["families"]["retail"]["value"] == pytest.approx(summary["families"]["retail"]["pass_hat_1"])
    assert s["mean_reward"] == 0.375


def test_bootstrap_interval_contains_the_value_is_seeded_and_narrows_with_the_level():
    counts = [(1, 1)] * 12 + [(1, 0)] * 18
    wide = score(counts, 1, samples=500, level=0.95, seed=1)
    narrow = score(counts, 1, samples=500, level=0.5, seed=1)
    assert wide["value"] == 0.4 and wide["instances"] == 30
    assert wide["ci"][0] < 0.4 < wide["ci"][1]
    assert wide["ci"][0] < narrow["ci"][0] <= narrow["ci"][1] < wide["ci"][1]
    assert score(counts, 1, samples=500, level=0.95, seed=1) == wide
    assert score(counts, 1, samples=500, level=0.95, seed=2)["ci"] != wide["ci"]  # the seed is used, not ignored
    with pytest.raises(ValueError, match="level"):
        score(counts, 1, samples=500, level=95, seed=1)


def test_wilson_interval_only_with_one_trial_per_instance():
    one = score([(1, 0)] * 12, 1, samples=100, **STATS)
    assert one["ci"] == [0.0, 0.0]  # every resample of 0/12 is 0: why Wilson is reported as well
    assert one["wilson_ci"] == [0.0, round(wilson_interval(0, 12)[1], 4)]
    assert "wilson_ci" not in score([(2, 1)] * 5, 1, samples=100, **STATS)
    with pytest.raises(ValueError, match="less than k"):
        score([(1, 1)] * 5, k=2, samples=100, **STATS)


def test_ks_above_the_trials_are_refused_with_a_fix():
    with pytest.raises(ValueError, match="evaluation.trials"):
        method_scores(_method(BASE), ks=[1, 3], samples=50, **STATS)


def test_sign_test_hand_values_and_brute_force():
    assert sign_test_p(0, 0) == 1.0
    assert sign_test_p(5, 0) == pytest.approx(2 / 32)
    assert sign_test_p(3, 1) == pytest.approx(2 * 5 / 16)
    assert sign_test_p(2, 2) == 1.0
    for improved, regressed in [(7, 2), (1, 9), (4, 6)]:
        n = improved + regressed
        observed = abs(improved - regressed)
        extreme = sum(1 for signs in itertools.product((1, -1), repeat=n) if abs(sum(signs)) >= observed)
        assert sign_test_p(improved, regressed) == pytest.approx(extreme / 2**n)
    with pytest.raises(ValueError):
        sign_test_p(-1, 2)


def test_paired_comparison_hand_case():
    c = paired_comparison(_method(TRACE), _method(BASE), samples=300, **STATS)
    # per-instance differences: a1 +0.5, a2 +1, r1 +0.5, r2 -0.5 -> mean 0.375
    assert c["difference"] == 0.375
    assert (c["improved"], c["regressed"], c["ties"], c["instances"]) == (3, 1, 0, 4)
    assert c["sign_test_p"] == pytest.approx(0.625)
    assert -0.5 <= c["ci"][0] <= 0.375 <= c["ci"][1] <= 1.0
    same = paired_comparison(_method(BASE), _method(BASE), samples=100, **STATS)
    assert same["difference"] == 0.0 and same["ci"] == [0.0, 0.0] and same["sign_test_p"] == 1.0


def test_coverage_names_what_is_missing_duplicated_or_inconsistent():
    base = _method(BASE)
    assert check_coverage({"base": base, "trace": _method(TRACE)}) == {
        "instances": 4, "trials": 2, "families": {"airline": 2, "retail": 2}}
    with pytest.raises(CoverageError, match=r"'trace' is missing 1 of 8 \(instance, trial\) pairs: r2#1"):
        check_coverage({"base": base, "trace": _method(TRACE)[:-1]})
    with pytest.raises(CoverageError, match=r"'trace' is missing 2 of 10.*x1#0, x1#1"):
        check_coverage({"base": base + [_traj("x1", 0, 1, "retail"), _traj("x1", 1, 0, "retail")],
                        "trace": _method(TRACE)})
    with pytest.raises(CoverageError, match="duplicate.*a1#0"):
        check_coverage({"base": base + [_traj("a1", 0, 1.0)]})
    with pytest.raises(CoverageError, match="'r2' is family 'retail' in one trajectory and 'airline'"):
        check_coverage({"base": base, "trace": _method(TRACE)[:-1] + [_traj("r2", 1, 0.0, "airline")]})
    with pytest.raises(CoverageError, match="'gepa' has no trajectories"):
        check_coverage({"base": base, "gepa": []})
    with pytest.raises(CoverageError, match="no methods"):
        check_coverage({})


def _results():
    return {"base": _method(BASE), "trace": _method(TRACE), "oracle": _method({i: [1, 1] for i in FAMILY})}


def test_evaluate_is_json_ready_deterministic_and_ordered():
    kwargs = {"budgets": {"trace": 1200, "oracle": None}, "labels": {"trace": "TRACE (routed)"}, "samples": 200,
              "seed": 3}
    first = evaluate(_results(), **{**STATS, **kwargs})
    assert json.loads(json.dumps(first)) == first
    assert evaluate(_results(), **{**STATS, **kwargs}) == first
    assert list(first["methods"]) == ["base", "trace", "oracle"]
    assert first["ks"] == [1, 2] and first["instances"] == 4 and first["trials"] == 2 and first["warnings"] == []
    trace = first["methods"]["trace"]
    assert trace["label"] == "TRACE (routed)" and trace["budget"] == 1200
    assert first["methods"]["base"]["vs_reference"] is None and first["methods"]["base"]["label"] == "base"
    assert trace["vs_reference"]["difference"] == 0.375
    assert first["methods"]["oracle"]["vs_reference"]["regressed"] == 0
    for m in first["methods"].values():  # every number rounded to 4 decimals
        for s in [*m["pass_hat_k"].values(), *m["families"].values()]:
            assert all(round(x, 4) == x for x in [s["value"], *s["ci"]])


def test_evaluate_reference_and_warnings():
    with pytest.raises(ValueError, match="reference=None"):
        evaluate({"trace": _method(TRACE)}, samples=50, **STATS)
    alone = evaluate({"trace": _method(TRACE)}, reference=None, samples=50, **STATS)
    assert alone["methods"]["trace"]["vs_reference"] is None
    flagged = _method(BASE)
    flagged[1] = _traj("a1", 1, 0.0, success=True)
    s = evaluate({"base": flagged, "x": _method(TRACE)}, budgets={"ghost": 3}, samples=50, **STATS)
    assert any("ghost" in w for w in s["warnings"])
    assert any(w.startswith("base: 1 trajectories have a success flag") for w in s["warnings"])
    assert s["methods"]["base"]["pass_hat_k"]["1"]["value"] == 0.375  # the reward decides, as in metrics


def test_results_table_layout():
    s = evaluate(_results(), budgets={"trace": 1200}, labels={"trace": "TRACE"}, samples=200, **STATS)
    table = results_table(s)
    lines = table.splitlines()
    assert lines[0] == ("| method | training rollouts | airline | retail | overall pass^1 | pass^2 | Δ vs base (pts) "
                        "| sign test p |")
    assert lines[2].startswith("| base | — | 25.0 [") and lines[2].endswith("| — | — |")
    trace = lines[3].split(" | ")
    assert trace[0] == "| TRACE" and trace[1] == "1,200" and trace[4].startswith("75.0 [")
    assert trace[6].startswith("+37.5 [") and trace[7] == "0.625 |"
    assert "95% percentile bootstrap" in table and "sign test" in table
    rows = table_rows(s)
    assert [r["method"] for r in rows] == ["base", "trace", "oracle"] and rows[0]["reference"] is True
    assert rows[1]["pass_k"]["2"]["value"] == 0.75 and rows[1]["delta"]["value"] == 0.375

    one_trial = {m: [t for t in ts if t.trial == 0] for m, ts in _results().items()}
    header = results_table(evaluate(one_trial, reference=None, samples=50, **STATS)).splitlines()[0]
    assert "pass^2" not in header and "Δ" not in header and header.endswith("| overall pass^1 |")


def test_pass_k_value_matches_metrics_on_a_random_grid():
    import random

    rng = random.Random(7)
    outcomes = {f"i{j}": [rng.random() < 0.4 for _ in range(4)] for j in range(25)}
    trajs = [_traj(i, k, float(s), "f") for i, ts in outcomes.items() for k, s in enumerate(ts)]
    s = method_scores(trajs, samples=100, **STATS)
    for k in (1, 2, 3, 4):
        expected = pass_k([(4, sum(ts)) for ts in outcomes.values()], k)
        assert s["pass_hat_k"][str(k)]["value"] == round(expected, 4)
        assert math.isclose(s["pass_hat_k"][str(k)]["value"], expected, abs_tol=5e-5)


def test_graded_reward_gets_mean_similarity_and_perfect_count_with_intervals():
    # ToolSandbox: rewards are similarities in [0, 1]; one trial per instance. base: 0.5, 1.0, 0.0, 0.25 (1 perfect);
    # trace: 1.0, 1.0, 0.5, 0.25 (2 perfect).
    base = [_traj(i, 0, r) for i, r in zip(FAMILY, (0.5, 1.0, 0.0, 0.25))]
    trace = [_traj(i, 0, r) for i, r in zip(FAMILY, (1.0, 1.0, 0.5, 0.25))]
    s = evaluate({"base": base, "trace": trace}, samples=400, level=PARAMS.evaluation.ci, seed=1, graded=True)
    assert s["graded"] is True
    b, t = s["methods"]["base"], s["methods"]["trace"]
    assert b["similarity"]["value"] == 0.4375 and t["similarity"]["value"] == 0.6875
    assert b["similarity"]["instances"] == 4
    lo, hi = t["similarity"]["ci"]
    assert 0.25 <= lo <= 0.6875 <= hi <= 1.0
    assert b["perfect"] == {"count": 1, "episodes": 4, "ci": b["perfect"]["ci"]}
    assert t["perfect"]["count"] == 2 and t["perfect"]["episodes"] == 4
    p_lo, p_hi = t["perfect"]["ci"]
    assert 0 <= p_lo <= 2 <= p_hi <= 4
    # The count's interval is pass^1's, in episodes.
    assert t["perfect"]["ci"] == [round(x * 4, 2) for x in t["pass_hat_k"]["1"]["ci"]]
    assert b["similarity_vs_reference"] is None
    assert t["similarity_vs_reference"]["difference"] == 0.25
    assert t["similarity_vs_reference"]["ci"][0] <= 0.25 <= t["similarity_vs_reference"]["ci"][1]

    table = results_table(s)
    header = table.splitlines()[0]
    assert header.startswith("| method | training rollouts | mean similarity | perfect | Δ similarity vs base |")
    trace_row = table.splitlines()[3].split(" | ")
    assert trace_row[2].startswith("0.688 [") and trace_row[3].startswith("2 / 4 [")
    assert trace_row[4].startswith("+0.250 [")
    assert "mean similarity = the mean graded reward" in table
    # A pass/fail target's summary and table are as before.
    plain = evaluate({"base": base, "trace": trace}, samples=400, level=PARAMS.evaluation.ci, seed=1)
    assert "graded" not in plain and "similarity" not in plain["methods"]["trace"]
    assert "mean similarity" not in results_table(plain)
