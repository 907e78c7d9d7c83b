"""Stages routing, baselines and evaluation end to end on a tiny setup: two capabilities synthesized and trained (one
GRPO step each) with the tiny model as base agent, a stand-in analysis (capability texts and LACKING labels per
family), then the router's decisions, the trained baselines and GEPA within TRACE's rollout budget, and every method
on two held-out instances. Checks every declared output, the equal-budget bookkeeping, that a re-run routes, trains
and plays nothing new, and the guards (evaluation refuses missing or stale decisions and baselines)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pandas as pd
import pytest

from tests.training.test_stage import TINY, TinyBase
from trace_core import baselines as baselines_stage
from trace_core import routing as routing_stage
from trace_core.config import load_params
from trace_core.envs.procedural import generate_set
from trace_core.evaluation import stage
from trace_core.inputs import StageInputError, check_held_out, held_out_instances
from trace_core.schemas import BaselinesRecord, Capability, CapabilityDictionary, CapabilityStats, RoutingDecisions
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
    "evaluation.router.scoring": "channel",  # trace: channel; trace_label and trace_gate play beside it
    "evaluation.router.gate.per_capability": 8,
    "evaluation.router.gate.distractors": 16,
    "evaluation.gepa.minibatch": 1,
    "evaluation.gepa.train_instances": 2,
    "evaluation.gepa.val_instances": 1,
    "evaluation.gepa.max_new_tokens": 8,
    "training.keep_unlearned": True,  # the tiny adapters learn nothing; these tests are about the methods
}


def _stats() -> CapabilityStats:
    return CapabilityStats(runs=1, runs_passed=1, runs_required=1, coverage_mean=0.3, coverage_std=0, delta_mean=0.4,
                           delta_std=0, er_minus_mean=0.5, er_plus_mean=0.1, coverage_ci=(0.2, 0.4),
                           delta_ci=(0.3, 0.5), lacking_failed=3, present_failed=2, lacking_passed=0,
                           present_passed=5)


def synthesized_project(root: Path, settings: dict, capability_ids):
    """A project folder at `root` with the repository's params.yaml (plus `settings`), each capability's
    environment synthesized and ready, and analysis' capabilities.json selecting them all."""
    (root / "params.yaml").write_text((Path(__file__).resolve().parents[2] / "params.yaml").read_text())
    params = load_params(root / "params.yaml", settings)
    caps = [Capability(capability_id=c, name=c.replace("_", " "), definition=f"the skill of {c}",
                       labeller="programmatic", selected=True, stats=_stats()) for c in capability_ids]
    for c in caps:
        assert synthesize(c, params, root / params.synthesis.out_dir).status == "ready"
    analysis = root / params.analysis.out_dir
    analysis.mkdir(parents=True)
    (analysis / "capabilities.json").write_text(CapabilityDictionary(
        target={}, thresholds={}, labellers=["programmatic"], selected=list(capability_ids),
        capabilities=caps).model_dump_json())
    return params, caps


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_model, tokenizer) -> Path:
    """Synthesis and training done for both capabilities; analysis' capabilities.json and labels.parquet and the
    baseline's instances.jsonl stand in for stages 0-1."""
    root = tmp_path_factory.mktemp("evaluation-project")
    params, caps = synthesized_project(root, SETTINGS, CAPS)
    analysis = root / params.analysis.out_dir
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


@pytest.fixture(scope="module")
def staged(project, tiny_model, tokenizer) -> Path:
    """`project` with stages routing and baselines run (their outputs in the project's artifacts/)."""
    import os

    tiny = TinyBase(tiny_model, tokenizer)
    params = _params(project)
    cwd = os.getcwd()
    os.chdir(project)
    try:
        routed = routing_stage.run(params, progress=False, base=tiny.agent())
        assert routed["instances"] == 2 and routed["adapters"] == 2
        assert set(baselines_stage.run(params, progress=False, base=tiny.agent())) == {
            "trace_budget", "grpo_target/rollouts", "gepa/rollouts", "mixture/rollouts"}
    finally:
        os.chdir(cwd)
    return project


