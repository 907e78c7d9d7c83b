"""`trace status`: each stage's state read from a project's output folders, and the stage a live `dvc repro` holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trace_core import cli, status
from trace_core.cli import load


@pytest.fixture
def params(tmp_project):
    # 8 steps whatever the default: the fixtures below write checkpoints up to step 6.
    return load(tmp_project / "params.yaml", {"training.max_steps": 8})


def _write(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def _ledger(path: Path, stage: str, name: str, n: int) -> None:
    _write(path, {"schema_version": "1", "rollouts": {stage: {name: n}}, "seeds": {stage: {name: n // 8}}})


def _record(cid: str, **fields) -> dict:
    """An adapter_record.json as stage training writes it (trace_core.schemas.AdapterRecord)."""
    from trace_core.schemas import AdapterRecord

    return AdapterRecord(capability_id=cid, **fields).model_dump(mode="json")


def _eval(cid: str, base: tuple[int, int, float], adapter: tuple[int, int, float]) -> dict:
    """An eval.json (trace_core.schemas.AdapterEval): (successes, episodes, mean reward) of each side."""
    from trace_core.schemas import AdapterEval

    def side(s, n, r):
        return {"episodes": n, "successes": s, "success_rate": s / n, "success_ci": (0.0, 1.0), "mean_reward": r}

    return AdapterEval(capability_id=cid, seeds=list(range(base[1])), base=side(*base), adapter=side(*adapter),
                       difference={"success_rate": 0.0, "ci": (0.0, 0.0), "improved": 0, "regressed": 0,
                                   "method": "paired"}).model_dump(mode="json")


def _results(provisional: bool = False, pending: list[str] | None = None) -> dict:
    """A results.json (trace_core.schemas.EvaluationResults) with nothing in it but its flags."""
    from trace_core.schemas import EvaluationResults

    return EvaluationResults(provisional=provisional, pending=pending or [], summary={}, methods=[], budgets={},
                             routing=None, oracle_choice={}, family_capability={}, transfer={}, champions=[],
                             curve=[], warnings=[], adapters=[]).model_dump(mode="json")


def _rows(params, root) -> dict[str, status.Row]:
    rows = status.report(params, root)
    assert [r.name for r in rows] == ["bootstrap", "baseline", "analysis", "synthesis", "training", "routing",
                                      "baselines", "evaluation"]
    return {r.name: r for r in rows}


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_fresh_project_has_nothing_started(params, tmp_project):
    rows = _rows(params, tmp_project)
    assert {name: r.state for name, r in rows.items()} == {name: status.PENDING for name in rows}
    assert [c.name for c in rows["training"].children] == params.synthesis.capabilities
    assert "0 rollouts" in rows["baselines"].detail


def test_partial_and_finished_outputs_are_counted(params, tmp_project):
    root = tmp_project
    _write(root / "artifacts/bootstrap/metrics.json", {"enabled": True, "steps": 32, "dialogues": 64,
                                                       "seconds_total": 1707.7})
    (root / "artifacts/bootstrap/model").mkdir()
    _write(root / "artifacts/baseline/trajectories.jsonl", '{"a": 1}\n{"a": 2}\n{"a": 3}\n{"torn": ')
    done, training, skipped, *rest = params.synthesis.capabilities
    for cid in params.synthesis.capabilities:
        _write(root / f"artifacts/synthesis/{cid}/spec.json",
               {"status": "not_selected" if cid == skipped else "ready", "reason": "passed the harness; more"})
    folder = root / "artifacts/training" / done
    _write(folder / "adapter_record.json", _record(done, adapter_sha256="ab", status="trained", rollouts=416))
    _write(folder / "eval.json", _eval(done, (1, 64, 0.02), (3, 64, 0.11)))
    _ledger(folder / "ledger.json", "training", done, 416)
    work = root / "artifacts/resume/training" / training  # a run in progress (trace_core.runs.resume_dir)
    (work / "checkpoints/checkpoint-2").mkdir(parents=True)
    _write(work / "checkpoints/checkpoint-6/trainer_state.json",
           {"global_step": 6, "log_history": [{"step": 5, "reward": 0.1}, {"step": 6, "reward": 0.6021,
                                                                          "step_time": 2481.75}]})
    _ledger(work / "ledger.json", "training", training, 160)

    rows = _rows(params, root)
    assert rows["bootstrap"].state == status.DONE and "32 SFT steps on 64 dialogues, 1,708 s" in rows["bootstrap"].detail
    assert rows["baseline"].state == status.PARTIAL and rows["baseline"].detail == "3 episodes played"
    assert rows["synthesis"].state == status.DONE
    assert rows["synthesis"].children[0].detail == "ready: passed the harness"
    by_cap = {c.name: c for c in rows["training"].children}
    assert by_cap[done].state == status.DONE
    assert by_cap[done].detail == "416 rollouts; held-out successes 1/64 -> 3/64, mean reward 0.020 -> 0.110"
    assert by_cap[training].state == status.PARTIAL
    left = params.training.max_steps - 6  # at the median logged step time, 2,482 s (the only one logged)
    minutes = round(left * 2481.75 / 60)
    assert by_cap[training].detail == (f"checkpoint at step 6/{params.training.max_steps} (step 6: mean reward "
                                       f"0.60, 2,482 s); ~{minutes // 60} h {minutes % 60} min of steps left "
                                       "(median step 2,482 s); 160 rollouts spent")
    assert by_cap[skipped].state == status.SKIPPED
    assert all(by_cap[c].state == status.PENDING for c in rest)
    assert rows["training"].state == status.PARTIAL
    # TRACE's budget for the baselines: the trained adapters' rollouts only
    assert "budget for grpo_target, gepa, mixture: 416 rollouts" in rows["baselines"].detail


def test_evaluation_counts_episodes_per_method_and_baseline_progress(params, tmp_project):
    out = tmp_project / "artifacts/evaluation"
    baselines = tmp_project / "artifacts/baselines"
    _write(out / "trajectories/base/group0.jsonl", "{}\n" * 40)
    _write(out / "trajectories/single-tool_call_precision/group0.jsonl", "{}\n" * 7)
    _write(baselines / "gepa/episodes.jsonl", "{}\n" * 5)  # GEPA before its first history.json
    (baselines / "mixture").mkdir()  # stage baselines makes every folder; an empty one shows as nothing yet
    row = _rows(params, tmp_project)["baselines"]
    assert {c.name: c.detail for c in row.children} == {"gepa": "5/0 rollouts, 0 candidates scored"}
    _write(baselines / "gepa/history.json", {"finished": False, "budget_rollouts": 1600, "candidates": [{}, {}]})
    _write(baselines / "gepa/episodes.jsonl", "{}\n" * 26)
    _ledger(baselines / "grpo_target/ledger.json", "training", "grpo_target", 96)
    (baselines / "grpo_target/checkpoints/checkpoint-4").mkdir(parents=True)
    # TRACE's budget, 416 rollouts; GRPO on the target tasks has spent 96 of them, 64 of those in 4 logged steps of
    # 16 rollouts and 1,200 s: 18.75 s per rollout, so the 320 left take ~100 min.
    cid = params.synthesis.capabilities[0]
    _write(tmp_project / "artifacts/training" / cid / "adapter_record.json",
           _record(cid, status="trained", rollouts=416))
    _write(baselines / "grpo_target/checkpoints/checkpoint-4/trainer_state.json", {"log_history": [
        {"step": n, "reward": 0.1, "step_time": t, "rollouts/rollouts": 16.0} for n, t in enumerate((200, 400, 250, 350))
    ]})
    _ledger(baselines / "mixture/ledger.json", "training", "mixture", 1600)
    _write(baselines / "mixture/adapter_record.json", _record("mixture", status="trained", budget_rollouts=1600))

    row = _rows(params, tmp_project)["baselines"]
    assert row.state == status.PARTIAL
    details = {c.name: (c.state, c.detail) for c in row.children}
    assert details["gepa"] == (status.PARTIAL, "26/1600 rollouts, 2 candidates scored")
    assert details["grpo_target"] == (
        status.PARTIAL,
        "96/416 rollouts, checkpoint at step 4 (step 3: mean reward 0.10, 350 s); ~1 h 40 min left (18.8 s per rollout)",
    )
    assert details["mixture"] == (status.DONE, "1600/1600 rollouts")

    row = _rows(params, tmp_project)["evaluation"]
    assert row.state == status.PARTIAL
    expected = len(params.tasks.families) * params.evaluation.instances_per_family * params.evaluation.trials
    details = {c.name: (c.state, c.detail) for c in row.children}
    assert details["base"] == (status.PARTIAL, f"40/{expected} held-out episodes")
    assert details["single-tool_call_precision"] == (status.PARTIAL, f"7/{expected} held-out episodes")

    _write(out / "results.json", _results(provisional=True, pending=["gepa"]))
    _write(out / "table.md", "| method |\n")
    row = _rows(params, tmp_project)["evaluation"]
    assert row.state == status.PARTIAL and row.detail.startswith("provisional table (gepa still to run)")
    _write(out / "results.json", _results())
    assert _rows(params, tmp_project)["evaluation"].state == status.DONE


def test_stage_records_of_another_shape_are_unreadable_not_done(params, tmp_project):
    """adapter_record.json, eval.json and results.json are read as their typed records (trace_core.schemas): a file
    of another shape shows as unreadable instead of a finished stage with missing numbers."""
    cid = params.synthesis.capabilities[0]
    folder = tmp_project / "artifacts/training" / cid
    _write(folder / "adapter_record.json", _record(cid, status="trained", rollouts=8))
    _write(folder / "eval.json", {"base": {"successes": 1, "episodes": 64}, "adapter": {"successes": 3}})
    child = next(c for c in _rows(params, tmp_project)["training"].children if c.name == cid)
    assert (child.state, child.detail) == (status.UNREADABLE, str(folder / "eval.json"))
    _write(folder / "eval.json", _eval(cid, (1, 4, 0.5), (2, 4, 0.75)))
    child = next(c for c in _rows(params, tmp_project)["training"].children if c.name == cid)
    assert child.state == status.DONE and "held-out successes 1/4 -> 2/4" in child.detail

    out = tmp_project / "artifacts/evaluation"
    _write(out / "results.json", {"methods": {}, "provisional": "maybe"})
    _write(out / "table.md", "| method |\n")
    assert _rows(params, tmp_project)["evaluation"].state == status.UNREADABLE


def test_routing_and_baselines_read_their_typed_records(params, tmp_project):
    from trace_core.schemas import BaselineOutcome, BaselinesRecord, RouteDecision, RoutingDecisions, RoutingSet

    routing = tmp_project / "artifacts/routing"
    _write(routing / "probabilities/k.json", [{"A": 1.0}])
    row = _rows(params, tmp_project)["routing"]
    assert row.state == status.PARTIAL and row.detail == "1 sets of router probabilities saved"
    routes = [RouteDecision(instance_id=i, family="f", probabilities={"A": 0.2, "B": 0.8}, chosen=c, weights={})
              for i, c in (("a", ["x"]), ("b", []))]
    full = RoutingSet(adapters=["x"], rollouts=8, options=[], scoring="channel", routes=routes,
                      accuracy={"accuracy": 0.5, "chance_uniform": 0.5})
    _write(routing / "decisions.json", RoutingDecisions(
        run_key="k", router={}, adapters={"x": "ab"}, instances=["a", "b"], family_capability={"f": "x"},
        full=full).model_dump(mode="json"))
    row = _rows(params, tmp_project)["routing"]
    assert (row.state, row.detail) == (status.DONE, "2 instances, 1 routed to an adapter; accuracy 50% (chance 50%)")
    # The training gate dropped x: its route plays the base agent.
    _write(routing / "decisions.json", RoutingDecisions(
        run_key="k", router={}, adapters={"x": "ab"}, learned=[], instances=["a", "b"], family_capability={"f": "x"},
        full=full).model_dump(mode="json"))
    assert _rows(params, tmp_project)["routing"].detail == (
        "2 instances, 1 routed to an adapter (0 to one of the 0 learned of 1; the others play the base agent); "
        "accuracy 50% (chance 50%)")
    _write(tmp_project / "artifacts/baselines/baselines.json", BaselinesRecord(
        budget=8, marks=[8], adapters={"x": "ab"},
        baselines=[BaselineOutcome(name="grpo_target", status="done", rollouts=8, record={}),
                   BaselineOutcome(name="gepa", status="skipped", warning="gepa not run: too small")],
    ).model_dump(mode="json"))
    row = _rows(params, tmp_project)["baselines"]
    assert (row.state, row.detail) == (status.DONE, "budget 8 rollouts")
    assert [(c.name, c.state, c.detail) for c in row.children] == [
        ("grpo_target", status.DONE, "8 rollouts"), ("gepa", status.SKIPPED, "gepa not run: too small")]
    _write(routing / "decisions.json", "{torn")
    assert _rows(params, tmp_project)["routing"].state == status.UNREADABLE


def test_the_stage_a_live_dvc_repro_writes_is_running(params, tmp_project):
    cid = params.synthesis.capabilities[1]
    folder = tmp_project / "artifacts/training" / cid
    (folder / "checkpoints/checkpoint-4").mkdir(parents=True)

    def lock(pid: int) -> None:
        _write(tmp_project / ".dvc/tmp/rwlock",
               {"read": {}, "write": {str(folder): {"pid": pid, "cmd": "dvc repro"}}})

    lock(os.getpid())
    rows = _rows(params, tmp_project)
    child = next(c for c in rows["training"].children if c.name == cid)
    assert child.state == status.RUNNING and f"dvc repro (pid {os.getpid()}) is writing it" in child.detail
    assert "checkpoint at step 4" in child.detail
    assert rows["training"].state == status.RUNNING

    lock(_dead_pid())  # a killed run leaves its entry behind: not running
    child = next(c for c in _rows(params, tmp_project)["training"].children if c.name == cid)
    assert child.state == status.PARTIAL


def test_unreadable_files_never_break_the_report(params, tmp_project):
    _write(tmp_project / ".dvc/tmp/rwlock", "{not json")
    _write(tmp_project / "artifacts/bootstrap/metrics.json", "{half")
    _write(tmp_project / "artifacts/analysis/capabilities.json", "")
    _write(tmp_project / "artifacts/training" / params.synthesis.capabilities[0] / "ledger.json", "[1, 2")
    rows = _rows(params, tmp_project)
    assert rows["bootstrap"].state == rows["analysis"].state == status.PENDING
    assert status.render(list(rows.values()))

    # Well-formed JSON of another shape: that stage is "unreadable", the others still report.
    _write(tmp_project / "artifacts/analysis/capabilities.json", {"selected": None})
    cid = params.synthesis.capabilities[0]
    _write(tmp_project / "artifacts/training" / cid / "ledger.json", {"rollouts": None})
    _write(tmp_project / ".dvc/tmp/rwlock", {"write": {str(tmp_project / "artifacts/baseline"): {"pid": -1},
                                                       str(tmp_project / "artifacts/bootstrap"): {"pid": 10**30}}})
    rows = _rows(params, tmp_project)
    assert rows["analysis"].state == rows["training"].state == status.UNREADABLE
    assert rows["analysis"].detail.startswith("TypeError")
    assert rows["baseline"].state == rows["bootstrap"].state == status.PENDING  # pid -1 and an overflow: not alive


def test_cli_status_prints_text_and_json(tmp_project, monkeypatch, capsys):
    monkeypatch.chdir(tmp_project)
    _write(tmp_project / "artifacts/analysis/capabilities.json", {"selected": ["tool_call_precision"]})
    assert cli.main(["status"]) == 0
    text = capsys.readouterr().out
    assert "analysis     done         selected: tool_call_precision" in text
    assert cli.main(["status", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data[2] == {"name": "analysis", "state": "done", "detail": "selected: tool_call_precision", "children": []}
    monkeypatch.chdir(tmp_project.parent)  # --root alone finds the project's params.yaml
    assert cli.main(["status", "--root", str(tmp_project)]) == 0
    assert "analysis     done" in capsys.readouterr().out
    assert cli.main(["status", "--root", str(tmp_project), "-S", "analysis.out_dir=elsewhere"]) == 0
    assert "analysis     not started" in capsys.readouterr().out
