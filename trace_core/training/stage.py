"""Stage `training`: for each capability with a ready environment, train its LoRA adapter with GRPO, then measure
it against the base agent on held-out seeds of the same environment.

    artifacts/training/<capability_id>/adapter/                the PEFT adapter (only the LoRA weights)
    artifacts/training/<capability_id>/adapter_record.json     what was trained, on which data, from which base
    artifacts/training/<capability_id>/training_metrics.json   one row per optimiser step (from TRL's log history)
    artifacts/training/<capability_id>/eval.json               held-out success, base vs. base + adapter
    artifacts/training/own_env.csv                             (a run over every capability) one row per adapter
    artifacts/training/<capability_id>/ledger.json                the rollout ledger of the finished run
    artifacts/resume/training/<capability_id>/                 resumption state: checkpoints/, ledger.json, run_key.txt

A capability whose environment spec is not ready (rejected, unmapped, not selected) gets only an
`adapter_record.json` with status "skipped" and the reason.

Resuming: a killed run continues from its last checkpoint, kept outside the DVC output
(`trace_core.runs.resume_dir`: `dvc exp run` restores cached outputs to their dvc.lock version before it runs) and
removed once the capability is trained and evaluated. `run_key.txt` is a hash of everything the adapter depends on
(training settings, environment spec and training data, base weights, episode limits); when it differs, the
folder's earlier outputs and resumption state are discarded first. DVC keeps the output folder between runs
(`persist: true`).
An adapter already finished under the same key is not trained again, and its evaluation is reused unless the
evaluation settings changed, so a re-run caused by an unrelated change costs almost nothing.

The gate: once evaluated, an adapter is marked `learned` (in eval.json and in its record) only when the lower bound
of the paired 95% CI of its held-out success difference is above 0 (`gate`); routing and evaluation then use only
learned adapters unless `training.keep_unlearned` (trace_core.inputs).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trace_core import runs
from trace_core.agents.device import free_memory, on_accelerator
from trace_core.config import Params
from trace_core.envs.settings import episode_limits, scripted_user_factory
from trace_core.jsonl import iter_jsonl
from trace_core.runs import write_json_atomic
from trace_core.schemas import AdapterEval, AdapterRecord, EnvSpec
from trace_core.training.settings import GRPOSettings
from trace_core.training.trainer import ADAPTER_FILE, sha256_file

RECORD = "adapter_record.json"
STEP_METRICS = "training_metrics.json"
EVAL = "eval.json"
KEPT_EVAL = "kept_eval.json"  # evaluate_kept: a stopped run's kept step, in its resumption folder


class TrainingError(RuntimeError):
    pass


@dataclass(frozen=True)
class BaseAgent:
    """The weights every adapter starts from.

    `load(dtype)` returns a fresh (model, tokenizer) on each call: training wraps its copy with PEFT in place, and
    evaluation needs an untouched one. `path` is recorded with the adapter (the registry references the base by
    it); `fingerprint` identifies the weights' content and is part of the run key."""

    path: str
    fingerprint: str
    load: Callable[[str], tuple[Any, Any]]


def base_agent(params: Params) -> BaseAgent:
    """The base agent of `params` (the bootstrap output, or the provisioned model when bootstrap is disabled)."""
    from trace_core.agents.model import load_model, load_tokenizer, weights_hash
    from trace_core.bootstrap import agent_model_path

    path = agent_model_path(params)
    # A hub id (not a folder) names fixed weights in the local cache; a folder is hashed, since bootstrap may
    # rewrite it in place.
    fingerprint = weights_hash(Path(path)) if Path(path).is_dir() else path

    def load(dtype: str) -> tuple[Any, Any]:
        return load_model(path, dtype=dtype, threads=params.model.threads), load_tokenizer(path)

    return BaseAgent(path=path, fingerprint=fingerprint, load=load)


