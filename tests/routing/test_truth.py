"""The routing ground truth's rule (trace_core/routing/truth.py): which adapter a task needed, from labels."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd

from trace_core.routing.truth import AMBIGUOUS, ground_truth, labels_lacking, routing_label

CAPS = ["tool_call_precision", "identification"]


def test_routing_label_needs_success_or_exactly_one_routed_capability_lacking():
    assert routing_label(["identification"], True, CAPS) is None  # solved: no adapter, whatever was labelled
    assert routing_label(["identification", "other_skill"], False, CAPS) == "identification"
    assert routing_label(CAPS, False, CAPS) == AMBIGUOUS
    assert routing_label([], False, CAPS) == AMBIGUOUS
    assert routing_label(["other_skill"], False, CAPS) == AMBIGUOUS


def test_labels_lacking_takes_the_majority_of_a_labellers_runs():
    rows = [
        # t1: programmatic says identification; a 3-run labeller says precision in 2 of 3 runs.
        ("t1", "i1", False, "identification", "LACKING"),
        ("t1", "i1", False, "tool_call_precision", "LACKING"),
        ("t1", "i1", False, "tool_call_precision", "LACKING"),
        ("t1", "i1", False, "tool_call_precision", "PRESENT"),
        # t2: one of two runs only: not lacking.
        ("t2", "i2", False, "identification", "LACKING"),
        ("t2", "i2", False, "identification", "PRESENT"),
        ("t3", "i3", True, "identification", "NA"),
        ("t4", "i4", False, "not_routed", "LACKING"),
    ]
    frame = pd.DataFrame(rows, columns=["trajectory_id", "instance_id", "success", "capability_id", "label"])
    got = labels_lacking(frame, CAPS)
    assert got == {"t1": ("i1", False, {"identification", "tool_call_precision"}), "t2": ("i2", False, set()),
                   "t3": ("i3", True, set()), "t4": ("i4", False, set())}
    # Tables without trajectory ids key by instance.
    assert set(labels_lacking(frame.drop(columns="trajectory_id"), CAPS)) == {"i1", "i2", "i3", "i4"}


def test_ground_truth_judges_each_instances_first_trial():
    verdicts = {"a": {"identification": ("LACKING", ""), "tool_call_precision": ("PRESENT", "")},
                "b": {"identification": ("LACKING", ""), "tool_call_precision": ("LACKING", "")},
                "c": {"identification": ("NA", ""), "tool_call_precision": ("PRESENT", "")}}

    class Labeller:
        def judge(self, trajectory, instance):
            assert instance.instance_id == trajectory.instance_id
            return verdicts[trajectory.instance_id]

    def t(iid: str, trial: int, success: bool):
        return SimpleNamespace(instance_id=iid, trial=trial, success=success)

    instances = [SimpleNamespace(instance_id=i) for i in "abc"]
    trajectories = [t("a", 1, True), t("a", 0, False), t("b", 0, False), t("c", 0, True)]
    assert ground_truth(trajectories, instances, CAPS, Labeller()) == {"a": "identification", "b": AMBIGUOUS,
                                                                        "c": None}
