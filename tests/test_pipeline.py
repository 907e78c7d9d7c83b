"""The orchestration shell: params.yaml, dvc.yaml, prefect.yaml, the `trace` CLI, the Prefect flow and its MLflow
records. The stages' real work is replaced by tiny fakes here (their own tests live beside their modules)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trace_core import cli
from trace_core.config import load_params

ROOT = Path(__file__).resolve().parents[1]
PARAMS = ROOT / "params.yaml"


def _dvc_yaml() -> dict:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())


# --------------------------------------------------------------------------------------------- params & dvc.yaml
def test_params_yaml_loads():
    params = load_params(PARAMS)
    assert params.bootstrap.out_dir == "artifacts/bootstrap"
    assert params.baseline.out_dir == "artifacts/baseline"
    assert params.tracking.mlflow_uri.startswith("sqlite:///mlflow/")


def test_dvc_stages_match_params_code_and_layout():
    from flows.pipeline import STAGES
    from tasks import STAGE_CODE, STAGE_SECTIONS

    raw_params = yaml.safe_load(PARAMS.read_text())
    stages = _dvc_yaml()["stages"]
    assert list(stages) == list(STAGES)
    outs_so_far: set[str] = set()
    for name, stage in stages.items():
        cmd = f"python -m flows.pipeline --stage {name}"
        if "foreach" in stage:  # one entry per capability; ${item} stands for the entry's name
            assert stage["foreach"] == "${synthesis.capabilities}"
            stage = stage["do"]
            cmd += " --capability ${item}"
        assert stage["cmd"] == cmd
        for key in stage["params"]:  # a section, or one key of a section ("evaluation.ci")
            section, _, leaf = key.partition(".")
            assert section in raw_params and (not leaf or leaf in raw_params[section]), f"{name}: {key} not in params"
        assert tuple(stage["params"]) == STAGE_SECTIONS[name], f"{name}: dvc params != tasks.STAGE_SECTIONS"
        assert set(STAGE_CODE[name]) <= set(stage["deps"]), f"{name}: tasks.STAGE_CODE not all in dvc deps"
        for dep in stage["deps"]:
            if dep.startswith("artifacts/"):  # an earlier stage's output, or a folder holding such outputs
                earlier = any(out == dep or out.startswith(f"{dep}/") for out in outs_so_far)
                assert earlier, f"{name}: {dep} is not (the folder of) an output of an earlier stage"
            else:
                assert (ROOT / dep).exists(), f"{name}: dependency {dep} does not exist"
        declared = stage["outs"] + stage.get("metrics", []) + stage.get("plots", [])
        outs = [next(iter(o)) if isinstance(o, dict) else o for o in declared]
        for out in outs:
            assert out.startswith(f"artifacts/{name}/"), f"{name}: {out} outside artifacts/{name}/"
        outs_so_far.update(outs)
    assert "data" in stages["baseline"]["deps"]
    assert "artifacts/baseline/metrics.json" in outs_so_far
    # Training checkpoints must survive a killed run: DVC deletes outputs before a stage runs unless persisted.
    (training_out,) = stages["training"]["do"]["outs"]
    assert training_out == {"artifacts/training/${item}": {"persist": True}}
    # Evaluation reads every adapter and environment, and resumes its episodes after a kill.
    evaluation = stages["evaluation"]
    assert {"artifacts/training", "artifacts/synthesis", "artifacts/bootstrap/model", "data"} <= set(evaluation["deps"])
    assert {"artifacts/evaluation/trajectories": {"persist": True, "cache": False}} in evaluation["outs"]
    plots = {next(iter(p)) if isinstance(p, dict) else p: p for p in evaluation["plots"]}
    assert set(plots) == {f"artifacts/evaluation/{n}" for n in ("curve.csv", "confusion.csv", "transfer.csv")}
    assert plots["artifacts/evaluation/confusion.csv"]["artifacts/evaluation/confusion.csv"]["template"] == "confusion"
    # Cached, or `dvc exp show` has no metrics for experiments (artifacts/ is git-ignored).
    assert evaluation["metrics"] == ["artifacts/evaluation/metrics.json"]
    # Evaluation routes and trains nothing: it reads the routing decisions and the baselines' outputs.
    assert {"artifacts/routing/decisions.json", "artifacts/baselines/baselines.json"} <= set(evaluation["deps"])
    assert "artifacts/evaluation/baselines" not in [next(iter(o)) if isinstance(o, dict) else o
                                                    for o in evaluation["outs"]]
    assert {"artifacts/training", "artifacts/bootstrap/model"} <= set(stages["routing"]["deps"])
    assert "artifacts/routing/decisions.json" in stages["routing"]["outs"]
    for name in ("grpo_target", "gepa", "mixture"):  # resumable after a kill
        assert {f"artifacts/baselines/{name}": {"persist": True, "cache": False}} in stages["baselines"]["outs"]


def _trace_core_imports(path: Path) -> set[str]:
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("trace_core."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("trace_core"):
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)  # `from trace_core import x`
    return names


def _module_file(name: str) -> Path | None:
    base = ROOT / Path(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


@pytest.mark.parametrize("stage", ["bootstrap", "baseline", "analysis", "synthesis", "training", "routing", "baselines",
                                   "evaluation"])
def test_stage_code_covers_every_trace_core_module_the_stage_imports(stage):
    from tasks import STAGE_CODE

    covered = [ROOT / p for p in STAGE_CODE[stage]]
    seen: set[Path] = set()
    entry = ROOT / "trace_core" / f"{stage}.py"
    todo = [entry] if entry.exists() else sorted((ROOT / "trace_core" / stage).glob("*.py"))
    while todo:
        file = todo.pop()
        if file in seen:
            continue
        seen.add(file)
        for name in _trace_core_imports(file):
            found = _module_file(name)
            if found is not None and found not in seen:
                todo.append(found)
    missing = sorted(
        str(f.relative_to(ROOT))
        for f in seen
        if f.name != "__init__.py" or f.parent != ROOT / "trace_core"
        if not any(f == c or c in f.parents for c in covered)
    )
    assert not missing, f"{stage} runs {missing}: add them to STAGE_CODE[{stage!r}] and to dvc.yaml deps"


def test_no_cached_output_holds_what_a_killed_run_resumes_from():
    """`dvc exp run` checks every cached output out at its dvc.lock version before it runs (forced), so a cached
    output written while the stage runs would lose a killed run's progress to the previous run's files
    (`test_dvc_exp_run_restores_cached_outputs_but_not_uncached_ones` shows it). A persisted output is therefore
    `cache: false`, or its stage keeps what it resumes from in trace_core.runs.resume_dir (training's checkpoints,
    synthesis' calibration trajectories) and writes the cached folder only with finished results."""
    resume_elsewhere = {"training", "synthesis"}  # tests/training/test_stage.py, tests/synthesis/test_stage.py
    resume_elsewhere.add("bootstrap")  # resumes nothing: it keeps finished weights for a re-run under the same key
    for name, stage in _dvc_yaml()["stages"].items():
        stage = stage.get("do", stage)
        for out in stage["outs"]:
            path, flags = next(iter(out.items())) if isinstance(out, dict) else (out, {})
            if flags.get("persist") and flags.get("cache", True):
                assert name in resume_elsewhere, f"{name}: {path} is persisted and cached; make it cache: false"


def test_dvc_exp_run_restores_cached_outputs_but_not_uncached_ones(tmp_path):
    """The DVC behaviour the layout above guards against, on a two-output toy stage killed in its second
    experiment: `dvc exp run` again restores the cached output to the first experiment's version and leaves the
    uncached one as the killed run left it."""
    dvc = Path(sys.executable).with_name("dvc")
    if not dvc.exists() or shutil.which("git") is None:
        pytest.skip("needs dvc next to this python, and git")
    (tmp_path / "params.yaml").write_text("p: 1\n")
    (tmp_path / "step.py").write_text(
        "import pathlib, sys, yaml\n"
        "p = yaml.safe_load(open('params.yaml'))['p']\n"
        "for name in ('cached', 'uncached'):\n"
        "    out = pathlib.Path(name); out.mkdir(exist_ok=True); f = out / 'state'\n"
        "    seen = f.read_text() if f.exists() else 'nothing'\n"
        "    pathlib.Path(f'seen-{name}').write_text(seen)\n"
        "    f.write_text(f'p={p} started' if pathlib.Path('kill').exists() else f'p={p} done')\n"
        "sys.exit(1 if pathlib.Path('kill').exists() else 0)\n")
    (tmp_path / "dvc.yaml").write_text(
        "stages:\n  step:\n    cmd: python step.py\n    deps: [step.py]\n    params: [p]\n    outs:\n"
        "      - cached:\n          persist: true\n"
        "      - uncached:\n          persist: true\n          cache: false\n")
    (tmp_path / ".gitignore").write_text("seen-*\nkill\n")
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t", "PATH": f"{dvc.parent}{os.pathsep}"
           f"{os.environ.get('PATH', '')}"}

    def sh(*cmd, check=True):
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert not check or proc.returncode == 0, proc.stdout + proc.stderr
        return proc

    sh("git", "init", "-q")
    sh(str(dvc), "init", "-q")
    sh(str(dvc), "repro", "-q")
    sh("git", "add", "-A")
    sh("git", "commit", "-qm", "first run")  # dvc.lock holds p=1's outputs
    (tmp_path / "kill").write_text("")
    assert sh(str(dvc), "exp", "run", "-S", "p=2", check=False).returncode != 0  # killed after writing its state
    (tmp_path / "kill").unlink()
    sh(str(dvc), "exp", "run", "-S", "p=2")
    assert (tmp_path / "seen-cached").read_text() == "p=1 done"  # the killed run's state was replaced
    assert (tmp_path / "seen-uncached").read_text() == "p=2 started"  # ... unless DVC does not cache it


