"""Stage evaluation end to end on a tiny setup: two capabilities synthesized and trained (one GRPO step each) with
the tiny model as base agent, a stand-in analysis (capability texts and LACKING labels per family), then every
method on two held-out instances — the trained baselines and GEPA within TRACE's rollout budget. Checks every
declared output, the equal-budget bookkeeping, that a re-run plays nothing new, and the guards."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from tests.training.test_stage import TINY, TinyBase
from trace_core.config import load_params
from trace_core.envs.procedural import generate_set
from trace_core.evaluation import stage
from trace_core.schemas import Capability, CapabilityDictionary, CapabilityStats
from trace_core.synthesis.stage import synthesize
from trace_core.training import run as train

CAPS = {"tool_call_precision": "single_write", "identification": "identify_then_act"}  # capability -> its family

SETTINGS = {
    **TINY,
    "synthesis.capabilities": list(CAPS),
    "tasks.families": list(CAPS.values()),
    "evaluation.instances_per_family": 1,
    "evaluation.curve_points": 2,
    "evaluation.bootstrap_samples": 50,
    "evaluation.router.answer_prefix": "",  # the tiny tokenizer has no " A" token
    "evaluation.gepa.minibatch": 1,
    "evaluation.gepa.train_instances": 2,
    "evaluation.gepa.val_instances": 1,
    "evaluation.gepa.max_new_tokens": 8,
}


def _stats() -> CapabilityStats:
    return CapabilityStats(runs=1, runs_passed=1, runs_required=1, coverage_mean=0.3, coverage_std=0, delta_mean=0.4,
                           delta_std=0, er_minus_mean=0.5, er_plus_mean=0.1, coverage_ci=(0.2, 0.4),
                           delta_ci=(0.3, 0.5), lacking_failed=3, present_failed=2, lacking_passed=0,
                           present_passed=5)


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_model, tokenizer) -> Path:
    """Synthesis and training done for both capabilities; analysis' capabilities.json and labels.parquet and the
    baseline's instances.jsonl stand in for stages 0-1."""
    root = tmp_path_factory.mktemp("evaluation-project")
    (root / "params.yaml").write_text((Path(__file__).resolve().parents[2] / "params.yaml").read_text())
    params = load_params(root / "params.yaml", SETTINGS)
    caps = [Capability(capability_id=c, name=c.replace("_", " "), definition=f"the skill of {c}",
                       labeller="programmatic", selected=True, stats=_stats()) for c in CAPS]
    for c in caps:
        assert synthesize(c, params, root / params.synthesis.out_dir).status == "ready"
    analysis = root / params.analysis.out_dir
    analysis.mkdir(parents=True)
    (analysis / "capabilities.json").write_text(CapabilityDictionary(
        target={}, thresholds={}, labellers=["programmatic"], selected=list(CAPS), capabilities=caps).model_dump_json())
    seen = generate_set(params.tasks.families, params.baseline.seed, 2, params.tasks.difficulty)
    baseline = root / params.baseline.out_dir
    baseline.mkdir(parents=True)
    (baseline / "instances.jsonl").write_text("".join(i.model_dump_json() + "\n" for i in seen))
    by_family = {f: c for c, f in CAPS.items()}
    pd.DataFrame([{"instance_id": i.instance_id, "capability_id": by_family[i.family], "label": "LACKING",
                   "success": False} for i in seen]).to_parquet(analysis / "labels.parquet")
    import os

    cwd = os.getcwd()
    os.chdir(root)
    try:
        metrics = train(params, progress=False, base=TinyBase(tiny_model, tokenizer).agent())
    finally:
        os.chdir(cwd)
    assert metrics["trained"] == 2
    return root


def _params(project, **overrides):
    return load_params(project / "params.yaml", {**SETTINGS, **overrides})