def test_routing_stage_writes_typed_decisions(staged):
    params = _params(staged)
    out = staged / params.routing.out_dir
    decisions = RoutingDecisions.model_validate_json((out / "decisions.json").read_text())
    assert decisions.schema_version == "1" and decisions.router == params.evaluation.router.model_dump()
    assert set(decisions.adapters) == set(CAPS) and len(decisions.instances) == 2
    assert decisions.family_capability == {f: c for c, f in CAPS.items()}
    full = decisions.full
    assert full.adapters == list(CAPS) and full.rollouts == 4 and full.scoring == "channel"
    assert [r.instance_id for r in full.routes] == decisions.instances
    for r in full.routes:
        assert abs(sum(r.probabilities.values()) - 1) < 1e-6 and set(r.weights) == set(r.chosen) <= set(CAPS)
    # The curve's mark below the full budget (curve_points=2): routed over the adapter its rollouts paid for.
    assert list(decisions.marks) == ["2"] and decisions.marks["2"].adapters == [next(iter(CAPS))]
    assert json.loads((out / "metrics.json").read_text())["instances"] == 2
    record = BaselinesRecord.model_validate_json((staged / params.baselines.out_dir / "baselines.json").read_text())
    assert record.budget == 4 and [b.name for b in record.baselines] == ["grpo_target", "gepa", "mixture"]
    assert all(b.status == "done" and 0 < b.rollouts <= 4 for b in record.baselines)


def test_evaluation_refuses_missing_or_stale_routing_and_baselines(staged, tiny_model, tokenizer, monkeypatch,
                                                                   tmp_path):
    monkeypatch.chdir(staged)
    tiny = TinyBase(tiny_model, tokenizer)
    out = {"evaluation.out_dir": str(tmp_path / "evaluation")}
    with pytest.raises(StageInputError, match=r"decisions.json is missing: run stage routing first"):
        stage.run(_params(staged, **out, **{"routing.out_dir": str(tmp_path / "none")}), progress=False,
                  base=tiny.agent())
    with pytest.raises(StageInputError, match="other adapters, instances or router settings: run stage routing"):
        stage.run(_params(staged, **out, **{"evaluation.router.examples": 1}), progress=False, base=tiny.agent())
    with pytest.raises(StageInputError, match=r"baselines.json is missing: run stage baselines first"):
        stage.run(_params(staged, **out, **{"baselines.out_dir": str(tmp_path / "none")}), progress=False,
                  base=tiny.agent())
    assert not tiny.loads  # refused before loading the model
    # Without baselines among the methods, their record is not needed.
    params = _params(staged, **out, **{"baselines.out_dir": str(tmp_path / "none"),
                                       "evaluation.methods": ["base"]})
    assert "base/pass_1" in stage.run(params, progress=False, base=tiny.agent())


