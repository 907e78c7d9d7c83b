"""tasks/tracking.py against a local sqlite MLflow store: per-step metrics, and adapters registered as versions of
`trace-<capability_id>` (only the adapter stored, tagged, alias `candidate`, no duplicate versions); evaluation's
champions get the alias `champion`."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from trace_core.config import load_params

ROOT = Path(__file__).resolve().parents[1]
CAPABILITY = "tool_call_precision"


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_model, tokenizer) -> Path:
    """A project with its own MLflow store, a saved tiny base model, and two different tiny adapters of it."""
    import torch
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("tracking-project")
    (root / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    tiny_model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    for name, seed in (("adapter-a", 0), ("adapter-b", 1)):
        torch.manual_seed(seed)  # init_lora_weights=False: random A and B, so the two adapters differ
        config = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        get_peft_model(copy.deepcopy(tiny_model), config).save_pretrained(root / name)
    return root


def test_steps_are_logged_with_their_step_numbers(project):
    from tasks import tracking

    params = load_params(project / "params.yaml")
    with tracking.stage_run("training", params, root=project) as run:
        assert run.log_steps([{"step": 1, "reward_mean": 0.25, "loss": 0.5}, {"step": 2, "reward_mean": 0.5}]) == 2
        history = run.client.get_metric_history(run.run_id, "train/reward_mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5)]


def test_register_adapter_once_per_adapter_with_tags_and_alias(project):
    import mlflow.transformers

    from tasks import tracking
    from trace_core.training.trainer import sha256_file

    params = load_params(project / "params.yaml")
    name = tracking.model_name(CAPABILITY)
    tags = {"trace.spec_hash": "spec123", "trace.data_hash": "data456", "capability.delta_mean": "0.4000"}
    sha_a = sha256_file(project / "adapter-a" / "adapter_model.safetensors")

    # The run's store is the project's; git tags come from this repository (the temporary project is no checkout).
    with tracking.stage_run("training", params, root=project) as run:
        first = tracking.register_adapter(run, CAPABILITY, project / "adapter-a", project / "base", tags, root=ROOT)
        again = tracking.register_adapter(run, CAPABILITY, project / "adapter-a", project / "base", tags, root=ROOT)
    client = run.client
    assert first.version == again.version
    assert len(client.search_model_versions(f"name='{name}'")) == 1
    assert first.run_id == run.run_id
    assert client.get_model_version_by_alias(name, tracking.CANDIDATE).version == first.version
    assert first.tags["trace.adapter_sha256"] == sha_a and first.tags["trace.capability_id"] == CAPABILITY
    assert first.tags["trace.spec_hash"] == "spec123" and first.tags["capability.delta_mean"] == "0.4000"
    assert len(first.tags["git.commit"]) == 40

    # A different adapter is a new version and becomes the candidate; the first one, registered again, is reused.
    second = tracking.register_adapter(params, CAPABILITY, project / "adapter-b", project / "base", tags, root=project)
    assert second.version != first.version
    assert client.get_model_version_by_alias(name, tracking.CANDIDATE).version == second.version
    back = tracking.register_adapter(params, CAPABILITY, project / "adapter-a", project / "base", tags, root=project)
    assert back.version == first.version and len(client.search_model_versions(f"name='{name}'")) == 2
    assert tracking.CANDIDATE in back.aliases

    # Only adapters were stored (no copy of the base weights), and the alias loads base + adapter back.
    stored = sorted(p.name for p in (project / "mlflow").rglob("*.safetensors"))
    assert stored == ["adapter_model.safetensors"] * 2
    loaded = mlflow.transformers.load_model(f"models:/{name}@{tracking.CANDIDATE}", return_type="components")
    assert type(loaded["model"]).__name__.startswith("Peft")


def test_register_adapter_explains_missing_inputs(project):
    from tasks import tracking

    params = load_params(project / "params.yaml")
    with pytest.raises(FileNotFoundError, match="train the adapter first"):
        tracking.register_adapter(params, CAPABILITY, project / "nothing", project / "base", {}, root=project)
    with pytest.raises(FileNotFoundError, match="config.json"):
        tracking.register_adapter(params, CAPABILITY, project / "adapter-a", project / "adapter-b", {}, root=project)


def test_training_task_logs_steps_and_registers_what_the_stage_wrote(project):
    import json
    import shutil

    from tasks import tracking
    from tasks.training import record_outcome
    from trace_core.schemas import Capability, CapabilityDictionary, CapabilityStats

    capability = "identification"
    params = load_params(project / "params.yaml")
    stats = CapabilityStats(runs=1, runs_passed=1, runs_required=1, coverage_mean=0.3, coverage_std=0, delta_mean=0.4,
                            delta_std=0, er_minus_mean=0.5, er_plus_mean=0.1, coverage_ci=(0.2, 0.4),
                            delta_ci=(0.3, 0.5), lacking_failed=3, present_failed=2, lacking_passed=0, present_passed=5)
    dictionary = CapabilityDictionary(
        target={}, thresholds={}, labellers=["programmatic"], selected=[capability],
        capabilities=[Capability(capability_id=capability, name="identification", definition="",
                                 labeller="programmatic", selected=True, stats=stats)],
    )
    (project / "artifacts" / "analysis").mkdir(parents=True)
    (project / "artifacts" / "analysis" / "capabilities.json").write_text(dictionary.model_dump_json())

    # The stage's outputs (keys as trace_core.training.stage writes them; tests/training/test_stage.py checks that).
    folder = project / "artifacts" / "training" / capability
    folder.mkdir(parents=True)
    shutil.copytree(project / "adapter-b", folder / "adapter")
    record = {"capability_id": capability, "status": "trained", "base_model": "base", "base_fingerprint": "f0",
              "spec_hash": "s1", "data_hash": "d2", "template": "identification", "difficulty": 1, "steps": 2,
              "rollouts": 32}
    (folder / "adapter_record.json").write_text(json.dumps(record))
    steps = [{"step": 1, "reward_mean": 0.25}, {"step": 2, "reward_mean": 0.5}]
    (folder / "training_metrics.json").write_text(json.dumps({"capability_id": capability, "steps": steps}))
    side = {"episodes": 4, "success_ci": [0.0, 1.0], "mean_reward": 0.5}
    report = {"seeds": [0, 1, 2, 3], "base": {**side, "successes": 1, "success_rate": 0.25},
              "adapter": {**side, "successes": 2, "success_rate": 0.5},
              "difference": {"success_rate": 0.25, "ci": [-0.25, 0.75], "improved": 1, "regressed": 0,
                             "method": "paired"}}
    (folder / "eval.json").write_text(json.dumps(report))

    with tracking.stage_run("training", params, root=project) as run:
        record_outcome(run, params, project, folder)  # base_model "base" is relative to the project root
    client = run.client
    version = client.get_model_version_by_alias(tracking.model_name(capability), tracking.CANDIDATE)
    assert version.tags["trace.data_hash"] == "d2" and version.tags["trace.spec_hash"] == "s1"
    assert version.tags["eval.adapter_success"] == "0.5000" and version.tags["capability.delta_mean"] == "0.4000"
    assert version.tags["capability.selected"] == "true"
    tags = client.get_run(run.run_id).data.tags
    assert tags["trace.model_version"] == str(version.version) and tags["trace.model"] == "trace-identification"
    assert [m.step for m in client.get_metric_history(run.run_id, "train/reward_mean")] == [1, 2]


def test_promote_champion_moves_the_alias_to_the_evaluated_adapter(project):
    from tasks import tracking
    from trace_core.training.trainer import sha256_file

    capability = "multi_step_completion"
    params = load_params(project / "params.yaml")
    name = tracking.model_name(capability)
    with pytest.raises(LookupError, match=f"flows.pipeline --stage training --capability {capability}"):
        tracking.promote_champion(params, capability, root=project)  # nothing registered yet

    a = tracking.register_adapter(params, capability, project / "adapter-a", project / "base", {}, root=project)
    b = tracking.register_adapter(params, capability, project / "adapter-b", project / "base", {}, root=project)
    client = tracking.configure(params, project)

    # Without the evaluated adapter's hash: the candidate (the newest registration, b).
    champion = tracking.promote_champion(params, capability, root=project)
    assert champion.version == b.version and tracking.CHAMPION in champion.aliases

    # With it: that adapter's version, wherever the candidate points; the alias leaves b, the candidate stays.
    sha_a = sha256_file(project / "adapter-a" / "adapter_model.safetensors")
    champion = tracking.promote_champion(client, capability, sha_a)
    assert champion.version == a.version
    assert client.get_model_version_by_alias(name, tracking.CHAMPION).version == a.version
    assert tracking.CHAMPION not in client.get_model_version(name, b.version).aliases
    assert client.get_model_version_by_alias(name, tracking.CANDIDATE).version == b.version

    with pytest.raises(LookupError, match="no version of model trace-multi_step_completion holds the evaluated"):
        tracking.promote_champion(client, capability, "0" * 64)
    assert client.get_model_version_by_alias(name, tracking.CHAMPION).version == a.version  # unchanged


def test_evaluation_task_promotes_the_champions_it_can_find(project):
    import json

    from tasks import tracking
    from tasks.evaluation import promote_champions
    from trace_core.schemas import EvaluationResults
    from trace_core.training.trainer import sha256_file

    capability = "precondition_verification"
    params = load_params(project / "params.yaml")
    registered = tracking.register_adapter(params, capability, project / "adapter-a", project / "base", {},
                                           root=project)
    tracking.register_adapter(params, capability, project / "adapter-b", project / "base", {}, root=project)
    # The adapter the evaluation played is adapter-a (training's record names its hash), not the candidate.
    folder = project / "artifacts" / "training" / capability
    folder.mkdir(parents=True)
    sha_a = sha256_file(project / "adapter-a" / "adapter_model.safetensors")
    (folder / "adapter_record.json").write_text(json.dumps({"capability_id": capability, "adapter_sha256": sha_a}))
    out = project / "artifacts" / "evaluation"
    out.mkdir(parents=True)
    results = EvaluationResults(provisional=False, pending=[], summary={}, methods=[], budgets={}, routing=None,
                                oracle_choice={}, family_capability={}, transfer={},
                                champions=[capability, "never_registered"], curve=[], warnings=[], adapters=[])
    (out / "results.json").write_text(results.model_dump_json())

    with tracking.stage_run("evaluation", params, root=project) as run:
        outcome = promote_champions(run, params, project, out)
    assert outcome == {capability: str(registered.version), "never_registered": "unregistered"}
    client = run.client
    name = tracking.model_name(capability)
    assert client.get_model_version_by_alias(name, tracking.CHAMPION).version == registered.version
    tags = client.get_run(run.run_id).data.tags
    assert tags[f"trace.champion.{capability}"] == str(registered.version)
    assert tags["trace.champion.never_registered"] == "unregistered"

    # results.json is read as its typed record: one of another shape is an error naming it, not "no champions".
    from trace_core.inputs import StageInputError

    (out / "results.json").write_text(json.dumps({"champions": [capability]}))
    with tracking.stage_run("evaluation", params, root=project) as run:
        with pytest.raises(StageInputError, match="results.json is not evaluation results"):
            promote_champions(run, params, project, out)


_REGISTER = """
import sys, time
from pathlib import Path
from tasks import tracking
from trace_core.config import load_params
root, go = Path(sys.argv[1]), Path(sys.argv[2])
params = load_params(root / "params.yaml")
while not go.exists():  # both processes start registering at the same moment
    time.sleep(0.01)
