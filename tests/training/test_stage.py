"""The training stage on a tiny setup: a real synthesized `tool_call_precision` environment (difficulty 0), the tiny
model as base agent, one GRPO step, two held-out episodes per model; a not-ready spec is skipped; re-runs reuse
what is already done and discard what other settings produced."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest

from trace_core.config import load_params
from trace_core.schemas import AdapterEval, AdapterRecord, Capability, CapabilityStats, EnvSpec
from trace_core.synthesis.stage import synthesize
from trace_core.training import run
from trace_core.training.stage import BaseAgent, TrainingError, step_rows
from trace_core.training.trainer import sha256_file

READY, UNMAPPED = "tool_call_precision", "friendly_tone"

TINY = {
    "synthesis.capabilities": [READY, UNMAPPED],
    "synthesis.difficulty": 0,
    "synthesis.train_instances": 6,
    "synthesis.eval_instances": 3,
    "synthesis.harness.seeds": 4,
    "synthesis.harness.reference_seeds": 2,
    "synthesis.harness.probe_seeds": 2,
    "synthesis.calibration.enabled": False,
    "env.max_steps": 1,  # one assistant turn per episode
    "policy.max_new_tokens": 8,
    "policy.batch_size": 4,
    "policy.max_context": 4096,
    "training.max_steps": 1,
    "training.lora_r": 4,
    "training.num_generations": 2,
    "training.groups_per_step": 1,
    "training.micro_batch_size": 2,
    "training.rollout_batch_size": 2,  # one group per round
    "training.max_new_tokens": 8,
    "training.max_resample_rounds": 0,
    "training.checkpoint_every": 1,
    "training.eval_episodes": 2,
}


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A project whose synthesis folder holds one ready spec (built by the synthesis stage) and one unmapped one."""
    root = tmp_path_factory.mktemp("training-project")
    (root / "params.yaml").write_text((Path(__file__).resolve().parents[2] / "params.yaml").read_text())
    params = load_params(root / "params.yaml", TINY)
    stats = CapabilityStats(runs=1, runs_passed=1, runs_required=1, coverage_mean=0.3, coverage_std=0, delta_mean=0.4,
                            delta_std=0, er_minus_mean=0.5, er_plus_mean=0.1, coverage_ci=(0.2, 0.4),
                            delta_ci=(0.3, 0.5), lacking_failed=3, present_failed=2, lacking_passed=0, present_passed=5)
    capability = Capability(capability_id=READY, name="tool call precision", definition="", labeller="programmatic",
                            selected=True, stats=stats)
    synthesis = root / params.synthesis.out_dir
    assert synthesize(capability, params, synthesis).status == "ready"
    (synthesis / UNMAPPED).mkdir()
    unmapped = EnvSpec(capability_id=UNMAPPED, status="unmapped", reason="no template matches").with_hash()
    (synthesis / UNMAPPED / "spec.json").write_text(unmapped.model_dump_json())
    return root