def test_every_method_at_equal_budget(staged, tiny_model, tokenizer, monkeypatch):
    project = staged
    monkeypatch.chdir(project)
    tiny = TinyBase(tiny_model, tokenizer)
    params = _params(project)
    metrics = stage.run(params, progress=False, base=tiny.agent())
    out = project / params.evaluation.out_dir

    for name in ("results.json", "table.md", "report.html", "metrics.json", "ledger.json", "curve.csv",
                 "confusion.csv", "transfer.csv", "routing.csv", "episodes.csv"):
        assert (out / name).is_file(), name
    assert (out / "trajectories").is_dir()

    results = json.loads((out / "results.json").read_text())
    # The per-instance record (DVC-cached; trajectories/ is not): one row per episode of every method.
    episodes = list(csv.DictReader((out / "episodes.csv").open()))
    assert list(episodes[0]) == ["method", "instance_id", "family", "trial", "success", "reward"]
    assert {r["method"] for r in episodes} == set(results["methods"])
    assert all(sum(r["method"] == m for r in episodes) == 2 for m in results["methods"])  # 2 instances, 1 trial
    base_rate = results["summary"]["methods"]["base"]["pass_hat_k"]["1"]["value"]
    assert sum(int(r["success"]) for r in episodes if r["method"] == "base") / 2 == base_rate
    singles = [f"single:{c}" for c in CAPS]
    expected = {"base", "trace", *singles, "oracle", "merged_linear", "merged_ties", "mixture", "grpo_target", "gepa",
                "describe", "trace_label", "trace_channel", "trace_gate"}
    assert set(results["methods"]) == expected, results["warnings"]
    summary = results["summary"]
    assert summary["instances"] == 2 and summary["trials"] == 1
    budget = sum(a["rollouts"] for a in results["adapters"])
    assert budget == 4  # two adapters x one step of 2 rollouts
    budgets = results["budgets"]
    assert budgets["trace"] == budgets["oracle"] == budgets["trace_gate"] == budget and budgets["base"] == 0
    # The baselines spend at most TRACE's budget: GRPO steps of 2 rollouts fit exactly, GEPA stops before it.
    assert budgets["grpo_target"] == budgets["mixture"] == budget
    assert 0 < budgets["gepa"] <= budget

    # Every method played both held-out instances once, and the ledger counted exactly those episodes.
    # The oracle reuses the single adapters' episodes, trace_channel trace's (channel is the main scoring); the
    # curve's marks below the full budget play their own. A routed method plays only the instances routed to an
    # adapter: the others are the base row's episodes.
    decisions = RoutingDecisions.model_validate_json((project / params.routing.out_dir / "decisions.json").read_text())
    routed = {"trace": decisions.full, "trace@2": decisions.marks["2"], "trace_label": decisions.routers["label"],
              "trace_gate": decisions.routers["gate"]}
    to_adapter = {m: sum(bool(decisions.played_weights(r)) for r in s.routes) for m, s in routed.items()}
    ledger = json.loads((out / "ledger.json").read_text())
    played = ledger["rollouts"]["evaluation"]
    reused = {"oracle", "trace_channel"}
    want = {m: to_adapter.get(m, 2) for m in (expected - reused) | {"trace@2", "grpo_target@2", "gepa@2"}}
    assert played == {m: n for m, n in want.items() if n}
    for method in expected:
        groups = list((out / "trajectories").glob(f"{method.replace(':', '-')}/group*.jsonl"))
        assert bool(groups) == (method not in reused and want[method] > 0), method  # one group per adapter choice
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

    # Every router (issue #30): routed by stage routing, scored against the base row's programmatic ground truth.
    decisions_file = RoutingDecisions.model_validate_json(
        (project / params.routing.out_dir / "decisions.json").read_text())
    assert set(decisions_file.routers) == {"channel", "label", "gate"} and decisions_file.full.scoring == "channel"
    assert decisions_file.routers["gate"].distractors_to_base is not None and list(decisions_file.gates) == [
        "gate.json"]
    routers = results["routers"]
    assert set(routers["truth"]) == {i.instance_id for i in held_out_instances(params)}
    assert set(routers["routers"]) == {"channel", "label", "gate"}
    assert routers["routers"]["gate"]["method"] == "trace_gate" and routers["routers"]["channel"]["method"] in (
        "trace_channel", "trace")
    header, *rows = (out / "routing.csv").read_text().splitlines()
    assert header == "router,instances,accuracy,majority_baseline,distractors_to_base,trace_success,oracle_success"
    assert [r.split(",")[0] for r in rows] == ["channel", "label", "gate"]
    # Leakage guard on the data the gate actually trained on: no evaluation instance, no evaluation seed.
    gate = json.loads((project / params.routing.out_dir / "gate" / "gate.json").read_text())
    held = held_out_instances(params)
    assert {"synthetic", "distractor", "baseline"} == {row["source"] for row in gate["training"]}
    assert not {row["instance_id"] for row in gate["training"]} & {i.instance_id for i in held}
    assert not ({(row["family"], row["seed"], row["index"]) for row in gate["training"]}
                & {(i.family, i.seed, i.index) for i in held})

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

    # A re-run with the same settings routes nothing (the full set and the curve's mark each have their saved
    # probabilities), trains nothing and plays nothing: the outputs come back identical.
    routing_out = project / params.routing.out_dir
    # channel: the tasks and the distractors, for the full set and the mark; label: the full set's. The gate is
    # retrained (seconds), and its decisions and record come back byte for byte.
    assert len(list((routing_out / "probabilities").glob("*.json"))) == 6
    decisions = (routing_out / "decisions.json").read_text()
    gate_file = (routing_out / "gate" / "gate.json").read_bytes()
    record = (project / params.baselines.out_dir / "baselines.json").read_text()
    before = {p.name: p.read_text() for p in (out / "trajectories").rglob("*.jsonl")}
    loads = len(tiny.loads)
    from trace_core.routing.router import Router

    def no_routing(self, tasks):
        raise AssertionError("routed again")

    monkeypatch.setattr(Router, "probabilities", no_routing)
    routing_stage.run(params, progress=False, base=tiny.agent())
    assert (routing_out / "decisions.json").read_text() == decisions and len(tiny.loads) == loads  # no model
    assert (routing_out / "gate" / "gate.json").read_bytes() == gate_file
    baselines_stage.run(params, progress=False, base=tiny.agent())
    assert (project / params.baselines.out_dir / "baselines.json").read_text() == record
    assert len(tiny.loads) == loads + 1  # GEPA's playing model; both trained baselines reused (no training copy)
    again = stage.run(params, progress=False, base=tiny.agent())
    assert again == metrics
    assert {p.name: p.read_text() for p in (out / "trajectories").rglob("*.jsonl")} == before
    assert len(tiny.loads) == loads + 2  # the one shared model of the evaluation
    assert json.loads((out / "ledger.json").read_text()) == ledger


CAPS_BY_FAMILY = {f: c for c, f in CAPS.items()}