version = tracking.register_adapter(params, "tool_call_precision", root / "adapter-a", root / "base", {}, root=root)
print("VERSION", version.version)
"""


def test_concurrent_registrations_of_one_adapter_make_one_version(project, tmp_path):
    """Two processes registering the same adapter at once on a fresh store: one version, no error (neither a
    duplicate version nor sqlite's "table ... already exists" from two first-time store creations)."""
    import os
    import subprocess
    import sys
    import time

    from tasks import tracking

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    for name in ("base", "adapter-a"):
        (fresh / name).symlink_to(project / name)
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", _REGISTER, str(fresh), str(go)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    time.sleep(1.0)
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert len({line for out, _ in outs for line in out.splitlines() if line.startswith("VERSION")}) == 1
    client = tracking.configure(load_params(fresh / "params.yaml"), fresh)
    versions = client.search_model_versions(f"name='{tracking.model_name(CAPABILITY)}'")
    assert len(versions) == 1


@pytest.mark.parametrize(("error", "status"), [(RuntimeError("boom"), "FAILED"), (KeyboardInterrupt(), "KILLED")])
def test_a_stage_that_dies_ends_its_run_failed_or_killed(project, error, status):
    from tasks import Terminated, tracking

    params = load_params(project / "params.yaml")
    for exc in (error, Terminated()) if status == "KILLED" else (error,):
        with pytest.raises(type(exc)):
            with tracking.stage_run("baseline", params, root=project) as run:
                raise exc
        assert run.client.get_run(run.run_id).info.status == status


def test_a_run_left_running_by_a_killed_process_is_ended_killed_by_the_next_start(project):
    """SIGKILL gives stage_run no chance to end its run: the next start of the stage ends it KILLED, and leaves
    alone a RUNNING run whose process is alive."""
    import os
    import socket
    import subprocess
    import sys

    from tasks import tracking

    params = load_params(project / "params.yaml")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    client = tracking.configure(params, project)
    experiment_id = tracking.ensure_experiment(client, "trace-baseline", params, project)
    host = {tracking.HOST_TAG: socket.gethostname()}
    orphan = client.create_run(experiment_id, tags={**host, tracking.PID_TAG: str(dead.pid)}).info.run_id
    live = client.create_run(experiment_id, tags={**host, tracking.PID_TAG: str(os.getpid())}).info.run_id
    with tracking.stage_run("baseline", params, root=project):
        pass
    assert client.get_run(orphan).info.status == "KILLED"
    assert client.get_run(live).info.status == "RUNNING"
