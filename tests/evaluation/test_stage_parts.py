"""The evaluation stage's pure parts: held-out checks, the family -> capability map, the oracle, the transfer
matrix and champions, the curve's budget marks, routing groups and the config checks."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from trace_core.config import load_params
from trace_core.evaluation.stage import (
    EvaluationError,
    TrainedAdapter,
    _cached_probabilities,
    _route_groups,
    champions,
    check_held_out,
    curve_marks,
    describe_prompt,
    family_capabilities,
    held_out_instances,
    oracle_choice,
    transfer_matrix,
)
from trace_core.schemas import Message, Trajectory

ROOT = Path(__file__).resolve().parents[2]


def traj(instance_id: str, success: bool, family: str = "f", trial: int = 0, reward: float | None = None) -> Trajectory:
    return Trajectory(
        trajectory_id=f"{instance_id}#{trial}", instance_id=instance_id, domain="retail", family=family,
        source="procedural", trial=trial, messages=[Message(role="user", content="hi")],
        termination_reason="agent_stop", reward=float(success) if reward is None else reward, success=success,
    )


def adapter(cid: str, rollouts: int = 10) -> TrainedAdapter:
    return TrainedAdapter(cid, Path(cid), rollouts, "sha", cid.replace("_", " "), f"does {cid}")


def test_oracle_takes_the_best_candidate_per_instance_without_new_episodes():
    results = {
        "base": [traj("a", True), traj("b", False), traj("c", False)],
        "single:x": [traj("a", False), traj("b", True), traj("c", False, reward=0.5)],
        "single:y": [traj("a", True), traj("b", True), traj("c", False, reward=0.2)],
    }
    trajectories, chosen = oracle_choice(results, ["base", "single:x", "single:y"])
    # a: base and y succeed, base comes first; b: x and y tie, x first; c: nobody succeeds, x has more reward.
    assert chosen == {"a": "base", "b": "single:x", "c": "single:x"}
    assert [t.success for t in trajectories] == [True, True, False]
    assert [t.instance_id for t in trajectories] == ["a", "b", "c"]


def test_oracle_counts_successes_over_trials():
    results = {
        "base": [traj("a", True, trial=0), traj("a", False, trial=1)],
        "single:x": [traj("a", True, trial=0), traj("a", True, trial=1)],
    }
    trajectories, chosen = oracle_choice(results, ["base", "single:x"])
    assert chosen == {"a": "single:x"} and [t.trial for t in trajectories] == [0, 1]


def test_transfer_matrix_and_champions():
    fam = {"f1": "x", "f2": "y", "f3": None}
    results = {
        "base": [traj("a", False, "f1"), traj("b", True, "f2"), traj("c", False, "f3")],
        "single:x": [traj("a", True, "f1"), traj("b", False, "f2"), traj("c", True, "f3")],
        "single:y": [traj("a", True, "f1"), traj("b", True, "f2"), traj("c", False, "f3")],
    }
    transfer = transfer_matrix(results, ["base", "single:x", "single:y"], lambda t: fam[t.family])
    assert transfer["slices"] == ["x", "y"]  # instances of an unmapped family belong to no slice
    assert transfer["success"] == [[0.0, 1.0], [1.0, 0.0], [1.0, 1.0]]
    assert transfer["episodes"] == [[1, 1]] * 3
    # x beats base on its own slice; y only ties on its own (it helps on x's slice, which does not count).
    assert champions(transfer, [adapter("x"), adapter("y")]) == ["x"]


def test_curve_marks_are_cumulative_adapter_costs():
    adapters = [adapter("a", 10), adapter("b", 20), adapter("c", 30), adapter("d", 40)]
    assert curve_marks(adapters, 1) == [100]
    assert curve_marks(adapters, 2) == [30, 100]
    assert curve_marks(adapters, 4) == [10, 30, 60, 100]
    assert curve_marks(adapters, 9) == [10, 30, 60, 100]
    assert curve_marks([], 3) == [] and curve_marks(adapters, 0) == []


def test_route_groups_share_one_switch_per_weight_set():
    from trace_core.envs.procedural import generate_set

    insts = generate_set(["single_write"], 5000, 4, 1)
    rows = [{"weights": {"x": 1.0}}, {"weights": {}}, {"weights": {"x": 1.0}}, {"weights": {"y": 0.6, "x": 0.4}}]
    groups = _route_groups(rows, insts)
    assert [(w, [i.instance_id for i in g]) for w, _, g in groups] == [
        ({"x": 1.0}, [insts[0].instance_id, insts[2].instance_id]),
        ({}, [insts[1].instance_id]),
        ({"x": 0.4, "y": 0.6}, [insts[3].instance_id]),
    ]


def test_saved_router_probabilities_are_reused_only_when_whole(tmp_path):
    path = tmp_path / "routing.json"
    assert _cached_probabilities(path, 2) is None  # missing
    path.write_text(json.dumps([{"A": 0.75, "B": 0.25}, {"A": 0.1, "B": 0.9}]))
    assert _cached_probabilities(path, 2) == [{"A": 0.75, "B": 0.25}, {"A": 0.1, "B": 0.9}]
    assert _cached_probabilities(path, 3) is None  # saved for another number of tasks
    path.write_text(path.read_text()[:-7])  # torn by a kill
    assert _cached_probabilities(path, 2) is None
    path.write_text(json.dumps({"A": 1.0}))
    assert _cached_probabilities(path, 1) is None


def test_describe_prompt_lists_every_capability():
    text = describe_prompt("POLICY", [adapter("look_up_first"), adapter("exact_ids")])
    assert text.startswith("POLICY\n\n")
    assert "- look up first: does look_up_first" in text and "- exact ids: does exact_ids" in text


def _params(tmp_path: Path, **overrides):
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    return load_params(tmp_path / "params.yaml", overrides)


def test_held_out_instances_are_checked_against_the_baseline(tmp_path):
    params = _params(tmp_path, **{"evaluation.instances_per_family": 2, "baseline.out_dir": str(tmp_path / "bl")})
    instances = held_out_instances(params)
    assert len(instances) == 2 * len(params.tasks.families)
    (tmp_path / "bl").mkdir()
    (tmp_path / "bl" / "instances.jsonl").write_text(instances[3].model_dump_json() + "\n")
    with pytest.raises(EvaluationError, match="rolled out by the baseline"):
        check_held_out(instances, params)
    other = held_out_instances(_params(tmp_path, **{"evaluation.seed": 5001, "evaluation.instances_per_family": 2}))
    check_held_out(other, params)  # another seed: no clash


def test_config_rejects_evaluation_seeds_that_are_not_held_out(tmp_path):
    for key in ("baseline.seed", "bootstrap.seed", "evaluation.target_seed"):
        with pytest.raises(ValueError, match=f"equals {key}"):
            _params(tmp_path, **{key: 5000})
    with pytest.raises(ValueError, match="temperature > 0"):
        _params(tmp_path, **{"evaluation.trials": 3})
    with pytest.raises(ValueError, match="top_p"):
        _params(tmp_path, **{"evaluation.router.top_p": 1.0})
    with pytest.raises(ValueError, match="must be label .* or channel"):
        _params(tmp_path, **{"evaluation.router.scoring": "letters"})
    with pytest.raises(ValueError, match="examples=-1 must be >= 0"):
        _params(tmp_path, **{"evaluation.router.examples": -1})
    with pytest.raises(ValueError, match="scoring=label only"):
        _params(tmp_path, **{"evaluation.router.calibrate": True})  # the default scoring is channel
    _params(tmp_path, **{"evaluation.router.calibrate": True, "evaluation.router.scoring": "label"})
    with pytest.raises(ValueError, match="not valid"):
        _params(tmp_path, **{"evaluation.methods": ["base", "magic"]})
    cal = {"synthesis.calibration.enabled": True, "synthesis.calibration.temperature": 1.0}
    with pytest.raises(ValueError, match="set both to the same value"):
        _params(tmp_path, **cal)  # training samples at 0.7 by default
    _params(tmp_path, **cal, **{"training.temperature": 1.0})
    _params(tmp_path, **{"synthesis.calibration.enabled": False,
                         "synthesis.calibration.temperature": 1.0})  # calibration off: not checked


def test_family_map_from_analysis_labels(tmp_path):
    params = _params(tmp_path, **{"analysis.out_dir": str(tmp_path / "an"), "baseline.out_dir": str(tmp_path / "bl")})
    (tmp_path / "an").mkdir()
    (tmp_path / "bl").mkdir()
    family = {"i1": "f1", "i2": "f1", "i3": "f2", "i4": "f3"}
    (tmp_path / "bl" / "instances.jsonl").write_text(
        "".join(json.dumps({"instance_id": i, "family": f}) + "\n" for i, f in family.items())
    )
    rows = [  # (instance, success, capability, label)
        ("i1", False, "x", "LACKING"), ("i2", False, "x", "LACKING"), ("i2", False, "y", "LACKING"),
        ("i3", False, "y", "LACKING"), ("i3", False, "z", "LACKING"), ("i3", False, "z", "LACKING"),
        ("i4", True, "x", "LACKING"), ("i4", False, "x", "PRESENT"),
    ]
    pd.DataFrame(rows, columns=["instance_id", "success", "capability_id", "label"]).to_parquet(
        tmp_path / "an" / "labels.parquet"
    )
    # z is not a trained adapter, so f2 maps to y; f3 has no failed run lacking anything.
    assert family_capabilities(params, ["x", "y"]) == {"f1": "x", "f2": "y", "f3": None}
    assert family_capabilities(params, ["x", "y"], rule="prevalent") == {"f1": "x", "f2": "y", "f3": None}
    with pytest.raises(ValueError, match="rule must be one of"):
        family_capabilities(params, ["x", "y"], rule="most")


def test_family_map_specific_rule_picks_the_deficit_that_sets_a_family_apart(tmp_path):
    """x is lacking in every failed run of both families, y only in f2's: the prevalent rule maps both families to
    x (a constant oracle), the specific rule gives f2 the deficit that distinguishes it."""
    params = _params(tmp_path, **{"analysis.out_dir": str(tmp_path / "an"), "baseline.out_dir": str(tmp_path / "bl")})
    (tmp_path / "an").mkdir()
    (tmp_path / "bl").mkdir()
    family = {"a1": "f1", "a2": "f1", "b1": "f2", "b2": "f2", "b3": "f2"}
    (tmp_path / "bl" / "instances.jsonl").write_text(
        "".join(json.dumps({"instance_id": i, "family": f}) + "\n" for i, f in family.items())
    )
    rows = [(i, False, "x", "LACKING") for i in family]
    rows += [("a1", False, "y", "PRESENT"), ("a2", False, "y", "NA"), ("b1", False, "y", "LACKING"),
             ("b2", False, "y", "LACKING"), ("b3", False, "y", "PRESENT"),
             ("a1", True, "y", "LACKING")]  # a successful run's label never counts
    pd.DataFrame(rows, columns=["instance_id", "success", "capability_id", "label"]).to_parquet(
        tmp_path / "an" / "labels.parquet"
    )
    assert family_capabilities(params, ["x", "y"], rule="prevalent") == {"f1": "x", "f2": "x"}
    assert family_capabilities(params, ["x", "y"]) == {"f1": "x", "f2": "y"}
    # One family alone: no other family to contrast with, so the specific rule is the prevalent one.
    (tmp_path / "bl" / "instances.jsonl").write_text(
        "".join(json.dumps({"instance_id": i, "family": "f2"}) + "\n" for i in ("b1", "b2", "b3"))
    )
    assert family_capabilities(params, ["x", "y"]) == family_capabilities(params, ["x", "y"], rule="prevalent")
    assert family_capabilities(params, ["x", "y"]) == {"f2": "x"}