class Killed(BaseException):
    """A kill while a baseline plays."""


def test_provisional_tables_come_before_and_between_the_baselines(staged, tiny_model, tokenizer, monkeypatch,
                                                                   tmp_path):
    from trace_core import status
    from trace_core.training.ledger import RolloutLedger

    project = staged
    tiny = TinyBase(tiny_model, tokenizer)
    play, kill = stage.Arena.play, set()

    def play_or_kill(self, method, *args, **kwargs):
        if method in kill:
            raise Killed
        return play(self, method, *args, **kwargs)

    monkeypatch.chdir(project)
    monkeypatch.setattr(stage.Arena, "play", play_or_kill)
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
    assert results["methods"] == ["base", *(f"single:{c}" for c in CAPS), "trace", "trace_label", "trace_channel",
                                  "trace_gate", "oracle", "merged_linear", "merged_ties", "describe"]
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


def test_no_adapter_learned_keeps_the_routed_rows_and_the_equal_budget_baselines(staged, tiny_model, tokenizer,
                                                                                  monkeypatch, tmp_path):
    """The gate dropped every adapter (the records carry no verdict): TRACE's routed rows are the base agent's own
    episodes, the baselines still spend the rollouts TRACE spent, and the rows made of adapters are left out."""
    monkeypatch.chdir(staged)
    tiny = TinyBase(tiny_model, tokenizer)
    params = _params(staged, **{
        "training.keep_unlearned": False, "routing.out_dir": str(tmp_path / "routing"),
        "baselines.out_dir": str(tmp_path / "baselines"), "evaluation.out_dir": str(tmp_path / "evaluation"),
        "evaluation.methods": ["base", "trace", "single", "oracle", "merged_linear", "grpo_target"]})
    routed = routing_stage.run(params, progress=False, base=tiny.agent())
    assert routed["adapters"] == 2 and routed["learned"] == 0 and routed["dropped"] == 2
    assert baselines_stage.run(params, progress=False, base=tiny.agent())["grpo_target/rollouts"] == 4
    stage.run(params, progress=False, base=tiny.agent())
    for name in ("trajectories", "ledger.json", "results.json", "table.md", "report.html", "routing.csv",
                 "metrics.json", "curve.csv", "confusion.csv", "transfer.csv", "episodes.csv"):  # its DVC outputs
        assert (tmp_path / "evaluation" / name).exists(), name
    results = json.loads((tmp_path / "evaluation" / "results.json").read_text())
    assert results["methods"] == ["base", "trace", "oracle", "grpo_target"], results["warnings"]
    assert any("no adapter passed the gate: single, merged_linear not evaluated" in w for w in results["warnings"])
    assert results["budgets"]["trace"] == results["budgets"]["grpo_target"] == 4
    methods = results["summary"]["methods"]
    assert methods["trace"]["vs_reference"]["difference"] == 0.0  # the base agent's own episodes
    played = json.loads((tmp_path / "evaluation" / "ledger.json").read_text())["rollouts"]["evaluation"]
    assert "trace" not in played and played["base"] == 2 and played["grpo_target"] == 2
    assert results["routers"]["routers"]["channel"]["method"] == "trace"  # routing is still scored


def test_held_out_clash_is_refused(project, tmp_path):
    # A baseline that rolled out the evaluation's tasks (under other ids): evaluating them would score on what
    # analysis saw.
    params = _params(project, **{"baseline.out_dir": str(tmp_path)})
    held_out = held_out_instances(params)
    renamed = [i.model_copy(update={"instance_id": f"renamed-{n}"}) for n, i in enumerate(held_out)]
    (tmp_path / "instances.jsonl").write_text("".join(i.model_dump_json() + "\n" for i in renamed))
    with pytest.raises(StageInputError, match="rolled out by the baseline"):
        check_held_out(held_out, params)
    check_held_out(held_out, _params(project))  # the project's own baseline is disjoint


def test_methods_need_base_and_oracle_needs_single(project):
    params = _params(project, **{"evaluation.methods": ["trace"]})
    with pytest.raises(stage.EvaluationError, match="must include base"):
        stage._methods(params, [object()], [object()], [])
    params = _params(project, **{"evaluation.methods": ["base", "oracle"]})
    with pytest.raises(stage.EvaluationError, match="oracle without single"):
        stage._methods(params, [object()], [object()], [])


def test_remote_policy_is_refused(project):
    params = _params(project, **{"policy.backend": "openai", "policy.base_url": "http://127.0.0.1:9/v1",
                                 "policy.model": "m"})
    with pytest.raises(stage.EvaluationError, match="policy.backend=local"):
        stage.run(params, progress=False)