# ------------------------------------------------------------------------------------------------- the inputs
def capabilities(params: Params, synthesis_dir: str | os.PathLike | None = None) -> list[str]:
    """The capabilities the stage covers: `synthesis.capabilities`, then any other one with a ready spec."""
    folder = Path(synthesis_dir or params.synthesis.out_dir)
    ready = sorted(
        p.parent.name
        for p in folder.glob("*/spec.json")
        if json.loads(p.read_text(encoding="utf-8")).get("status") == "ready"
    )
    return list(dict.fromkeys([*params.synthesis.capabilities, *ready]))


def load_spec(spec_dir: Path, capability_id: str) -> EnvSpec:
    path = spec_dir / "spec.json"
    if not path.exists():
        raise TrainingError(
            f"{path} not found: synthesize the environment first (`dvc repro synthesis@{capability_id}` or "
            f"`trace synthesis --capability {capability_id}`)"
        )
    return EnvSpec.model_validate_json(path.read_text(encoding="utf-8"))


def build_env(spec: EnvSpec, spec_dir: Path) -> Any:
    """The environment the spec describes: a template, or the generated module kept in the spec's folder."""
    if spec.source == "template":
        from trace_core.synthesis.templates import make

        return make(spec.template, spec.capability_id, spec.difficulty, spec.profile, scaffold=spec.scaffold,
                    blend=spec.blend)
    if spec.source == "generated":
        from trace_core.synthesis.generated import GeneratedEnv

        module = spec_dir / "generator.py"
        if not module.exists():
            raise TrainingError(f"{module} is missing; re-run synthesis for {spec.capability_id}")
        return GeneratedEnv(
            module.read_text(encoding="utf-8"), spec.capability_id, difficulty=spec.difficulty, profile=spec.profile,
            domain=spec.domain,
        )
    raise TrainingError(f"spec of {spec.capability_id} has source {spec.source!r}; expected template or generated")


def data_hash(spec: EnvSpec, spec_dir: Path, env: Any) -> str:
    """A hash of the training instances: the content hashes of the spec's train seeds, in seed order, from
    train_manifest.jsonl. The first seed is rebuilt to check that `env` still makes the instances synthesis
    recorded."""
    manifest = spec_dir / "train_manifest.jsonl"
    if not manifest.exists():
        raise TrainingError(f"{manifest} not found; re-run synthesis for {spec.capability_id}")
    hashes = {}
    for line in iter_jsonl(manifest):
        if line.strip():
            row = json.loads(line)
            hashes[int(row["seed"])] = row["content_hash"]
    first, count = spec.train_seeds
    missing = [s for s in range(first, first + count) if s not in hashes]
    if missing:
        raise TrainingError(
            f"{manifest} lacks train seeds {missing[:5]}{'...' if len(missing) > 5 else ''} of spec.train_seeds "
            f"{spec.train_seeds}; re-run synthesis for {spec.capability_id}"
        )
    rebuilt = env.reset(first).content_hash()
    if rebuilt != hashes[first]:
        raise TrainingError(
            f"{spec.capability_id}: seed {first} now yields an instance with content hash {rebuilt}, the manifest "
            f"says {hashes[first]}: the environment code changed since synthesis; re-run synthesis"
        )
    digest = hashlib.sha256("\n".join(hashes[s] for s in range(first, first + count)).encode())
    return digest.hexdigest()[:16]


def run_key(params: Params, spec: EnvSpec, data: str, agent: BaseAgent) -> str:
    """What the adapter depends on. Evaluation settings, output paths and the scoring layout are left out: they do
    not change it."""
    return runs.run_key(
        {
            # group_scoring changes how the loss is computed, not its value (tests/training/test_logprobs.py).
            "training": {k: v for k, v in params.training.to_dict().items()
                         if k not in {"out_dir", "eval_episodes", "group_scoring", "keep_unlearned"}},
            "spec_hash": spec.spec_hash,
            "data_hash": data,
            "base": agent.fingerprint,
            "max_steps": params.env.max_steps,
            "max_errors": params.env.max_errors,
            "user_max_turns": params.user.max_turns,
            "max_context": params.policy.max_context,
        }
    )