def test_every_method_at_equal_budget(project, tiny_model, tokenizer, monkeypatch):
    monkeypatch.chdir(project)
    tiny = TinyBase(tiny_model, tokenizer)
    params = _params(project)
    metrics = stage.run(params, progress=False, base=tiny.agent())
    out = project / params.evaluation.out_dir

    for name in ("results.json", "table.md", "report.html", "metrics.json", "ledger.json", "curve.csv",
                 "confusion.csv", "transfer.csv", "routes.json"):
        assert (out / name).is_file(), name
    assert (out / "trajectories").is_dir() and (out / "baselines").is_dir()

    results = json.loads((out / "results.json").read_text())
    singles = [f"single:{c}" for c in CAPS]
    expected = {"base", "trace", *singles, "oracle", "merged_linear", "merged_ties", "mixture", "grpo_target", "gepa",
                "describe"}
    assert set(results["methods"]) == expected, results["warnings"]
    summary = results["summary"]
    assert summary["instances"] == 2 and summary["trials"] == 1
    budget = sum(a["rollouts"] for a in results["adapters"])
    assert budget == 4  # two adapters x one step of 2 rollouts
    budgets = results["budgets"]
    assert budgets["trace"] == budgets["oracle"] == budget and budgets["base"] == 0
    # The baselines spend at most TRACE's budget: GRPO steps of 2 rollouts fit exactly, GEPA stops before it.
    assert budgets["grpo_target"] == budgets["mixture"] == budget
    assert 0 < budgets["gepa"] <= budget

    # Every method played both held-out instances once, and the ledger counted exactly those episodes.
    # The oracle reuses the single adapters' episodes; the curve's marks below the full budget play their own.
    ledger = json.loads((out / "ledger.json").read_text())
    played = ledger["rollouts"]["evaluation"]
    assert played == {m: 2 for m in (expected - {"oracle"}) | {"trace@2", "grpo_target@2", "gepa@2"}}
    for method in expected:
        groups = list((out / "trajectories").glob(f"{method.replace(':', '-')}/group*.jsonl"))
        assert bool(groups) == (method != "oracle"), method  # trace: one group per adapter choice
    assert metrics["base/pass_1"] == summary["methods"]["base"]["pass_hat_k"]["1"]["value"]
    assert metrics["trace/delta_vs_base"] == summary["methods"]["trace"]["vs_reference"]["difference"]

    # Routing: a choice per instance and its accuracy against the family -> capability map of the labels.
    routing = results["routing"]
    assert [r["oracle"] for r in routing["routes"]] == [CAPS_BY_FAMILY[r["family"]] for r in routing["routes"]]
    assert routing["accuracy"]["n"] == 2 and 0 <= routing["accuracy"]["accuracy"] <= 1
    # Each family lacks one capability here, so both rules give the same map and the same accuracy.
    assert routing["accuracy_prevalent"]["accuracy"] == routing["accuracy"]["accuracy"]
    # The default channel router shows each capability's first synthetic training openings on its card.
    assert routing["scoring"] == "channel"
    from trace_core.routing.router import task_text
    from trace_core.synthesis.templates import make

    shown = {o["capability_id"]: o["examples"] for o in routing["options"]}
    spec = json.loads((project / params.synthesis.out_dir / "identification" / "spec.json").read_text())
    env = make(spec["template"], "identification", spec["difficulty"], spec["profile"])
    first = spec["train_seeds"][0]
    assert shown["identification"] == [task_text(env.reset(first + i)) for i in range(2)]
    assert metrics["routing/accuracy"] == round(routing["accuracy"]["accuracy"], 4)
    confusion = (out / "confusion.csv").read_text().splitlines()
    assert confusion[0] == "actual,predicted" and len(confusion) == 3

    # The curve: base at 0 rollouts for each shown method, then the mark 2 and the full budget.
    curve = results["curve"]
    for method in ("trace", "grpo_target", "gepa"):
        xs = [p["rollouts"] for p in curve if p["method"] == method]
        assert xs[0] == 0 and len(xs) == 3 and max(xs) <= budget, (method, xs)
    assert len((out / "curve.csv").read_text().splitlines()) == 1 + len(curve)

    # The transfer matrix: base and each adapter on each capability's slice.
    transfer = results["transfer"]
    assert transfer["slices"] == sorted(CAPS) and transfer["rows"][0] == "base"
    for c in CAPS:
        assert f"single:{c}" in transfer["rows"]

    table = (out / "table.md").read_text()
    for label in ("base agent", "TRACE (routed)", "GRPO on target tasks", "GEPA (prompt)"):
        assert label in table
    html = (out / "report.html").read_text()
    assert "<svg" in html and "http://" not in html.replace("http://www.w3.org/2000/svg", "")

    # A re-run with the same settings plays nothing, trains nothing and routes nothing (the full set and the curve's
    # mark each have their saved probabilities): the outputs come back identical.
    assert len(list((out / "routing").glob("*.json"))) == 2
    before = {p.name: p.read_text() for p in (out / "trajectories").rglob("*.jsonl")}
    loads = len(tiny.loads)
    from trace_core.routing.router import Router

    def no_routing(self, tasks):
        raise AssertionError("routed again")

    monkeypatch.setattr(Router, "probabilities", no_routing)
    again = stage.run(params, progress=False, base=tiny.agent())
    assert again == metrics
    assert {p.name: p.read_text() for p in (out / "trajectories").rglob("*.jsonl")} == before
    # The shared model, first and after each trained baseline (both reused, so no training copy is loaded).
    assert len(tiny.loads) == loads + 3
    assert json.loads((out / "ledger.json").read_text()) == ledger


CAPS_BY_FAMILY = {f: c for c, f in CAPS.items()}


class Killed(BaseException):
    """A kill while a baseline trains."""


