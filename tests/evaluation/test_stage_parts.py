"""The evaluation stage's pure parts: the oracle, the transfer matrix and champions, routing groups, the describe
prompt and the config checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from trace_core.config import load_params
from trace_core.evaluation.stage import (
    _play_routed,
    _route_groups,
    champions,
    describe_prompt,
    oracle_choice,
    transfer_matrix,
)
from trace_core.inputs import TrainedAdapter
from trace_core.schemas import Message, RouteDecision, RoutingDecisions, Trajectory

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


def test_route_groups_share_one_switch_per_weight_set():
    from trace_core.envs.procedural import generate_set

    insts = generate_set(["single_write"], 5000, 4, 1)
    rows = [RouteDecision(instance_id=i.instance_id, family=i.family, probabilities={}, chosen=sorted(w), weights=w)
            for i, w in zip(insts, [{"x": 1.0}, {}, {"x": 1.0}, {"y": 0.6, "x": 0.4}])]
    every = RoutingDecisions(run_key="k", router={}, adapters={"x": "sx", "y": "sy"}, learned=["x", "y"],
                             instances=[i.instance_id for i in insts], family_capability={})
    groups = _route_groups(every, rows, insts)
    assert [(w, [i.instance_id for i in g]) for w, _, g in groups] == [
        ({"x": 1.0}, [insts[0].instance_id, insts[2].instance_id]),
        ({}, [insts[1].instance_id]),
        ({"x": 0.4, "y": 0.6}, [insts[3].instance_id]),
    ]
    # Only x passed the gate: a route to y alone plays the base agent, a composition keeps x at the routed total.
    only_x = every.model_copy(update={"learned": ["x"]})
    assert [(w, [i.instance_id for i in g]) for w, _, g in _route_groups(only_x, rows, insts)] == [
        ({"x": 1.0}, [insts[0].instance_id, insts[2].instance_id, insts[3].instance_id]),
        ({}, [insts[1].instance_id]),
    ]
    none = every.model_copy(update={"learned": []})
    assert [w for w, _, _ in _route_groups(none, rows, insts)] == [{}]


def test_routed_method_reuses_the_base_rows_episodes_for_tasks_routed_to_no_adapter():
    from trace_core.envs.procedural import generate_set

    insts = generate_set(["single_write"], 5000, 4, 1)
    rows = [RouteDecision(instance_id=i.instance_id, family=i.family, probabilities={}, chosen=sorted(w), weights=w)
            for i, w in zip(insts, [{"y": 1.0}, {}, {"x": 1.0}, {"y": 1.0}])]
    decisions = RoutingDecisions(run_key="k", router={}, adapters={"x": "sx", "y": "sy"}, learned=["x"],
                                 instances=[i.instance_id for i in insts], family_capability={})

    class Arena:
        played = None

        def play(self, method, groups, extra_key=None):
            self.played = [(w, [i.instance_id for i in g]) for w, _, g in groups]
            return [traj(i.instance_id, True, i.family) for _, _, g in groups for i in g]

    base = [traj(i.instance_id, False, i.family) for i in insts]
    arena = Arena()
    out = _play_routed(arena, "trace", decisions, rows, insts, {"base": base})
    # Only the instance routed to the learned x is played; the others (routed to none, or to the dropped y) are the
    # base row's episodes, in the instances' order.
    assert arena.played == [({"x": 1.0}, [insts[2].instance_id])]
    assert [t.instance_id for t in out] == [i.instance_id for i in insts]
    assert [t.success for t in out] == [False, False, True, False]
    assert out[0] is base[0] and out[3] is base[3]


def test_describe_prompt_lists_every_capability():
    text = describe_prompt("POLICY", [adapter("look_up_first"), adapter("exact_ids")])
    assert text.startswith("POLICY\n\n")
    assert "- look up first: does look_up_first" in text and "- exact ids: does exact_ids" in text


def _params(tmp_path: Path, **overrides):
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    return load_params(tmp_path / "params.yaml", overrides)


def test_config_rejects_evaluation_seeds_that_are_not_held_out(tmp_path):
    for key in ("baseline.seed", "bootstrap.seed", "evaluation.target_seed"):
        with pytest.raises(ValueError, match=f"equals {key}"):
            _params(tmp_path, **{key: 5000})
    with pytest.raises(ValueError, match="temperature > 0"):
        _params(tmp_path, **{"evaluation.trials": 3})
    with pytest.raises(ValueError, match="top_p"):
        _params(tmp_path, **{"evaluation.router.top_p": 1.0})
    with pytest.raises(ValueError, match=r"scoring has 'letters'; use label .* channel .* or gate"):
        _params(tmp_path, **{"evaluation.router.scoring": "letters"})
    with pytest.raises(ValueError, match=r"compare has 'logits'"):
        _params(tmp_path, **{"evaluation.router.compare": ["gate", "logits"]})
    with pytest.raises(ValueError, match="examples=-1 must be >= 0"):
        _params(tmp_path, **{"evaluation.router.examples": -1})
    with pytest.raises(ValueError, match="scoring=label only"):
        _params(tmp_path, **{"evaluation.router.calibrate": True})  # the default scoring is gate
    _params(tmp_path, **{"evaluation.router.calibrate": True, "evaluation.router.scoring": "label"})
    with pytest.raises(ValueError, match="not valid"):
        _params(tmp_path, **{"evaluation.methods": ["base", "magic"]})
    cal = {"synthesis.calibration.enabled": True, "synthesis.calibration.temperature": 1.0}
    with pytest.raises(ValueError, match="set both to the same value"):
        _params(tmp_path, **cal)  # training samples at 0.7 by default
    _params(tmp_path, **cal, **{"training.temperature": 1.0})
    _params(tmp_path, **{"synthesis.calibration.enabled": False,
                         "synthesis.calibration.temperature": 1.0})  # calibration off: not checked