def read_record(path: Path) -> AdapterRecord | None:
    """The adapter record at `path`; None when it is missing, torn or of another shape (e.g. an older version)."""
    try:
        return AdapterRecord.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def write_record(path: Path, record: dict[str, Any]) -> dict[str, Any]:
    """Write `record` as an `AdapterRecord` (validated; its keys as given, extra ones included, plus
    `schema_version`); return what was written."""
    model = AdapterRecord.model_validate(record)
    data = {"schema_version": model.schema_version, **model.model_dump(mode="json", exclude_unset=True)}
    write_json_atomic(path, data)
    return data


def finished(folder: Path, key: str) -> dict | None:
    """The adapter record when training under `key` already finished here (record, metrics and intact adapter)."""
    record = read_record(folder / RECORD)
    adapter = folder / "adapter" / ADAPTER_FILE
    if (
        record is not None
        and record.trained
        and record.run_key == key
        and (folder / STEP_METRICS).exists()
        and adapter.exists()
        and sha256_file(adapter) == record.adapter_sha256
    ):
        return record.model_dump(mode="json", exclude_unset=True)  # the file's keys, as written
    return None


def skip(folder: Path, capability_id: str, reason: str) -> dict:
    """Replace the folder's contents with a record saying why nothing was trained."""
    runs.empty(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return write_record(folder / RECORD, {"capability_id": capability_id, "status": "skipped", "reason": reason})


# -------------------------------------------------------------------------------------------- step metrics
def _keep_log_history(sink: list[dict]) -> Any:
    """A Trainer callback that copies the final log history into `sink`. The history is taken from the trainer's
    state at the end, so after a resume it holds the restored steps as well as the new ones."""
    from transformers import TrainerCallback

    class KeepLogHistory(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            sink[:] = [dict(entry) for entry in state.log_history]

    return KeepLogHistory()


def step_rows(log_history: list[dict], num_generations: int) -> list[dict[str, float]]:
    """One row per optimiser step from TRL's log history: reward mean/std, success, informative groups, loss, KL
    (logged by TRL only when beta > 0), gradient norm, entropy (mean token entropy of the policy on the step's
    sampled completions), the mean absolute change of the LoRA weights since the start, seconds and tokens per
    second. Keys a run did not log are left out. The end-of-training summary entry (no reward) is skipped."""
    rows: list[dict[str, float]] = []
    tokens_before = 0.0
    renamed = {
        "reward": "reward_mean",
        "reward_std": "reward_std",
        "rollouts/success_rate": "success_rate",
        "rollouts/informative_groups": "informative_groups",
        "rollouts/rollouts": "rollouts",
        "loss": "loss",
        "kl": "kl",
        "grad_norm": "grad_norm",
        "entropy": "entropy",
        "completions/mean_length": "completion_mean_length",
        "step_time": "step_seconds",
        "lora_abs_change": "lora_abs_change",
    }
    for entry in log_history:
        if "step" not in entry or "reward" not in entry:
            continue
        row: dict[str, float] = {"step": int(entry["step"])}
        row.update({new: float(entry[old]) for old, new in renamed.items() if entry.get(old) is not None})
        if row.get("rollouts"):
            # Groups rolled out this step, refills included: the share that carried a learning signal.
            row["informative_fraction"] = row.get("informative_groups", 0.0) / (row["rollouts"] / num_generations)
        tokens = entry.get("num_tokens")  # cumulative prompt + completion tokens trained on (kept across resumes)
        if tokens is not None:
            if entry.get("step_time") and tokens >= tokens_before:
                row["tokens_per_s"] = (tokens - tokens_before) / entry["step_time"]
            tokens_before = tokens
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------ one capability
def _train(params, spec, folder, work, env, agent, settings, key, data, progress) -> dict:
    """Train the adapter into `folder` (continuing a killed run's checkpoint in `work`), write its step metrics and
    record."""
    from trace_core.training.trainer import train_adapter

    first, count = spec.train_seeds
    history: list[dict] = []
    model, tokenizer = agent.load("float32")  # fp32 master weights; the trainer autocasts where bf16 is fast
    record = train_adapter(
        env,
        model,
        tokenizer,
        settings,
        folder,
        spec.capability_id,
        train_seeds=range(first, first + count),
        limits=episode_limits(params),
        make_user=scripted_user_factory(params),
        max_context=params.policy.max_context,
        hint=env.hint if settings.hint_fraction > 0 else None,
        resume=True,
        callbacks=[_keep_log_history(history)],
        progress=progress,
        work_dir=work,
    )
    del model
    free_memory()
    write_json_atomic(
        folder / STEP_METRICS,
        {"capability_id": spec.capability_id, "steps": step_rows(history, settings.num_generations)},
    )
    record.update(
        status="trained",
        base_model=agent.path,
        base_fingerprint=agent.fingerprint,
        spec_hash=spec.spec_hash,
        data_hash=data,
        source=spec.source,
        template=spec.template,
        difficulty=spec.difficulty,
        train_seeds=list(spec.train_seeds),
        run_key=key,
    )
    return write_record(folder / RECORD, record)  # written last: its run_key marks the training as finished


def play_greedy(params: Params, env: Any, model: Any, tokenizer: Any, seeds: list[int], name: str,
                progress: bool = False) -> list:
    """One greedy episode per held-out seed with `model` (the base, or the base with an adapter): the deployed
    inference path (the same policy class as the baseline) and the policy's turn budget."""
    from trace_core.training.evaluation import play_greedy_model

    return play_greedy_model(env, model, tokenizer, seeds, name=name, make_user=scripted_user_factory(params),
                             limits=episode_limits(params), batch_size=params.policy.batch_size,
                             max_context=params.policy.max_context, max_new_tokens=params.policy.max_new_tokens,
                             seed=params.training.seed, progress=progress)


def _eval_seeds(params: Params, spec: EnvSpec) -> list[int]:
    """The held-out seeds of the comparison: the first `training.eval_episodes` of the spec's eval seeds."""
    first, count = spec.eval_seeds
    return list(range(first, first + min(params.training.eval_episodes, count)))


def _eval_key(params: Params, run_key: str, adapter_sha256: str, seeds: list[int]) -> str:
    """What a held-out comparison depends on: a change in any of it plays the comparison again."""
    return runs.run_key({"run_key": run_key, "adapter_sha256": adapter_sha256, "seeds": seeds,
                         "dtype": params.model.dtype, "max_new_tokens": params.policy.max_new_tokens,
                         "intervals": [params.evaluation.bootstrap_samples, params.evaluation.ci]})


def _compare_held_out(params, spec, env, agent, seeds, adapt: Callable[[Any], Any], progress) -> dict:
    """Greedy episodes of the base model, then of `adapt(base model)` (the base with an adapter, wrapped in place),
    on the same held-out `seeds`; the paired comparison (`evaluation.compare`)."""
    from trace_core.training.evaluation import compare

    model, tokenizer = agent.load(params.model.dtype)
    model = on_accelerator(model)
    base = play_greedy(params, env, model, tokenizer, seeds, f"base:{spec.capability_id}", progress)
    adapted_model = adapt(model)  # wraps `model`: the base ran first
    adapted_model.eval()
    adapted = play_greedy(params, env, adapted_model, tokenizer, seeds, f"adapter:{spec.capability_id}", progress)
    del model, adapted_model
    free_memory()
    return compare(seeds, base, adapted, samples=params.evaluation.bootstrap_samples, level=params.evaluation.ci,
                   seed=params.training.seed)


def _evaluate(params, spec, folder, env, agent, record, progress) -> dict:
    """Greedy held-out episodes of the base model and of base + adapter on the same seeds (eval.json)."""
    from peft import PeftModel

    seeds = _eval_seeds(params, spec)
    key = _eval_key(params, record["run_key"], record["adapter_sha256"], seeds)
    cached = read_eval(folder / EVAL)
    if cached is not None and cached.eval_key == key:
        return cached.model_dump(mode="json")

    compared = _compare_held_out(params, spec, env, agent, seeds,
                                 lambda model: PeftModel.from_pretrained(model, str(folder / "adapter")), progress)
    report = AdapterEval.model_validate({
        "capability_id": spec.capability_id, "eval_key": key, "adapter_sha256": record["adapter_sha256"],
        **compared, "learned": gate(compared)[0]}).model_dump(mode="json")
    write_json_atomic(folder / EVAL, report)
    return report


def evaluate_kept(params: Params, capability_id: str, progress: bool = False, base: BaseAgent | None = None) -> dict:
    """The held-out comparison of a training run stopped before its end: the adapter of the step that best-step
    selection keeps so far (`best.safetensors` in the run's resumption folder), against the base agent on the same
    seeds as the finished stage's eval.json. Written to the resumption folder as kept_eval.json (an eval.json plus
    the kept step, the steps validated and the rollouts spent so far) and returned; played again only when the kept
    weights or the evaluation settings changed. The run itself is left as it is, to resume.

    For a sitting that ends inside a long training run (docs/running.md): the figure is the one the finished run
    would report if selection kept the same step to the end, which later steps may still change."""
    from peft import get_peft_model

    from trace_core.training.ledger import RolloutLedger
    from trace_core.training.selection import BEST, SELECTION, load_lora_state
    from trace_core.training.trainer import LEDGER, lora_config

    spec_dir = Path(params.synthesis.out_dir) / capability_id
    spec = load_spec(spec_dir, capability_id)
    env = build_env(spec, spec_dir)
    agent = base or base_agent(params)
    key = run_key(params, spec, data_hash(spec, spec_dir, env), agent)
    work = runs.resume_dir(Path(params.training.out_dir) / capability_id)
    best = work / BEST
    if not best.exists():
        raise TrainingError(
            f"{best} is missing: no stopped run of {capability_id} with a kept step here. It exists while a run "
            "with best-step selection (training.select_every > 0) has validated a step and not finished; a "
            f"finished run's comparison is {Path(params.training.out_dir) / capability_id / EVAL}")
    stamp = work / runs.RUN_KEY
    if not stamp.exists() or stamp.read_text().strip() != key:
        raise TrainingError(
            f"{work} holds a run of other settings (its run key differs from these params'): pass the params "
            "(-S overrides, e.g. a profile's) that run was started with")
    selection = json.loads((work / SELECTION).read_text(encoding="utf-8"))
    sha = sha256_file(best)
    seeds = _eval_seeds(params, spec)
    eval_key = _eval_key(params, key, sha, seeds)
    out = work / KEPT_EVAL
    cached = read_eval(out)
    if cached is not None and cached.eval_key == eval_key:
        return cached.model_dump(mode="json")

    settings = GRPOSettings.from_params(params)

    def adapt(model: Any) -> Any:
        adapted = get_peft_model(model, lora_config(settings))
        load_lora_state(adapted, best)
        return adapted

    compared = _compare_held_out(params, spec, env, agent, seeds, adapt, progress)
    report = AdapterEval.model_validate({
        "capability_id": capability_id, "eval_key": eval_key, "adapter_sha256": sha, **compared,
        "learned": gate(compared)[0], "kept_step": selection["best_step"],
        "validated_steps": selection["steps"],  # by step, as selection.json keeps them (keys are strings in JSON)
        "training_rollouts": RolloutLedger(work / LEDGER).rollouts("training", capability_id),
    }).model_dump(mode="json")
    write_json_atomic(out, report)
    return report


def gate(report: dict[str, Any]) -> tuple[bool, str]:
    """Whether an adapter learned, from its held-out comparison (an eval.json report): the lower bound of the paired
    interval (evaluation.ci) of the success difference is above 0. The reason gives the figures."""
    diff, n = report["difference"], report["base"]["episodes"]
    low, high = diff["ci"]
    learned = low > 0
    verdict = "learned" if learned else "not learned (the CI's lower bound is not above 0)"
    return learned, (f"{verdict}: held-out success {report['base']['success_rate']:.3f} -> "
                     f"{report['adapter']['success_rate']:.3f} on {n} seeds, paired difference "
                     f"{diff['success_rate']:+.3f}, CI [{low:+.3f}, {high:+.3f}]")


def read_eval(path: Path) -> AdapterEval | None:
    """The held-out comparison at `path`; None when it is missing, torn or of another shape."""
    try:
        return AdapterEval.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def train_capability(
    params: Params,
    spec: EnvSpec,
    spec_dir: Path,
    folder: Path,
    agent: BaseAgent,
    settings: GRPOSettings,
    progress: bool = False,
) -> dict:
    """Train (or reuse) one capability's adapter and evaluate it; return its per-capability metrics."""
    env = build_env(spec, spec_dir)
    data = data_hash(spec, spec_dir, env)
    key = run_key(params, spec, data, agent)
    runs.claim(folder, key)
    work = runs.resume_dir(folder)
    runs.claim(work, key)
    record = finished(folder, key) or _train(params, spec, folder, work, env, agent, settings, key, data, progress)
    report = _evaluate(params, spec, folder, env, agent, record, progress)
    shutil.rmtree(work)  # trained and evaluated: nothing left to resume
    learned, why = gate(report)
    if report.get("learned") != learned:  # an eval.json written before the gate
        report["learned"] = learned
        write_json_atomic(folder / EVAL, report)
    if record.get("learned") != learned or record.get("gate") != why:
        record = write_record(folder / RECORD, {**record, "learned": learned, "gate": why})
    diff = report["difference"]
    return {
        "learned": learned,
        "gate": why,
        "status": "trained",
        "steps": record["steps"],
        "rollouts": record["rollouts"],
        "eval_episodes": report["base"]["episodes"],
        "base_success": report["base"]["success_rate"],
        "adapter_success": report["adapter"]["success_rate"],
        "success_difference": diff["success_rate"],
        "difference_ci_low": diff["ci"][0],
        "difference_ci_high": diff["ci"][1],
    }


# ------------------------------------------------------------------------------------------------ the stage
def run(
    params: Params,
    out_dir: Path | None = None,
    capability: str | None = None,
    progress: bool = True,
    base: BaseAgent | None = None,
) -> dict:
    """Train and evaluate `capability` (or every capability of `capabilities(params)`); write one folder each.

    `base` replaces the base agent of `params` (tests pass a tiny model); it is loaded only if some capability
    is ready to train."""
    try:  # invalid settings fail before any model is loaded
        settings = GRPOSettings.from_params(params)
    except ValueError as exc:
        raise TrainingError(str(exc)) from None
    if params.training.eval_episodes < 1:
        raise TrainingError(
            f"training.eval_episodes={params.training.eval_episodes} must be >= 1: every adapter is compared with "
            "the base agent on that many held-out seeds (e.g. 16)"
        )
    out = Path(out_dir or params.training.out_dir)
    synthesis_dir = Path(params.synthesis.out_dir)
    wanted = [capability] if capability is not None else capabilities(params, synthesis_dir)
    per_capability: dict[str, dict] = {}
    for cid in wanted:
        spec_dir = synthesis_dir / cid
        spec = load_spec(spec_dir, cid)
        if spec.status != "ready":
            reason = f"environment spec status is {spec.status}: {spec.reason}"
            per_capability[cid] = {"status": skip(out / cid, cid, reason)["status"], "reason": reason}
            continue
        base = base or base_agent(params)
        per_capability[cid] = train_capability(params, spec, spec_dir, out / cid, base, settings, progress)
    metrics = {
        "trained": sum(m["status"] == "trained" for m in per_capability.values()),
        "skipped": sum(m["status"] == "skipped" for m in per_capability.values()),
        "learned": sum(bool(m.get("learned")) for m in per_capability.values()),
        "per_capability": per_capability,
    }
    if capability is None:
        from trace_core.training.own_env import OWN_ENV, own_env_rows, write_own_env

        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / "metrics.json", metrics)
        write_own_env(out / OWN_ENV, own_env_rows(out, wanted))
    return metrics
