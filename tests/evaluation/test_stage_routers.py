"""Stage evaluation's routing rows without a model: stage routing (gate and channel scoring, placeholder adapters)
on the routing tests' fixture, then evaluation with the arena replaced by one that makes up each episode's outcome
from the adapter weights it plays with. Checks the trace_<scoring> rows on the same instances, the reuse of trace's
episodes for the main scoring, the routing section (routing.csv, results.json `routers`, table.md) and the paired
comparison with oracle routing."""

from __future__ import annotations

import csv
import hashlib
import json

from tests.evaluation.test_stage_parts import traj
from tests.routing.test_stage import CAPS, _params, project  # noqa: F401 - the fixture
from tests.training.test_stage import TinyBase
from trace_core import inputs
from trace_core.evaluation import stage as evaluation
from trace_core.routing import stage as routing


class FakeArena:
    """Plays nothing: an episode succeeds when a hash of (instance, weights) says so; records what was played."""

    def __init__(self):
        self.played: dict[str, list] = {}

    def play(self, method, groups, extra_key=None):
        out = []
        for weights, _, insts in groups:
            for inst in insts:
                h = hashlib.sha256(f"{inst.instance_id}{sorted(weights.items())}".encode()).digest()[0]
                out.append(traj(inst.instance_id, h % 2 == 0, inst.family))
        self.played[method] = [(sorted(w.items()), [i.instance_id for i in insts]) for w, _, insts in groups]
        return out

    def close(self):
        pass


def test_every_router_gets_a_trace_row_and_a_ground_truth_row(project, tiny_model, tokenizer,  # noqa: F811
                                                               monkeypatch):
    from tests.routing.test_gate import fake_embed
    from trace_core.envs.procedural import generate_set
    from trace_core.routing.gate import example_of
    from trace_core.routing.router import task_text

    monkeypatch.setattr("trace_core.analysis.embedding.embed_texts", fake_embed)
    family = {"tool_call_precision": "single_write", "identification": "identify_then_act"}
    monkeypatch.setattr(routing, "synthetic_examples", lambda params, adapters, k: [
        example_of(i, task_text(i), a.capability_id, "synthetic") for a in adapters
        for i in generate_set([family[a.capability_id]], 900, k, 1)])
    params = _params(project, **{
        "evaluation.router.scoring": "gate", "evaluation.router.compare": ["channel"],
        "evaluation.router.gate.per_capability": 6, "evaluation.router.gate.distractors": 12,
        "evaluation.router.gate.folds": 3, "evaluation.curve_points": 1,
        "evaluation.methods": ["base", "trace", "single", "oracle", "trace_gate", "trace_channel"]})
    tiny = TinyBase(tiny_model, tokenizer)
    routing.run(params, progress=False, base=tiny.agent())
    arena = FakeArena()
    monkeypatch.setattr(evaluation, "_open_arena", lambda *a, **k: arena)
    # The ground truth: the first held-out instance lacked identification, the second is ambiguous.
    truth = {}

    def fake_truth(trajectories, instances, capability_ids, labeller):
        assert capability_ids == list(CAPS) and labeller.name == "programmatic"
        truth.update({instances[0].instance_id: "identification", instances[1].instance_id: "ambiguous"})
        return dict(truth)

    monkeypatch.setattr("trace_core.routing.truth.ground_truth", fake_truth)
    metrics = evaluation.run(params, progress=False, base=tiny.agent())
    out = project / params.evaluation.out_dir
    results = json.loads((out / "results.json").read_text())
    assert results["methods"] == ["base", *(f"single:{c}" for c in CAPS), "trace", "trace_channel", "trace_gate",
                                  "oracle"]
    # trace_gate reuses trace's episodes (gate is the main scoring); trace_channel plays the channel routes.
    assert "trace_gate" not in arena.played and "trace_channel" in arena.played
    decisions = routing.read_decisions(params, "tiny-llama-0", inputs.routable_adapters(params),
                                       inputs.trained_adapters(params), inputs.held_out_instances(params))
    routes = decisions.routers["channel"].routes
    # Tasks routed to an adapter are played with it; those routed to none take the base row's own episodes.
    routed = [(sorted(r.weights.items()), r.instance_id) for r in routes if r.weights]
    assert sorted((w, i) for w, ids in arena.played["trace_channel"] for i in ids) == sorted(routed)
    assert results["budgets"]["trace_channel"] == results["budgets"]["trace"] == 6
    report = results["routers"]
    assert report["truth"] == truth and report["ground_truth"]["scored"] == 1
    gate = report["routers"]["gate"]
    assert gate["method"] == "trace_gate" and gate["vs_ground_truth"]["n"] == 1
    assert gate["vs_oracle"]["instances"] == 2  # paired with oracle routing on the same instances
    rows = list(csv.DictReader((out / "routing.csv").open()))
    assert [r["router"] for r in rows] == ["gate", "channel"] and all(r["instances"] == "1" for r in rows)
    assert float(rows[0]["oracle_success"]) == results["summary"]["methods"]["oracle"]["pass_hat_k"]["1"]["value"]
    assert "## Routing against the base agent's held-out trajectories" in (out / "table.md").read_text()
    # The gate's cross-validated choice of synthetic weight and C is in the routing report (gate.json's selection).
    selection = report["gate_selection"]
    assert set(selection) >= {"synthetic_weight", "inverse_regularization", "cv"}
    assert "Gate: synthetic weight" in (out / "table.md").read_text()
    assert "routing/gate/accuracy_vs_truth" in metrics
