"""Stage routing's entry point on a tiny fixture: the tiny model as base agent and two adapter records whose adapter
files are placeholders (the router scores the options with the base model and never loads an adapter). Checks the
typed decisions file, the saved probabilities a re-run reuses, and that evaluation refuses without decisions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.training.test_stage import TinyBase
from trace_core.config import load_params
from trace_core.inputs import trained_adapters
from trace_core.routing import stage
from trace_core.schemas import AdapterRecord, RoutingDecisions
from trace_core.training.trainer import ADAPTER_FILE, sha256_file

ROOT = Path(__file__).resolve().parents[2]
CAPS = ("tool_call_precision", "identification")


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    for n, cid in enumerate(CAPS):
        folder = tmp_path / "artifacts/training" / cid
        (folder / "adapter").mkdir(parents=True)
        (folder / "adapter" / ADAPTER_FILE).write_bytes(b"placeholder %d" % n)
        record = AdapterRecord(capability_id=cid, status="trained", adapter_sha256=sha256_file(
            folder / "adapter" / ADAPTER_FILE), rollouts=2 * (n + 1), steps=1)
        (folder / "adapter_record.json").write_text(record.model_dump_json())
    return tmp_path


def _params(project: Path, **overrides):
    settings = {"synthesis.capabilities": list(CAPS), "tasks.families": ["single_write", "identify_then_act"],
                "evaluation.instances_per_family": 1, "evaluation.curve_points": 2,
                "evaluation.router.examples": 0, "evaluation.router.answer_prefix": "", "policy.batch_size": 2,
                "evaluation.router.scoring": "label", "evaluation.router.compare": [],
                "evaluation.methods": ["base", "trace", "single", "oracle"],
                "training.keep_unlearned": True}  # records without the gate's verdict
    return load_params(project / "params.yaml", {**settings, **overrides})


def test_routing_stage_writes_a_valid_decisions_file(project, tiny_model, tokenizer, monkeypatch):
    tiny = TinyBase(tiny_model, tokenizer)
    params = _params(project)
    metrics = stage.run(params, progress=False, base=tiny.agent())
    out = project / params.routing.out_dir
    decisions = RoutingDecisions.model_validate_json((out / stage.DECISIONS).read_text())
    assert decisions.adapters.keys() == set(CAPS) and len(decisions.instances) == 2
    assert decisions.router == params.evaluation.router.model_dump()
    assert decisions.family_capability == {}  # no analysis labels here: routes carry no oracle label
    full = decisions.full
    assert full.adapters == list(CAPS) and full.rollouts == 6 and full.accuracy is None
    assert [o["capability_id"] for o in full.options] == [None, *CAPS]
    for route in full.routes:
        assert set(route.probabilities) == {o["label"] for o in full.options}
        assert abs(sum(route.probabilities.values()) - 1) < 1e-6
        assert len(route.chosen) == 1 or route.chosen == [] and route.weights == {}
    # curve_points=2 over adapters of 2 and 4 rollouts: the mark 2 routes over the first adapter alone.
    assert list(decisions.marks) == ["2"] and decisions.marks["2"].adapters == [CAPS[0]]
    assert metrics == json.loads((out / "metrics.json").read_text()) and metrics["instances"] == 2
    assert tiny.loads == [params.model.dtype]
    assert decisions.run_key == stage.decisions_key(params, "tiny-llama-0", trained_adapters(params),
                                                    trained_adapters(params), stage.held_out_instances(params))
    assert decisions.learned == list(CAPS)

    # A re-run scores nothing again and loads no model: the probabilities were saved per option set.
    from trace_core.routing.router import Router

    monkeypatch.setattr(Router, "probabilities", lambda self, texts: pytest.fail("routed again"))
    before = (out / stage.DECISIONS).read_text()
    stage.run(params, progress=False, base=tiny.agent())
    assert (out / stage.DECISIONS).read_text() == before and tiny.loads == [params.model.dtype]


def test_read_decisions_refuses_missing_torn_or_stale_files(project, tiny_model, tokenizer):
    tiny = TinyBase(tiny_model, tokenizer)
    params = _params(project)
    adapters, instances = trained_adapters(params), stage.held_out_instances(params)
    with pytest.raises(stage.RoutingStageError, match=r"decisions.json is missing: run stage routing first"):
        stage.read_decisions(params, "tiny-llama-0", adapters, adapters, instances)
    stage.run(params, progress=False, base=tiny.agent())
    assert stage.read_decisions(params, "tiny-llama-0", adapters, adapters, instances).full is not None
    with pytest.raises(stage.RoutingStageError, match="other adapters, instances or router settings"):
        stage.read_decisions(params, "tiny-llama-0", adapters[:1], adapters[:1], instances)
    with pytest.raises(stage.RoutingStageError, match="other adapters, instances or router settings"):
        # the same adapters routed among, but another set of them kept by the gate
        stage.read_decisions(params, "tiny-llama-0", adapters, adapters[:1], instances)
    with pytest.raises(stage.RoutingStageError, match="other adapters, instances or router settings"):
        stage.read_decisions(_params(project, **{"evaluation.router.top_p": 0.5}), "tiny-llama-0", adapters,
                             adapters, instances)
    path = project / params.routing.out_dir / stage.DECISIONS
    path.write_text(path.read_text()[:-20])  # torn
    with pytest.raises(stage.RoutingStageError, match="not a routing decisions file"):
        stage.read_decisions(params, "tiny-llama-0", adapters, adapters, instances)


def test_evaluation_refuses_to_run_without_routing_decisions(project, tiny_model, tokenizer):
    from trace_core import evaluation
    from trace_core.inputs import StageInputError

    tiny = TinyBase(tiny_model, tokenizer)
    with pytest.raises(StageInputError, match=r"run stage routing first \(`trace routing`, or `dvc repro routing`\)"):
        evaluation.run(_params(project), progress=False, base=tiny.agent())
    assert tiny.loads == []  # refused before any model was loaded


def test_gate_routes_the_full_set_and_each_mark_byte_identically_on_a_rerun(project, tiny_model, tokenizer,
                                                                            monkeypatch):
    """scoring gate: a gate per routed set (gate.json for all adapters, gate-1.json for the curve mark's prefix),
    trained without the base model; a re-run retrains and writes the same bytes. The synthetic openings come from
    procedural families at other seeds and a hashing embedder stands in for MiniLM (tests/routing/test_gate.py)."""
    from tests.routing.test_gate import fake_embed
    from trace_core.envs.procedural import generate_set
    from trace_core.routing.gate import example_of
    from trace_core.routing.router import task_text

    monkeypatch.setattr("trace_core.analysis.embedding.embed_texts", fake_embed)
    family = {"tool_call_precision": "single_write", "identification": "identify_then_act"}

    def synthetic(params, adapters, k):
        return [example_of(i, task_text(i), a.capability_id, "synthetic") for a in adapters
                for i in generate_set([family[a.capability_id]], 900, k, 1)]

    monkeypatch.setattr(stage, "synthetic_examples", synthetic)
    tiny = TinyBase(tiny_model, tokenizer)
    params = _params(project, **{"evaluation.router.scoring": "gate", "evaluation.router.gate.per_capability": 6,
                                 "evaluation.router.gate.distractors": 12, "evaluation.router.gate.folds": 3})
    metrics = stage.run(params, progress=False, base=tiny.agent())
    out = project / params.routing.out_dir
    decisions = RoutingDecisions.model_validate_json((out / stage.DECISIONS).read_text())
    assert tiny.loads == []  # the gate needs no base model
    assert (out / stage.PROBABILITIES).is_dir()  # a declared DVC output all the same (empty: nothing scored)
    assert set(decisions.routers) == {"gate"} and decisions.full.scoring == "gate"
    assert sorted(decisions.gates) == ["gate-1.json", "gate.json"] and "gate/distractors_to_base" in metrics
    assert [o["capability_id"] for o in decisions.marks["2"].options] == [None, CAPS[0]]
    for route in decisions.full.routes:
        assert abs(sum(route.probabilities.values()) - 1) < 1e-9
    # Each held-out instance goes to its family's capability (the fake synthetic openings are those families').
    assert [r.chosen for r in decisions.full.routes] == [[family_cap] for family_cap in
                                                        ("tool_call_precision", "identification")]
    files = {p.name: p.read_bytes() for p in [out / stage.DECISIONS, *(out / "gate").glob("*.json")]}
    stage.run(params, progress=False, base=tiny.agent())
    assert {p.name: p.read_bytes() for p in [out / stage.DECISIONS, *(out / "gate").glob("*.json")]} == files
    # Back to a model scoring: the gates of the earlier run do not stay behind.
    stage.run(_params(project), progress=False, base=tiny.agent())
    assert list((out / "gate").glob("*.json")) == []


def test_routing_routes_among_every_trained_adapter_and_marks_the_learned_ones(project, tiny_model, tokenizer,
                                                                               caplog):
    import logging

    tiny = TinyBase(tiny_model, tokenizer)
    gated = _params(project, **{"training.keep_unlearned": False})
    # Neither record has the gate's verdict (never evaluated): both dropped by the gate, but the router still
    # chooses among both (its accuracy must not hinge on which adapters learned); every choice plays the base agent.
    with caplog.at_level(logging.WARNING, logger="trace_core.routing.stage"):
        metrics = stage.run(gated, progress=False, base=tiny.agent())
    assert metrics["adapters"] == 2 and metrics["learned"] == 0 and metrics["dropped"] == 2
    decisions = RoutingDecisions.model_validate_json((project / gated.routing.out_dir / stage.DECISIONS).read_text())
    assert set(decisions.adapters) == set(CAPS) and decisions.learned == []
    assert decisions.full.adapters == list(CAPS)
    assert all(decisions.played_weights(r) == {} for r in decisions.full.routes)
    assert any("no adapter learned: TRACE is the base agent" in r.message for r in caplog.records)
    assert any(r.message.startswith(f"adapter {CAPS[0]} dropped") for r in caplog.records)

    # One learned adapter: the same options, and only it is played.
    folder = project / "artifacts/training" / CAPS[1]
    record = AdapterRecord.model_validate_json((folder / "adapter_record.json").read_text())
    (folder / "adapter_record.json").write_text(record.model_copy(update={"learned": True}).model_dump_json())
    metrics = stage.run(gated, progress=False, base=tiny.agent())
    assert metrics["adapters"] == 2 and metrics["learned"] == 1 and metrics["dropped"] == 1
    decisions = RoutingDecisions.model_validate_json((project / gated.routing.out_dir / stage.DECISIONS).read_text())
    assert set(decisions.adapters) == set(CAPS) and decisions.learned == [CAPS[1]]
    for route in decisions.full.routes:
        played = decisions.played_weights(route)
        assert played == ({CAPS[1]: 1.0} if route.chosen == [CAPS[1]] else {})