def test_provisional_tables_come_before_and_between_the_baselines(project, tiny_model, tokenizer, monkeypatch,
                                                                   tmp_path):
    import gc
    import weakref

    import trace_core.baseline
    from trace_core import status
    from trace_core.envs.users import ScriptedUser
    from trace_core.training.ledger import RolloutLedger

    tiny = TinyBase(tiny_model, tokenizer)
    loaded = []

    def load(dtype):
        model, tok = TinyBase.load(tiny, dtype)
        loaded.append(weakref.ref(model))
        return model, tok

    def make_user(params, policy=None):
        def factory():  # like an LLM user simulator on the local model, this closure holds the policy
            assert policy is not None
            return ScriptedUser(max_turns=params.user.max_turns)
        return factory

    train_baseline, kill = stage._train_baseline, set()

    def train_or_kill(name, *args, **kwargs):
        if name in kill:
            gc.collect()
            assert loaded and all(ref() is None for ref in loaded), "a copy of the model is still in memory"
            raise Killed
        return train_baseline(name, *args, **kwargs)

    monkeypatch.chdir(project)
    monkeypatch.setattr(tiny, "load", load)
    monkeypatch.setattr(trace_core.baseline, "make_user", make_user)
    monkeypatch.setattr(stage, "_train_baseline", train_or_kill)
    out = tmp_path / "evaluation"
    params = _params(project, **{"evaluation.out_dir": str(out)})

    # Killed at the first baseline, GRPO on the target tasks: TRACE's methods are in a provisional table.
    kill.update({"grpo_target", "mixture"})
    with pytest.raises(Killed):
        stage.run(params, progress=False, base=tiny.agent())
    (out / "ledger.json").unlink()  # e.g. after `dvc checkout`: the episodes come back, the uncached ledger does not
    with pytest.raises(Killed):
        stage.run(params, progress=False, base=tiny.agent())
    RolloutLedger(out / "ledger.json")  # the ledger the stage wrote loads

    results = json.loads((out / "results.json").read_text())
    assert results["provisional"] is True and results["pending"] == ["grpo_target", "gepa", "mixture"]
    assert results["methods"] == ["base", *(f"single:{c}" for c in CAPS), "trace", "oracle", "merged_linear",
                                  "merged_ties", "describe"]
    table = (out / "table.md").read_text()
    assert table.startswith("**Provisional**") and "TRACE (routed)" in table and "GEPA" not in table
    assert "provisional: grpo_target, gepa, mixture still to run" in table
    assert "Provisional, written before grpo_target, gepa, mixture ran." in (out / "report.html").read_text()
    row = status.report(params, project)[-1]
    assert row.state == status.PARTIAL
    assert row.detail.startswith("provisional table (grpo_target, gepa, mixture still to run)")

    # Killed at the last one, the mixture: GRPO and GEPA already have their rows and curve points.
    kill.discard("grpo_target")
    with pytest.raises(Killed):
        stage.run(params, progress=False, base=tiny.agent())
    results = json.loads((out / "results.json").read_text())
    assert results["provisional"] is True and results["pending"] == ["mixture"]
    assert "grpo_target" in results["methods"] and "gepa" in results["methods"]
    assert "mixture" not in results["methods"]
    assert {p["method"] for p in results["curve"]} == {"trace", "grpo_target", "gepa"}
    budget = sum(a["rollouts"] for a in results["adapters"])
    assert results["budgets"]["grpo_target"] == budget and 0 < results["budgets"]["gepa"] <= budget
    table = (out / "table.md").read_text()
    assert "GRPO on target tasks" in table and "GEPA (prompt)" in table and "one LoRA on the mixture" not in table
    assert "provisional: mixture still to run" in table
    assert status.report(params, project)[-1].detail.startswith("provisional table (mixture still to run)")


def test_held_out_clash_is_refused(project, tmp_path):
    # A baseline that rolled out the evaluation's tasks (under other ids): evaluating them would score on what
    # analysis saw.
    params = _params(project, **{"baseline.out_dir": str(tmp_path)})
    held_out = stage.held_out_instances(params)
    renamed = [i.model_copy(update={"instance_id": f"renamed-{n}"}) for n, i in enumerate(held_out)]
    (tmp_path / "instances.jsonl").write_text("".join(i.model_dump_json() + "\n" for i in renamed))
    with pytest.raises(stage.EvaluationError, match="rolled out by the baseline"):
        stage.check_held_out(held_out, params)
    stage.check_held_out(held_out, _params(project))  # the project's own baseline is disjoint


def test_methods_need_base_and_oracle_needs_single(project):
    params = _params(project, **{"evaluation.methods": ["trace"]})
    with pytest.raises(stage.EvaluationError, match="must include base"):
        stage._methods(params, [object()], [])
    params = _params(project, **{"evaluation.methods": ["base", "oracle"]})
    with pytest.raises(stage.EvaluationError, match="oracle without single"):
        stage._methods(params, [object()], [])


def test_remote_policy_is_refused(project):
    params = _params(project, **{"policy.backend": "openai", "policy.base_url": "http://127.0.0.1:9/v1",
                                 "policy.model": "m"})
    with pytest.raises(stage.EvaluationError, match="policy.backend=local"):
        stage.run(params, progress=False)
