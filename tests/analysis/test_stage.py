"""The analysis stage end to end on a small real baseline folder: outputs, byte-identical re-runs, the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from trace_core import cli
from trace_core.agents.rollout import write_parquet
from trace_core.analysis import run
from trace_core.analysis.base import AnalysisError
from trace_core.config import load_params
from trace_core.envs.oracle import replay_reference
from trace_core.envs.procedural import _retail as R
from trace_core.envs.procedural import generate


@pytest.fixture(scope="module")
def baseline_dir(tmp_path_factory) -> Path:
    """Correct agents on 4 compound instances and agents that stop after the first write on 4 others."""
    from trace_core.envs.tau2_env import Tau2Environment

    env = Tau2Environment("retail", "compact")
    out = tmp_path_factory.mktemp("baseline")
    instances, trajectories = [], []
    for index in range(8):
        inst = generate("compound", 5, index, 1)
        actions = None
        if index % 2:
            first = next(i for i, a in enumerate(inst.reference_actions) if a.name in R.WRITE_TOOLS)
            actions = inst.reference_actions[: first + 1]
        ep = replay_reference(env, inst, actions=actions)
        score = ep.score()
        t = ep.trajectory(policy="scripted")
        trajectories.append(t.model_copy(update={"reward": score.reward, "success": score.reward == 1.0}))
        instances.append(inst)
    write_parquet(trajectories, out / "trajectories.parquet")
    (out / "instances.jsonl").write_text("".join(i.model_dump_json() + "\n" for i in instances))
    return out


def _params(project: Path, *labellers: str):
    return load_params(project / "params.yaml", {"analysis.labellers": list(labellers), "analysis.bootstrap_samples": 200})


def test_stage_writes_dictionary_labels_report_and_is_byte_identical(tmp_project, baseline_dir):
    params = _params(tmp_project, "programmatic")
    out = tmp_project / "analysis"
    metrics = run(params, out, baseline_dir)
    d = json.loads((out / "capabilities.json").read_text())
    assert d["selected"] == ["multi_step_completion"]
    assert metrics["selected"] == 1 and metrics["controls_rejected"] is True and metrics["failed"] == 4
    cap = next(c for c in d["capabilities"] if c["capability_id"] == "multi_step_completion")
    assert cap["stats"]["coverage_mean"] == 1.0 and cap["stats"]["delta_mean"] == 1.0 and cap["labeller"] == "programmatic"
    labels = pd.read_parquet(out / "labels.parquet")
    assert len(labels) == 8 * 6 + 8 * 10 * 2  # programmatic: 1 run x 6 capabilities; controls: 10 runs x 2
    assert set(labels["label"]) == {"NA", "PRESENT", "LACKING"}
    report = (out / "report.html").read_text()
    assert report.count("<svg") == 2 and "multi_step_completion" in report and "required writes attempted" in report

    first = {name: (out / name).read_bytes() for name in ("capabilities.json", "report.html", "metrics.json")}
    shutil.rmtree(out)
    run(params, out, baseline_dir)
    assert {name: (out / name).read_bytes() for name in first} == first


def test_embedding_candidates_join_the_dictionary(tmp_project, baseline_dir):
    params = load_params(tmp_project / "params.yaml", {
        "analysis.labellers": ["programmatic", "embedding"], "analysis.bootstrap_samples": 100,
        "analysis.embedding.min_steps": 2, "analysis.embedding.clusters": 4,
        "analysis.embedding.min_failure_lift": 1.0,  # any cluster at least as failure-heavy as the whole
    })
    run(params, tmp_project / "analysis", baseline_dir)
    d = json.loads((tmp_project / "analysis" / "capabilities.json").read_text())
    assert d["labellers"] == ["control", "embedding", "programmatic"]
    emb = [c for c in d["capabilities"] if c["labeller"] == "embedding"]
    assert emb and all(c["excerpts"] for c in emb)
    runs = params.analysis.embedding.runs
    labels = pd.read_parquet(tmp_project / "analysis" / "labels.parquet")
    for cap in emb:  # one labelling run per k-means seed, every trajectory judged in each, K of N scaled to them
        rows = labels[labels["capability_id"] == cap["capability_id"]]
        assert len(rows) == runs * 8 and sorted(set(rows["run"])) == list(range(runs))
        assert cap["stats"]["runs"] == runs and cap["stats"]["runs_required"] == 8
        lacking = rows[rows["label"] == "LACKING"]
        assert set(lacking["trajectory_id"]) and cap["definition"].count("k-means runs") == 1
        # Selected only with a Δ interval above min_delta_ci_low (no programmatic detector names them).
        assert not cap["selected"] or cap["stats"]["delta_ci"][0] > d["thresholds"]["min_delta_ci_low"]


def test_cli_prints_the_selection_and_reports_missing_input(tmp_project, baseline_dir, capsys, monkeypatch):
    monkeypatch.chdir(tmp_project)
    args = ["analysis", "-S", "analysis.labellers=[programmatic]", "-S", "analysis.bootstrap_samples=100"]
    assert cli.main([*args, "--baseline-dir", str(baseline_dir)]) == 0
    out = capsys.readouterr().out
    assert "selected: multi_step_completion" in out and "report:" in out
    assert cli.main([*args, "--baseline-dir", str(tmp_project / "nowhere")]) == 1
    assert "run the baseline stage first" in capsys.readouterr().err
    with pytest.raises(AnalysisError):
        run(_params(tmp_project, "programmatic"), tmp_project / "x", tmp_project / "nowhere")


def test_in_memory_analysis_matches_the_stage(tmp_project, baseline_dir):
    from trace_core.analysis import analyse
    from trace_core.analysis.stage import read_baseline

    params = _params(tmp_project, "programmatic")
    run(params, tmp_project / "analysis", baseline_dir)
    trajectories, instances = read_baseline(baseline_dir)
    dictionary, table, items = analyse(params, trajectories, instances)
    written = (tmp_project / "analysis" / "capabilities.json").read_text()
    assert dictionary.model_dump_json(indent=2) + "\n" == written
    assert len(table) == len(pd.read_parquet(tmp_project / "analysis" / "labels.parquet")) and len(items) == 8
    assert all(item.instance is not None for item in items)


@pytest.mark.parametrize("case", ["empty", "other_run"])
def test_instances_that_do_not_match_the_trajectories_fail_naming_the_first_missing_id(
    tmp_project, baseline_dir, tmp_path, case
):
    """Before: every reference-based label silently turned NA and the dictionary read "no deficits"."""
    broken = tmp_path / "baseline"
    shutil.copytree(baseline_dir, broken)
    lines = (broken / "instances.jsonl").read_text().splitlines()
    if case == "empty":
        (broken / "instances.jsonl").write_text("")
    else:  # the same tasks under another run's ids
        renamed = [json.loads(line) for line in lines]
        for inst in renamed:
            inst["instance_id"] = "other-" + inst["instance_id"]
        (broken / "instances.jsonl").write_text("".join(json.dumps(i) + "\n" for i in renamed))
    first = pd.read_parquet(broken / "trajectories.parquet")["instance_id"].iloc[0]
    with pytest.raises(AnalysisError, match=f"instances.jsonl hold no instance '{first}'.*8 of 8.*dvc repro baseline"):
        run(_params(tmp_project, "programmatic"), tmp_project / "analysis", broken)
    assert not (tmp_project / "analysis" / "capabilities.json").exists()


def test_dropping_vacuous_successes_keeps_successes_that_needed_the_agent(tmp_project, baseline_dir):
    """On τ² compound tasks doing nothing never succeeds: every success stays, the verdict is unchanged."""
    from trace_core.analysis import analyse
    from trace_core.analysis.stage import read_baseline

    trajectories, instances = read_baseline(baseline_dir)
    params = load_params(tmp_project / "params.yaml", {"analysis.labellers": ["programmatic"],
                                                       "analysis.bootstrap_samples": 200,
                                                       "analysis.drop_vacuous_successes": True})
    dictionary, _, items = analyse(params, trajectories, instances)
    assert dictionary.target["vacuous_successes_dropped"] == 0 and len(items) == 8
    assert dictionary.selected == ["multi_step_completion"]
