"""docs/method.md §1 statistics and selection, checked against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from trace_core.analysis.base import Item, LabelSet, compact_trajectory, slugify, unique_id
from trace_core.analysis.controls import ControlLabeller
from trace_core.analysis.stage import build_dictionary
from trace_core.analysis.stats import Thresholds, agreement, capability_stats
from trace_core.schemas import CapabilitySpec, LabelRow, Message, ToolCall, Trajectory
from tests.defaults import PARAMS

EXAMPLES = PARAMS.analysis.max_examples  # example task ids kept per capability (params.yaml)

TH = Thresholds(rho=0.10, delta=0.20, k=8, n=10, bootstrap_samples=300, ci=PARAMS.analysis.ci)
N, P, L = 0, 1, 2


def test_one_run_by_hand():
    # 6 failures: 3 LACKING, 1 PRESENT, 2 NA. 4 successes: 1 LACKING, 3 PRESENT.
    labels = np.array([[L, L, L, P, N, N, L, P, P, P]])
    success = np.array([False] * 6 + [True] * 4)
    s = capability_stats(labels, success, TH, seed=0)
    assert s.er_minus_mean == pytest.approx(3 / 4)
    assert s.er_plus_mean == pytest.approx(1 / 4)
    assert s.delta_mean == pytest.approx(0.5)
    assert s.coverage_mean == pytest.approx(3 / 6)
    assert (s.lacking_failed, s.present_failed, s.lacking_passed, s.present_passed) == (3, 1, 1, 3)
    assert s.runs_passed == 1 and s.runs_required == 1
    assert s.delta_ci[0] <= 0.5 <= s.delta_ci[1] and s.coverage_ci[0] <= 0.5 <= s.coverage_ci[1]
    assert s.agreement is None and s.kappa is None


def test_empty_denominators_are_zero():
    labels = np.array([[N, N, N, N]])
    s = capability_stats(labels, np.array([False, False, True, True]), TH, seed=0)
    assert (s.er_minus_mean, s.er_plus_mean, s.delta_mean, s.coverage_mean) == (0, 0, 0, 0)
    s = capability_stats(np.array([[L, L]]), np.array([True, True]), TH, seed=0)  # no failures at all
    assert s.coverage_mean == 0 and s.er_plus_mean == 1 and s.delta_mean == -1


@pytest.mark.parametrize("passing_runs,selected", [(7, False), (8, True), (10, True)])
def test_k_of_n(passing_runs, selected):
    success = np.array([False] * 10 + [True] * 10)
    good = [L] * 5 + [P] * 5 + [P] * 10  # coverage 0.5, delta 0.5
    bad = [L] * 5 + [P] * 5 + [L] * 5 + [P] * 5  # delta 0
    labels = np.array([good] * passing_runs + [bad] * (10 - passing_runs))
    s = capability_stats(labels, success, TH, seed=0)
    assert s.runs_passed == passing_runs
    assert (s.runs_passed >= s.runs_required) is selected
    assert s.delta_std > 0 or passing_runs == 10


def test_thresholds_are_inclusive_and_k_scales_with_runs():
    success = np.array([False] * 10 + [True] * 10)
    # coverage exactly 0.1, delta exactly 0.2 (ER- = 1/1? no: 1 lacking of 5 judged failures -> 0.2, ER+ = 0)
    labels = np.array([[L, P, P, P, P, N, N, N, N, N] + [P] * 10])
    s = capability_stats(labels, success, TH, seed=0)
    assert s.coverage_mean == pytest.approx(0.1) and s.delta_mean == pytest.approx(0.2) and s.runs_passed == 1
    assert [TH.runs_required(r) for r in (1, 3, 5, 10)] == [1, 3, 4, 8]


def test_agreement_and_kappa():
    same = np.array([[L, P, N, L]] * 3)
    assert agreement(same) == (1.0, 1.0)
    mixed = np.array([[L, P, N, L], [P, L, N, P]])
    pairwise, kappa = agreement(mixed)
    assert pairwise == 0.25 and kappa < 0
    assert agreement(np.array([[L, L], [L, L]])) == (1.0, None)


def _traj(i: int, success: bool) -> Trajectory:
    return Trajectory(
        trajectory_id=f"t{i}", instance_id=f"task{i}", domain="retail", family="f", source="procedural",
        messages=[Message(role="user", content="hi"), Message(role="assistant", content="ok")],
        termination_reason="agent_stop", success=success,
    )


def _rows(cid, labels, items, runs=1):
    return [
        LabelRow(run=r, trajectory_id=it.trajectory.trajectory_id, instance_id=it.task_id, success=it.trajectory.success,
                 capability_id=cid, label=lab, labeller="llm")
        for r in range(runs) for it, lab in zip(items, labels)
    ]


def test_dictionary_mints_unique_ids_sorts_and_flags_controls():
    items = [Item(_traj(i, i >= 6)) for i in range(12)]
    strong = ["LACKING"] * 6 + ["PRESENT"] * 6
    weak = ["LACKING"] * 2 + ["PRESENT"] * 4 + ["PRESENT"] * 6
    spec = lambda cid: CapabilitySpec(capability_id=cid, name=cid, definition="d", labeller="llm")
    a = LabelSet([spec("skill"), spec("other")], _rows("skill", strong, items, 10) + _rows("other", weak, items, 10), runs=10)
    b = LabelSet([spec("skill")], _rows("skill", weak, items, 10), runs=10)  # same slug from another labeller
    d, table = build_dictionary(items, [a, b, ControlLabeller(10, 0).label(items)], TH, EXAMPLES, within_family=False)
    ids = [c.capability_id for c in d.capabilities]
    assert d.selected == ["skill", "other", "skill_2"]  # by mean delta, ties by id
    assert ids[:3] == d.selected  # selected first
    assert {"control_random", "control_uniform"} <= set(ids) and not any(c.selected for c in d.capabilities if c.control)
    assert d.get("skill").example_failed_task_ids == ["task0", "task1", "task2", "task3"]
    assert {r.capability_id for r in table} == set(ids)
    assert d.target["failed"] == 6 and len(d.target["trajectories_hash"]) == 16
    assert not d.warnings
    again, _ = build_dictionary(items, [a, b, ControlLabeller(10, 0).label(items)], TH, EXAMPLES, within_family=False)
    assert again.model_dump_json() == d.model_dump_json()


def test_too_few_trajectories_let_a_control_pass_and_it_is_reported():
    items = [Item(_traj(i, i >= 1)) for i in range(2)]  # one failure, one success
    spec = CapabilitySpec(capability_id="c", name="c", definition="d", labeller="control", control=True)
    ls = LabelSet([spec], _rows("c", ["LACKING", "PRESENT"], items), runs=1)
    d, _ = build_dictionary(items, [ls], TH, EXAMPLES, within_family=False)
    assert d.selected == [] and any("control capability c passed" in w for w in d.warnings)


def test_one_outcome_warnings():
    items = [Item(_traj(i, False)) for i in range(3)]
    d, _ = build_dictionary(items, [], TH, EXAMPLES, within_family=False)
    assert any("no successful" in w for w in d.warnings)


def test_slugs_and_compaction():
    assert slugify("Tool-calling precision!") == "tool_calling_precision"
    assert slugify("3 step plans") == "c_3_step_plans"
    with pytest.raises(ValueError):
        slugify("!!!")
    taken = {"a"}
    assert unique_id("a", taken) == "a_2" and unique_id("a", taken) == "a_3"
    msgs = [Message(role="user", content="start")]
    for i in range(200):
        msgs.append(Message(role="assistant", tool_calls=[ToolCall(name="get_order_details", arguments={"order_id": f"#W{i}"})]))
    t = _traj(0, False).model_copy(update={"messages": msgs})
    text = compact_trajectory(t, max_chars=1200)
    assert len(text) <= 1200 and "steps omitted" in text and "user: start" in text and "#W199" in text