class TinyBase:
    """The tiny model as base agent, counting loads (each returns a fresh copy: PEFT wraps its model in place)."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer, self.loads = model, tokenizer, []

    def load(self, dtype):
        self.loads.append(dtype)
        model = copy.deepcopy(self.model)
        model.config.max_position_embeddings = 4096  # fits the ~2,000-token prompts of the tiny tokenizer
        return model, self.tokenizer

    def agent(self) -> BaseAgent:
        return BaseAgent(path="tiny-llama", fingerprint="tiny-llama-0", load=self.load)


def _params(project, **overrides):
    return load_params(project / "params.yaml", {**TINY, **overrides})


def test_trains_evaluates_and_skips(project, tiny_model, tokenizer, monkeypatch):
    monkeypatch.chdir(project)
    tiny = TinyBase(tiny_model, tokenizer)
    metrics = run(_params(project), progress=False, base=tiny.agent())

    assert metrics["trained"] == 1 and metrics["skipped"] == 1
    assert tiny.loads == ["float32", "bfloat16"]  # training (fp32 master weights), then evaluation (model.dtype)
    out = project / "artifacts" / "training"
    assert json.loads((out / "metrics.json").read_text()) == metrics

    folder = out / READY
    spec = EnvSpec.model_validate_json((project / "artifacts/synthesis" / READY / "spec.json").read_text())
    record = json.loads((folder / "adapter_record.json").read_text())
    manifest = [json.loads(line) for line in (project / "artifacts/synthesis" / READY / "train_manifest.jsonl").open()]
    expected_data = hashlib.sha256("\n".join(r["content_hash"] for r in manifest).encode()).hexdigest()[:16]
    assert record["status"] == "trained" and record["steps"] == 1 and record["rollouts"] == 2
    assert record["spec_hash"] == spec.spec_hash and record["data_hash"] == expected_data
    assert record["base_model"] == "tiny-llama" and record["train_seeds"] == [0, 6]
    assert record["adapter_sha256"] == sha256_file(folder / "adapter" / "adapter_model.safetensors")
    typed = AdapterRecord.model_validate(record)  # the typed, versioned record (extra keys kept)
    assert record["schema_version"] == "1" and typed.trained and typed.rollouts == 2

    (row,) = json.loads((folder / "training_metrics.json").read_text())["steps"]
    assert row["step"] == 1 and row["rollouts"] == 2
    assert {"reward_mean", "reward_std", "success_rate", "informative_fraction", "loss", "tokens_per_s",
            "entropy", "lora_abs_change"} <= set(row)
    # Moved in the step when a group carried signal; without one, Adam's step is 0.
    assert row["lora_abs_change"] > 0 if row["informative_fraction"] > 0 else row["lora_abs_change"] == 0

    report = json.loads((folder / "eval.json").read_text())
    assert report["seeds"] == [6, 7]  # the first eval_episodes of the spec's held-out seeds [6, 3]
    for side in ("base", "adapter"):
        low, high = report[side]["success_ci"]
        assert report[side]["episodes"] == 2 and 0 <= low <= report[side]["success_rate"] <= high <= 1
    diff = report["difference"]
    assert diff["ci"][0] <= diff["success_rate"] <= diff["ci"][1]
    assert AdapterEval.model_validate(report).adapter_sha256 == record["adapter_sha256"]
    assert metrics["per_capability"][READY]["adapter_success"] == report["adapter"]["success_rate"]
    # The gate: learned only when the paired CI's lower bound is above 0; eval.json, record and metrics say so.
    learned = diff["ci"][0] > 0
    assert report["learned"] is learned and record["learned"] is learned and record["gate"]
    assert metrics["per_capability"][READY]["learned"] is learned and metrics["learned"] == int(learned)
    own_env = (out / "own_env.csv").read_text().splitlines()
    assert own_env[0] == "capability,seeds,rollouts,base_success,adapter_success,diff,ci_low,ci_high"
    assert len(own_env) == 2 and own_env[1].startswith(f"{READY},2,2,")

    from tasks.training import adapter_tags  # the Prefect task tags the registered version from these files

    tags = adapter_tags(AdapterRecord.model_validate(record), AdapterEval.model_validate(report))
    assert tags["trace.data_hash"] == expected_data

    skipped = json.loads((out / UNMAPPED / "adapter_record.json").read_text())
    assert skipped["status"] == "skipped" and "unmapped" in skipped["reason"]
    assert not AdapterRecord.model_validate(skipped).trained
    assert sorted(p.name for p in (out / UNMAPPED).iterdir()) == ["adapter_record.json"]

    # Same settings again: nothing is trained or evaluated again.
    again = TinyBase(tiny_model, tokenizer)
    assert run(_params(project), capability=READY, progress=False, base=again.agent())["trained"] == 1
    assert again.loads == []
    assert json.loads((folder / "adapter_record.json").read_text()) == record

    # Another evaluation size: the adapter is kept, only the evaluation runs again.
    metrics = run(_params(project, **{"training.eval_episodes": 3}), capability=READY, progress=False,
                  base=again.agent())
    assert again.loads == ["bfloat16"] and metrics["per_capability"][READY]["eval_episodes"] == 3
    assert json.loads((folder / "eval.json").read_text())["seeds"] == [6, 7, 8]


def test_missing_or_changed_synthesis_output_is_an_error(project, tmp_path, monkeypatch):
    monkeypatch.chdir(project)
    never = TinyBase(None, None).agent()
    with pytest.raises(TrainingError, match="synthesis@nothing_here"):
        run(_params(project), tmp_path / "out", capability="nothing_here", base=never)

    synthesis = project / "artifacts" / "synthesis" / READY
    manifest = (synthesis / "train_manifest.jsonl").read_text()
    first = json.loads(manifest.splitlines()[0])
    tampered = manifest.replace(first["content_hash"], "0" * len(first["content_hash"]), 1)
    (synthesis / "train_manifest.jsonl").write_text(tampered)
    try:
        with pytest.raises(TrainingError, match="re-run synthesis"):
            run(_params(project), tmp_path / "out", capability=READY, base=never)
    finally:
        (synthesis / "train_manifest.jsonl").write_text(manifest)
    with pytest.raises(TrainingError, match="eval_episodes"):
        run(_params(project, **{"training.eval_episodes": 0}), tmp_path / "out", base=never)


def test_step_rows_from_trl_log_history():
    history = [
        {"step": 1, "reward": 0.5, "reward_std": 0.5, "loss": 0.1, "num_tokens": 1000.0, "step_time": 2.0,
         "rollouts/rollouts": 8.0, "rollouts/informative_groups": 2.0, "rollouts/success_rate": 0.25},
        {"step": 2, "reward": 0.75, "reward_std": 0.4, "loss": 0.2, "kl": 0.01, "num_tokens": 1600.0,
         "step_time": 3.0, "rollouts/rollouts": 4.0, "rollouts/informative_groups": 1.0},
        {"step": 2, "train_runtime": 5.0, "train_loss": 0.15},  # the end-of-training summary
    ]
    rows = step_rows(history, num_generations=2)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["tokens_per_s"] == 500.0 and rows[1]["tokens_per_s"] == 200.0
    assert rows[0]["informative_fraction"] == 0.5 and rows[1]["informative_fraction"] == 0.5
    assert "kl" not in rows[0] and rows[1]["kl"] == 0.01 and "success_rate" not in rows[1]


def test_hint_fraction_gives_the_trainer_the_environment_hint(project, tiny_model, tokenizer, tmp_path, monkeypatch):
    import trace_core.training.trainer as trainer

    class Stop(Exception):
        pass

    seen = {}

    def fake_train_adapter(env, *args, hint=None, **kwargs):
        seen["hint"] = hint(env.reset(0)) if hint is not None else None
        raise Stop

    monkeypatch.chdir(project)
    monkeypatch.setattr(trainer, "train_adapter", fake_train_adapter)
    for fraction, expected in ((0.5, True), (0.0, False)):
        params = _params(project, **{"training.hint_fraction": fraction, "training.out_dir": str(tmp_path / str(fraction))})
        with pytest.raises(Stop):
            run(params, capability=READY, progress=False, base=TinyBase(tiny_model, tokenizer).agent())
        assert (seen["hint"] is not None and seen["hint"].startswith("Expert guidance")) is expected


def test_a_killed_run_resumes_from_its_checkpoint_after_dvc_restores_the_output(project, tiny_model, tokenizer,
                                                                                 monkeypatch, tmp_path):
    """`dvc exp run` restores the output folder to its dvc.lock version (another run's files) before the stage
    runs again; the checkpoints live outside it (trace_core.runs.resume_dir), so the step is not trained twice."""
    from trace_core import runs
    from trace_core.training import stage as training_stage

    monkeypatch.chdir(project)
    out = tmp_path / "training"
    params = _params(project, **{"training.out_dir": str(out)})
    real_evaluate = training_stage._evaluate

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # killed after the optimiser step, before the held-out evaluation

    monkeypatch.setattr(training_stage, "_evaluate", killed)
    with pytest.raises(KeyboardInterrupt):
        run(params, capability=READY, progress=False, base=TinyBase(tiny_model, tokenizer).agent())
    work = runs.resume_dir(out / READY)
    assert (work / "checkpoints" / "checkpoint-1").is_dir() and (work / "ledger.json").exists()
    assert not (out / READY / "checkpoints").exists()  # nothing resumable inside the DVC output

    runs.empty(out / READY)  # what DVC's forced checkout leaves: the lock's version, from other settings
    (out / READY / runs.RUN_KEY).write_text("0123456789abcdef\n")
    (out / READY / "adapter_record.json").write_text('{"capability_id": "x", "status": "skipped", "reason": "old"}')
    monkeypatch.setattr(training_stage, "_evaluate", real_evaluate)
    run(params, capability=READY, progress=False, base=TinyBase(tiny_model, tokenizer).agent())
    record = json.loads((out / READY / "adapter_record.json").read_text())
    assert record["resumed_from_step"] == 1 and record["steps"] == 1 and record["rollouts"] == 2  # no step again
    assert json.loads((out / READY / "ledger.json").read_text())["rollouts"] == {"training": {READY: 2}}
    assert (out / READY / "eval.json").exists() and not work.exists()  # trained and evaluated: resume state gone


def test_a_stopped_runs_kept_step_is_evaluated_and_the_run_stays_resumable(project, tiny_model, tokenizer,
                                                                          monkeypatch, tmp_path, capsys):
    """`trace eval-kept`: a run killed before its end has a kept step (best.safetensors); it is compared with the base
    agent on the finished stage's held-out seeds, cached by what it depends on, and refused for other settings."""
    from trace_core import runs
    from trace_core.cli import main
    from trace_core.training import stage as training_stage
    from trace_core.training.stage import evaluate_kept

    monkeypatch.chdir(project)
    out = tmp_path / "training"
    overrides = {"training.out_dir": str(out), "training.select_every": 1, "training.select_episodes": 2}
    params = _params(project, **overrides)
    real_evaluate = training_stage._evaluate

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(training_stage, "_evaluate", killed)
    with pytest.raises(KeyboardInterrupt):
        run(params, capability=READY, progress=False, base=TinyBase(tiny_model, tokenizer).agent())
    work = runs.resume_dir(out / READY)
    selection = json.loads((work / "selection.json").read_text())

    tiny = TinyBase(tiny_model, tokenizer)
    report = evaluate_kept(params, READY, base=tiny.agent())
    assert tiny.loads == ["bfloat16"]  # one model: the base plays, then the same model with the kept LoRA weights
    assert report["kept_step"] == selection["best_step"] and report["training_rollouts"] == 2
    assert sorted(report["validated_steps"]) == ["0", "1"] and report["seeds"] == [6, 7]  # eval.json's seeds
    assert report["adapter_sha256"] == sha256_file(work / "best.safetensors")
    assert report["learned"] is (report["difference"]["ci"][0] > 0)
    assert AdapterEval.model_validate_json((work / "kept_eval.json").read_text()).eval_key == report["eval_key"]
    assert (work / "checkpoints" / "checkpoint-1").is_dir()  # the run is left to resume

    again = TinyBase(tiny_model, tokenizer)
    assert evaluate_kept(params, READY, base=again.agent())["eval_key"] == report["eval_key"] and again.loads == []

    with pytest.raises(TrainingError, match="other settings"):
        evaluate_kept(_params(project, **overrides, **{"training.lr": 1e-2}), READY, base=again.agent())

    monkeypatch.setattr(training_stage, "base_agent", lambda params: again.agent())
    copy_to = tmp_path / "kept.json"
    args = ["eval-kept", "--params", str(project / "params.yaml"), "--capability", READY, "--out", str(copy_to),
            "--quiet"] + [a for k, v in {**TINY, **overrides}.items() for a in ("-S", f"{k}={json.dumps(v)}")]
    assert main(args) == 0
    assert json.loads(copy_to.read_text())["eval_key"] == report["eval_key"]
    assert f"kept step {report['kept_step']}" in capsys.readouterr().out

    monkeypatch.setattr(training_stage, "_evaluate", real_evaluate)
    run(params, capability=READY, progress=False, base=TinyBase(tiny_model, tokenizer).agent())
    assert not work.exists()
    with pytest.raises(TrainingError, match="best.safetensors is missing"):  # finished: eval.json is the figure
        evaluate_kept(params, READY, base=again.agent())