def test_dvc_accepts_the_pipeline():
    dvc = Path(sys.executable).with_name("dvc")
    if not dvc.exists():
        pytest.skip("dvc not installed next to this python")
    proc = subprocess.run([str(dvc), "stage", "list"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "bootstrap" in proc.stdout and "baseline" in proc.stdout and "evaluation" in proc.stdout


def test_dvc_ignores_python_bytecode():
    # Folder deps (trace_core/envs, trace_core/agents) would otherwise change whenever Python writes a .pyc,
    # re-running hours of stages for nothing.
    lines = {line.strip() for line in (ROOT / ".dvcignore").read_text().splitlines()}
    assert lines & {"__pycache__", "__pycache__/", "**/__pycache__"}, ".dvcignore must ignore __pycache__/"


def test_data_dvc_tracks_the_exported_snapshot(tmp_path):
    spec = yaml.safe_load((ROOT / "data.dvc").read_text())
    (out,) = spec["outs"]
    assert out["path"] == "data" and out["md5"].endswith(".dir")
    written = cli.export_data(tmp_path / "data")
    assert len(written) == out["nfiles"]
    src = cli.tau2_domains_dir()
    for domain in cli.DATA_DOMAINS:
        for name in cli.DATA_FILES:
            assert (tmp_path / "data" / "tau2" / domain / name).read_bytes() == (src / domain / name).read_bytes()
    assert sum(p.stat().st_size for p in written) == out["size"]


def test_prefect_yaml_declares_the_local_deployment():
    from prefect.client.schemas.schedules import CronSchedule

    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    (dep,) = spec["deployments"]
    assert dep["name"] == "local"
    assert dep["work_pool"]["name"] == "trace-local"
    path, attr = dep["entrypoint"].split(":")
    assert (ROOT / path).exists()
    from flows import pipeline as module

    assert getattr(module, attr).name == "trace-pipeline"
    (schedule,) = dep["schedules"]
    CronSchedule(cron=schedule["cron"], timezone=schedule.get("timezone"))
    assert set(dep["parameters"]) <= set(module.pipeline.parameters.properties)
    missing = [stage for stage in module.STAGES if stage not in dep["description"]]
    assert not missing, f"prefect.yaml's description does not name {missing}"


def test_mlflow_folder_is_not_a_package():
    assert not (ROOT / "mlflow" / "__init__.py").exists()
    import mlflow

    assert Path(mlflow.__file__).resolve().parent != (ROOT / "mlflow").resolve()


# --------------------------------------------------------------------------------------------------------- CLI
def test_overrides_are_yaml_parsed():
    got = cli.parse_overrides(
        ["policy.batch_size=4", "model.path=Qwen/Qwen3-8B", "bootstrap.enabled=false", "user.base_url=",
         "tasks.families=[a, b]", "policy.temperature=0.7"]
    )
    assert got == {
        "policy.batch_size": 4,
        "model.path": "Qwen/Qwen3-8B",
        "bootstrap.enabled": False,
        "user.base_url": None,
        "tasks.families": ["a", "b"],
        "policy.temperature": 0.7,
    }
    params = cli.load(PARAMS, got | {"tasks.families": ["single_write"]})
    assert params.policy.batch_size == 4 and params.bootstrap.enabled is False
    for bad in ("policy", "=3", "policy..x=1"):
        with pytest.raises(ValueError):
            cli.parse_overrides([bad])


def test_smoke_script_overrides_load_and_keep_the_full_run_outputs_apart():
    """scripts/smoke.sh's overrides are valid params, and every stage after bootstrap writes outside the full run's
    artifacts/<stage>/ (the smoke shares only the base agent)."""
    proc = subprocess.run(["bash", "scripts/smoke.sh", "--print-overrides"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    params = cli.load(PARAMS, cli.parse_overrides(proc.stdout.split("\n")[:-1]))
    defaults = load_params(PARAMS)
    tracked = [Path(next(iter(o)) if isinstance(o, dict) else o) for s in _dvc_yaml()["stages"].values()
               for o in s.get("outs", [])]
    from flows.pipeline import STAGES

    for stage in STAGES[1:]:  # a new stage needs its own smoke out_dir
        smoke_dir = Path(getattr(params, stage).out_dir)
        assert smoke_dir != Path(getattr(defaults, stage).out_dir)
        assert not any(smoke_dir == t or t in smoke_dir.parents or smoke_dir in t.parents for t in tracked), smoke_dir
    assert params.bootstrap == defaults.bootstrap
    assert f"for stage in {' '.join(STAGES[1:])}; do" in (ROOT / "scripts/smoke.sh").read_text()
    help_text = subprocess.run(["bash", "scripts/smoke.sh", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert help_text.returncode == 0 and "--print-overrides" in help_text.stdout
    bad = subprocess.run(["bash", "scripts/smoke.sh", "--nope"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown option" in bad.stderr
    missing = subprocess.run(["bash", "scripts/smoke.sh", "-S"], cwd=ROOT, capture_output=True, text=True)
    assert missing.returncode == 2 and "needs KEY.PATH=VALUE" in missing.stderr


@pytest.mark.parametrize(
    "argv", [[], ["bootstrap"], ["baseline"], ["training"], ["routing"], ["baselines"], ["evaluation"], ["status"],
             ["export-data"]]
)
def test_cli_help(argv):
    proc = subprocess.run(
        [sys.executable, "-m", "trace_core.cli", *argv, "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout
    if not argv:
        assert "bootstrap" in proc.stdout and "baseline" in proc.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["baseline", "-S", "policy.batch_size=abc"], "batch_size"),
        (["baseline", "-S", "nosuchsection.x=1"], "nosuchsection"),
        (["bootstrap", "-S", "bootstrap.seed=0"], "bootstrap.seed"),  # equals baseline.seed
        (["bootstrap", "--params", "does/not/exist.yaml"], "not found"),
    ],
)
def test_cli_bad_params_exit_2(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_runs_stage_and_prints_table(tmp_project, monkeypatch, capsys):
    import trace_core.baseline

    monkeypatch.setattr(trace_core.baseline, "run", _fake_baseline)
    monkeypatch.chdir(tmp_project)
    assert cli.main(["baseline", "-S", "baseline.trials=2"]) == 0
    assert "| all | 0.25 |" in capsys.readouterr().out
    assert (tmp_project / "artifacts/baseline/trajectories.jsonl").exists()


def test_cli_training_reports_each_capability(tmp_project, monkeypatch, capsys):
    import trace_core.training

    monkeypatch.chdir(tmp_project)
    assert cli.main(["training", "--capability", "nothing_here"]) == 1  # no synthesis output yet
    assert "synthesis@nothing_here" in capsys.readouterr().err

    trained = {"status": "trained", "steps": 20, "rollouts": 352, "eval_episodes": 16, "base_success": 0.25,
               "adapter_success": 0.5, "success_difference": 0.25, "difference_ci_low": 0.0, "difference_ci_high": 0.5}
    metrics = {"per_capability": {"tool_call_precision": trained,
                                  "friendly_tone": {"status": "skipped", "reason": "environment spec status is unmapped"}}}
    monkeypatch.setattr(trace_core.training, "run", lambda params, out_dir, **kw: metrics)
    assert cli.main(["training", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "20 steps, 352 rollouts; held-out success 0.25 -> 0.50 (+0.25 [+0.00, +0.50], 16 seeds)" in out
    assert "skipped  environment spec status is unmapped" in out


@pytest.mark.parametrize("stage", ["routing", "baselines"])
def test_cli_routing_and_baselines_print_metrics_or_the_stage_error(stage, tmp_project, monkeypatch, capsys):
    import importlib

    from trace_core.inputs import StageInputError

    module = importlib.import_module(f"trace_core.{stage}")

    def refuse(params, out_dir, progress=True):
        raise StageInputError("artifacts/training/x does not match its record; re-run `dvc repro training@x`")

    monkeypatch.chdir(tmp_project)
    monkeypatch.setattr(module, "run", lambda params, out_dir, progress=True: {"instances": 4})
    assert cli.main([stage, "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out) == {stage: {"instances": 4}}
    monkeypatch.setattr(module, "run", refuse)
    assert cli.main([stage]) == 1
    assert f"trace {stage}: artifacts/training/x does not match its record" in capsys.readouterr().err


def test_cli_evaluation_prints_the_table_or_the_stage_error(tmp_project, monkeypatch, capsys):
    import trace_core.evaluation
    from trace_core.evaluation.stage import EvaluationError

    def fake(params, out_dir, progress=True):
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "table.md").write_text("| method | pass^1 |\n| base | 0.25 |\n")
        return {"base.pass1": 0.25}

    def refuse(params, out_dir, progress=True):
        raise EvaluationError("stage evaluation needs policy.backend=local")

    monkeypatch.chdir(tmp_project)
    monkeypatch.setattr(trace_core.evaluation, "run", fake)
    assert cli.main(["evaluation", "--quiet"]) == 0
    assert "| base | 0.25 |" in capsys.readouterr().out
    monkeypatch.setattr(trace_core.evaluation, "run", refuse)
    assert cli.main(["evaluation"]) == 1
    assert "trace evaluation: stage evaluation needs policy.backend=local" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- the flow, Prefect, MLflow
def _fake_bootstrap(params, out_dir=None):
    out = Path(out_dir)
    (out / "model").mkdir(parents=True, exist_ok=True)
    (out / "model" / "model.safetensors").write_bytes(b"weights")
    (out / "manifest.json").write_text(json.dumps({"base": params.model.path}))
    metrics = {"train_loss": 0.5, "dialogues": params.bootstrap.num_dialogues}
    (out / "metrics.json").write_text(json.dumps(metrics))
    return metrics


def _fake_analysis(params, out_dir=None, baseline_dir=None):
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("capabilities.json", "report.html", "labels.parquet"):
        (out / name).write_text("{}")
    metrics = {"selected": 2, "per_capability": {"multi_step_completion": {"coverage": 0.4, "selected": True}}}
    (out / "metrics.json").write_text(json.dumps(metrics))
    return metrics


def _fake_synthesis(params, out_dir=None, capability=None, progress=True):
    folder = Path(out_dir) / capability
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spec.json").write_text(json.dumps({"capability_id": capability, "status": "ready"}))
    return {"ready": 1}


def _fake_training(params, out_dir=None, capability=None, progress=True):
    folder = Path(out_dir) / capability
    folder.mkdir(parents=True, exist_ok=True)
    record = {"capability_id": capability, "status": "skipped", "reason": "fake"}
    (folder / "adapter_record.json").write_text(json.dumps(record))
    return {"trained": 0, "skipped": 1}


def _fake_evaluation(params, out_dir=None, progress=False):
    out = Path(out_dir)
    (out / "trajectories").mkdir(parents=True, exist_ok=True)
    from trace_core.schemas import EvaluationResults

    summary = {"methods": {"base": {"pass^1": 0.25}, "trace": {"pass^1": 0.5}}}
    results = EvaluationResults(provisional=False, pending=[], summary=summary, methods=["base", "trace"],
                                budgets={"base": 0, "trace": 64}, routing=None, oracle_choice={},
                                family_capability={}, transfer={}, champions=["identification"], curve=[],
                                warnings=[], adapters=[])
    (out / "results.json").write_text(results.model_dump_json())
    (out / "table.md").write_text("| method | pass^1 |\n|---|---|\n| base | 0.25 |\n| trace | 0.50 |\n")
    (out / "curve.csv").write_text("method,rollouts,score\nbase,0,0.25\ntrace,64,0.5\n")
    metrics = {"base/pass_1": 0.25, "trace/pass_1": 0.5}
    (out / "metrics.json").write_text(json.dumps(metrics))
    return metrics


def _fake_routing(params, out_dir=None, progress=False):
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decisions.json").write_text(json.dumps({"gates": {"gate.json": "0" * 64}}))
    (out / "gate").mkdir(exist_ok=True)
    (out / "gate" / "gate.json").write_text(json.dumps({"classes": ["none", "identification"]}))
    metrics = {"instances": 4.0, "accuracy": 0.5}
    (out / "metrics.json").write_text(json.dumps(metrics))
    return metrics


def _fake_baselines(params, out_dir=None, progress=False):
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "baselines.json").write_text("{}")
    metrics = {"trace_budget": 64.0, "grpo_target/rollouts": 64.0}
    (out / "metrics.json").write_text(json.dumps(metrics))
    return metrics


def _fake_baseline(params, out_dir=None, progress=True):
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trajectories.jsonl").write_text('{"instance_id": "x"}\n')
    metrics = {"pass^1": 0.25, "mean_reward": 0.5, "per_family": {"single_write": {"pass^1": 0.5, "n": 4}},
               "note": "not a number"}
    (out / "metrics.json").write_text(json.dumps(metrics))
    (out / "table.md").write_text("| family | pass^1 |\n|---|---|\n| all | 0.25 |\n")
    return metrics


@pytest.fixture(scope="module")
def prefect_harness(tmp_path_factory):
    from prefect.testing.utilities import prefect_test_harness

    os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(tmp_path_factory.mktemp("prefect-results"))
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="module")
def flow_project(tmp_path_factory) -> Path:
    """One project for the flow tests (creating an MLflow sqlite store costs ~7 s); each test reads its own run."""
    project = tmp_path_factory.mktemp("flow-project")
    (project / "params.yaml").write_text(PARAMS.read_text())
    return project


@pytest.fixture
def fake_stages(monkeypatch):
    import trace_core.analysis
    import trace_core.baseline
    import trace_core.baselines
    import trace_core.bootstrap
    import trace_core.evaluation
    import trace_core.routing
    import trace_core.synthesis
    import trace_core.training

    calls: list[str] = []

    def record(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(trace_core.bootstrap, "run", record("bootstrap", _fake_bootstrap))
    monkeypatch.setattr(trace_core.baseline, "run", record("baseline", _fake_baseline))
    monkeypatch.setattr(trace_core.analysis, "run", record("analysis", _fake_analysis))

    def fake_synthesis(params, out_dir=None, capability=None, progress=True):
        calls.append(f"synthesis:{capability}")
        return _fake_synthesis(params, out_dir, capability, progress)

    monkeypatch.setattr(trace_core.synthesis, "run", fake_synthesis)

    def fake_training(params, out_dir=None, capability=None, progress=True):
        calls.append(f"training:{capability}")
        return _fake_training(params, out_dir, capability, progress)

    monkeypatch.setattr(trace_core.training, "run", fake_training)
    monkeypatch.setattr(trace_core.routing, "run", record("routing", _fake_routing))
    monkeypatch.setattr(trace_core.baselines, "run", record("baselines", _fake_baselines))
    monkeypatch.setattr(trace_core.evaluation, "run", record("evaluation", _fake_evaluation))
    return calls


def _last_run(project: Path, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow' / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment}"
    assert exp.artifact_location == (project / "mlflow" / "artifacts" / experiment).resolve().as_uri()
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)
    return client, runs[0]


def test_flow_runs_stages_in_order_and_mlflow_records_them(prefect_harness, fake_stages, flow_project):
    from flows.pipeline import pipeline
    from tasks.baseline import VERSION as BASELINE_VERSION
    from tasks.evaluation import VERSION as EVALUATION_VERSION
    from tasks.training import VERSION as TRAINING_VERSION

    result = pipeline(params_path=str(flow_project / "params.yaml"), overrides={"baseline.trials": 3})
    assert fake_stages[:3] == ["bootstrap", "baseline", "analysis"]
    params = load_params(flow_project / "params.yaml")
    capabilities = params.synthesis.capabilities
    assert sorted(fake_stages[3 : -len(capabilities) - 3]) == sorted(f"synthesis:{c}" for c in capabilities)
    assert fake_stages[-len(capabilities) - 3 : -3] == [f"training:{c}" for c in capabilities]  # in turn
    assert fake_stages[-3:] == ["routing", "baselines", "evaluation"]
    assert result["routing"] == {"instances": 4.0, "accuracy": 0.5}
    assert result["synthesis"]["identification"] == {"ready": 1}
    assert result["training"]["identification"] == {"trained": 0, "skipped": 1}
    assert (flow_project / "artifacts/synthesis/identification/spec.json").exists()
    assert result["baseline"]["pass^1"] == 0.25
    assert result["analysis"]["selected"] == 2
    assert (flow_project / "artifacts/bootstrap/model/model.safetensors").exists()
    assert (flow_project / "artifacts/baseline/table.md").exists()

    client, run = _last_run(flow_project, "trace-baseline")
    assert run.info.status == "FINISHED"
    assert run.data.params["baseline.trials"] == "3"
    assert run.data.params["user.kind"] == "scripted"
    assert run.data.params["tasks.families"].startswith("[")
    assert "tracking.mlflow_uri" not in run.data.params
    assert run.data.metrics == {"pass_1": 0.25, "mean_reward": 0.5, "per_family/single_write/pass_1": 0.5,
                                "per_family/single_write/n": 4.0}
    assert run.data.tags["trace.task_version"] == BASELINE_VERSION
    assert run.data.tags.get("prefect.flow_run_id")
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"metrics.json", "table.md"}

    client, run = _last_run(flow_project, "trace-bootstrap")
    assert run.info.status == "FINISHED"
    assert "bootstrap.lora_r" in run.data.params and "policy.backend" not in run.data.params
    assert run.data.metrics["train_loss"] == 0.5
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"metrics.json", "manifest.json"}

    client, run = _last_run(flow_project, "trace-analysis")
    assert run.info.status == "FINISHED"
    assert run.data.params["analysis.k"] == "8" and "policy.batch_size" not in run.data.params
    assert run.data.metrics["per_capability/multi_step_completion/selected"] == 1.0
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {
        "capabilities.json", "report.html", "labels.parquet", "metrics.json"}

    client, run = _last_run(flow_project, "trace-training")
    assert run.info.status == "FINISHED"
    assert run.data.params["training.max_steps"] == str(params.training.max_steps)
    assert "baseline.trials" not in run.data.params and run.data.metrics["skipped"] == 1.0
    assert run.data.tags["trace.task_version"] == TRAINING_VERSION
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["adapter_record.json"]

    for stage, files in (("routing", {"decisions.json", "metrics.json", "gate"}),
                         ("baselines", {"baselines.json", "metrics.json"})):
        client, run = _last_run(flow_project, f"trace-{stage}")
        assert run.info.status == "FINISHED" and f"{stage}.out_dir" in run.data.params
        assert {a.path for a in client.list_artifacts(run.info.run_id)} == files
    # The trained gate, with the adapters it routes to (issue #30).
    client, run = _last_run(flow_project, "trace-routing")
    assert [a.path for a in client.list_artifacts(run.info.run_id, "gate")] == ["gate/gate.json"]
    assert run.data.tags["trace.gate.routes_to"] == "none,identification"
    assert run.data.tags["trace.gate.sha256"] == "0" * 64

    client, run = _last_run(flow_project, "trace-evaluation")
    assert run.info.status == "FINISHED"
    assert run.data.params["evaluation.seed"] == str(params.evaluation.seed) and "training.lora_r" in run.data.params
    assert run.data.metrics == {"base/pass_1": 0.25, "trace/pass_1": 0.5}
    assert run.data.tags["trace.task_version"] == EVALUATION_VERSION
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {
        "results.json", "metrics.json", "table.md", "curve.csv"}
    # The fake training registered nothing: the champion is reported, and the evaluation still succeeds.
    assert run.data.tags["trace.champion.identification"] == "unregistered"
    assert result["evaluation"] == {"base/pass_1": 0.25, "trace/pass_1": 0.5}


def test_flow_main_runs_evaluation_and_prints_its_table(prefect_harness, fake_stages, flow_project, capsys):
    from flows.pipeline import main

    assert main(["--params", str(flow_project / "params.yaml"), "--stage", "evaluation"]) == 0
    assert fake_stages == ["evaluation"]
    out = capsys.readouterr().out
    assert "| trace | 0.50 |" in out and "| all | 0.25 |" not in out  # not the baseline's table


def test_flow_runs_one_stage(prefect_harness, fake_stages, flow_project):
    from flows.pipeline import pipeline

    out = {"bootstrap.out_dir": "only/bootstrap", "baseline.out_dir": "only/baseline"}
    pipeline(params_path=str(flow_project / "params.yaml"), stage="baseline", overrides=out)
    assert fake_stages == ["baseline"]
    assert (flow_project / "only/baseline/table.md").exists()
    assert not (flow_project / "only/bootstrap").exists()


def test_failed_stage_fails_the_flow_and_the_mlflow_run(prefect_harness, monkeypatch, flow_project):
    import trace_core.baseline
    from flows.pipeline import pipeline

    def broken(params, out_dir=None, progress=True):
        raise RuntimeError("rollout exploded")

    monkeypatch.setattr(trace_core.baseline, "run", broken)
    with pytest.raises(RuntimeError, match="rollout exploded"):
        pipeline(params_path=str(flow_project / "params.yaml"), stage="baseline")
    _, run = _last_run(flow_project, "trace-baseline")
    assert run.info.status == "FAILED"


def test_flow_main_rejects_bad_params_before_starting_prefect(tmp_project, capsys):
    from flows.pipeline import main

    assert main(["--params", str(tmp_project / "missing.yaml")]) == 2
    assert main(["--params", str(tmp_project / "params.yaml"), "-S", "policy.top_p=high"]) == 2
    assert "bad parameters" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ task versions
def test_task_version_follows_the_stage_code(tmp_path):
    from tasks import code_version
    from tasks.baseline import VERSION as BASELINE_VERSION
    from tasks.bootstrap import VERSION as BOOTSTRAP_VERSION

    assert BASELINE_VERSION != BOOTSTRAP_VERSION
    (tmp_path / "pkg").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "b.py").write_text("y = 1\n")
    before = code_version(["a.py", "pkg"], root=tmp_path)
    assert code_version(["a.py", "pkg"], root=tmp_path) == before
    (tmp_path / "pkg" / "b.py").write_text("y = 2\n")
    assert code_version(["a.py", "pkg"], root=tmp_path) != before


_SLOW_STAGE = """
import sys, time
from pathlib import Path
import trace_core.baseline

def slow(params, out_dir=None, progress=True):
    Path(sys.argv[2]).write_text("started")
    time.sleep(600)

trace_core.baseline.run = slow
from flows.pipeline import main
sys.exit(main(["--params", sys.argv[1], "--stage", "baseline"]))
"""


def test_sigterm_marks_the_mlflow_run_killed_and_stops_the_prefect_server(tmp_project):
    """A stage stopped by SIGTERM (as `kill` or a scheduler stops it): the process exits 143, its MLflow run is KILLED
    (not left RUNNING) and the temporary Prefect server it started is gone (not left listening)."""
    import signal
    import time

    import psutil

    started = tmp_project / "started"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(tmp_project / ".prefect"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_STAGE, str(tmp_project / "params.yaml"), str(started)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert started.exists(), proc.communicate(timeout=30)[1][-3000:]
        children = psutil.Process(proc.pid).children(recursive=True)  # the temporary Prefect server (uvicorn)
        assert children
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    _, alive = psutil.wait_procs(children, timeout=30)
    assert alive == []
    _, run = _last_run(tmp_project, "trace-baseline")
    assert run.info.status == "KILLED"
