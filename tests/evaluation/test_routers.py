"""The routing section of stage evaluation (trace_core/evaluation/routers.py) on fake decisions and episodes."""

from __future__ import annotations

import csv
from types import SimpleNamespace

from trace_core.evaluation.routers import CSV_COLUMNS, markdown, notes, router_report, write_csv
from trace_core.routing.truth import AMBIGUOUS
from trace_core.schemas import RouteDecision, RoutingDecisions, RoutingSet

CAPS = ["tool_call_precision", "identification"]
INSTANCES = ["i0", "i1", "i2", "i3", "i4"]
FAMILY = {"i0": "single_write", "i1": "single_write", "i2": "identify_then_act", "i3": "identify_then_act",
          "i4": "compound"}
# Ground truth: i0 precision, i1 no adapter, i2 identification, i3 ambiguous (not scored), i4 no adapter.
TRUTH = {"i0": "tool_call_precision", "i1": None, "i2": "identification", "i3": AMBIGUOUS, "i4": None}


def _set(scoring: str, chosen: dict[str, str | None], distractors: list[str | None]) -> RoutingSet:
    routes = [RouteDecision(instance_id=i, family=FAMILY[i], probabilities={}, chosen=[c] if c else [],
                            weights={c: 1.0} if c else {}) for i, c in chosen.items()]
    return RoutingSet(adapters=CAPS, rollouts=4, options=[], scoring=scoring, routes=routes,
                      accuracy={"accuracy": 0.5}, distractors=distractors,
                      distractors_to_base=sum(d is None for d in distractors) / len(distractors))


def _decisions() -> RoutingDecisions:
    label = _set("label", dict.fromkeys(INSTANCES), [None] * 10)  # everything to the base model
    gate = _set("gate", {"i0": "tool_call_precision", "i1": None, "i2": "identification", "i3": "identification",
                         "i4": "identification"}, [None] * 9 + ["identification"])
    return RoutingDecisions(run_key="k", router={}, adapters=dict.fromkeys(CAPS, "sha"), instances=INSTANCES,
                            family_capability={"single_write": "tool_call_precision",
                                               "identify_then_act": "identification", "compound": None},
                            full=gate, routers={"label": label, "gate": gate})


def _episodes(successes: list[bool]) -> list:
    return [SimpleNamespace(instance_id=i, trial=0, success=s) for i, s in zip(INSTANCES, successes)]


def test_every_router_is_scored_against_the_ground_truth_with_its_confusion(tmp_path):
    results = {"base": _episodes([0, 1, 0, 0, 1]), "trace": _episodes([1, 1, 1, 0, 1]),
               "trace_label": _episodes([0, 1, 0, 0, 1]), "oracle": _episodes([1, 1, 1, 1, 1])}
    calls = []

    def comparison(method, reference):
        calls.append((method, reference))
        return {"difference": -0.2, "ci": [-0.6, 0.0]}

    report = router_report(_decisions(), TRUTH, results, "gate", comparison)
    assert report["ground_truth"] == {"instances": 5, "scored": 4, "ambiguous": 1,
                                      "classes": {"tool_call_precision": 1, "identification": 1, "none": 2}}
    gate, label = report["routers"]["gate"], report["routers"]["label"]
    assert gate["method"] == "trace" and label["method"] == "trace_label"  # the main scoring plays as trace
    assert gate["vs_ground_truth"]["accuracy"] == 0.75 and label["vs_ground_truth"]["accuracy"] == 0.5
    assert gate["vs_ground_truth"]["chance_majority"] == 0.5
    assert gate["vs_ground_truth"]["confusion"]["none"] == {"tool_call_precision": 0, "identification": 1,
                                                            "none": 1}
    assert gate["vs_ground_truth"]["per_label_recall"] == {"tool_call_precision": 1.0, "identification": 1.0,
                                                           "none": 0.5}
    assert gate["distractors_to_base"] == 0.9 and label["distractors_to_base"] == 1.0
    assert gate["trace_success"] == 0.8 and label["trace_success"] == 0.4 and gate["oracle_success"] == 1.0
    assert sorted(calls) == [("trace", "oracle"), ("trace_label", "oracle")]
    # The family map of analysis is scored against the same truth: i0, i1 (single_write -> precision), i2, i4.
    assert report["family_map"]["accuracy"] == 0.75

    write_csv(tmp_path / "routing.csv", report)
    rows = list(csv.DictReader((tmp_path / "routing.csv").open()))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert [r["router"] for r in rows] == ["label", "gate"]
    assert rows[1] == {"router": "gate", "instances": "4", "accuracy": "0.75", "majority_baseline": "0.5",
                       "distractors_to_base": "0.9", "trace_success": "0.8", "oracle_success": "1.0"}
    table = markdown(report)
    assert "| gate | 75% (n=4) | 50% |" in table and "Confusion of label" in table and "1 ambiguous" in table
    assert any(line.startswith("Router gate: 75% of 4") for line in notes(report))


def test_no_ground_truth_leaves_the_accuracy_cells_empty(tmp_path):
    results = {"trace": _episodes([1, 1, 1, 0, 1]), "oracle": _episodes([1, 1, 1, 1, 1])}
    report = router_report(_decisions(), {i: AMBIGUOUS for i in INSTANCES}, results, "gate",
                           lambda m, r: {"difference": -0.2, "ci": [-0.6, 0.0]})
    assert report["ground_truth"]["scored"] == 0 and report["family_map"] is None
    assert report["routers"]["gate"]["vs_ground_truth"] is None and notes(report) == []
    assert report["routers"]["gate"]["trace_success"] == 0.8
    assert "| gate | - (n=0) | - |" in markdown(report) and "Confusion" not in markdown(report)
    write_csv(tmp_path / "routing.csv", report)
    assert (tmp_path / "routing.csv").read_text().splitlines() == [
        ",".join(CSV_COLUMNS), "label,0,,,1.0,,1.0", "gate,0,,,0.9,0.8,1.0"]
    write_csv(tmp_path / "none.csv", {"routers": {}})
    assert (tmp_path / "none.csv").read_text() == ",".join(CSV_COLUMNS) + "\n"
