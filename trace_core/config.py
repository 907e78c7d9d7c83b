"""Typed views of params.yaml, one model per section. Defaults live in params.yaml only: every field here is
required, so a missing key is an error that names it rather than a silent fallback."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelCfg(_Section):
    path: str
    cache_dir: str
    dtype: Literal["bfloat16", "float32", "float16"]
    threads: int


class EnvCfg(_Section):
    domain: Literal["retail", "airline", "telecom"]
    profile: Literal["compact", "full"]
    max_steps: int
    max_errors: int


class UserCfg(_Section):
    kind: Literal["scripted", "llm"]
    max_turns: int
    base_url: str | None
    model: str | None
    api_key_env: str
    temperature: float


class PolicyCfg(_Section):
    backend: Literal["local", "openai"]
    batch_size: int
    max_new_tokens: int
    max_context: int
    temperature: float
    top_p: float
    base_url: str | None
    model: str | None
    api_key_env: str
    concurrency: int
    timeout_s: float


class TasksCfg(_Section):
    families: list[str]
    difficulty: int


class BootstrapCfg(_Section):
    enabled: bool
    families: list[str]
    difficulty: int
    seed: int
    num_dialogues: int
    epochs: int
    lr: float
    lora_r: int
    lora_alpha: int
    lora_dropout: float
    batch_size: int
    max_length: int
    out_dir: str


class BaselineCfg(_Section):
    source: Literal["procedural", "tau2"]
    seed: int
    instances_per_family: int
    tau2_split: Literal["train", "test", "base"]
    trials: int
    out_dir: str


class AnalysisLLMCfg(_Section):
    base_url: str | None
    model: str | None
    api_key_env: str
    temperature: float
    max_new_tokens: int
    max_candidates: int
    max_attempts: int
    max_trajectory_chars: int
    discovery_trajectories: int
    concurrency: int
    timeout_s: float


class AnalysisEmbeddingCfg(_Section):
    clusters: int
    max_steps: int
    min_failure_lift: float
    min_steps: int
    excerpts: int


class AnalysisCfg(_Section):
    labellers: list[Literal["programmatic", "llm", "embedding"]]
    rho: float
    delta: float
    k: int
    n: int
    ci: float
    bootstrap_samples: int
    controls: bool
    max_examples: int
    llm: AnalysisLLMCfg
    embedding: AnalysisEmbeddingCfg
    out_dir: str


class HarnessCfg(_Section):
    seeds: int
    reference_seeds: int
    probe_seeds: int
    min_distinct: float
    max_probe_reward: float
    max_probe_success: float
    spot_seeds: int


class CalibrationCfg(_Section):
    enabled: bool
    seeds: int
    samples: int
    temperature: float
    hint_fraction: float
    low: float
    high: float
    min_std: float
    max_all_success: float
    max_all_zero: float
    min_informative: float
    max_adjustments: int


class GeneratorCfg(_Section):
    base_url: str | None
    model: str | None
    api_key_env: str
    max_attempts: int
    temperature: float
    max_new_tokens: int


class SynthesisCfg(_Section):
    capabilities: list[str]
    templates: dict[str, str]
    match_threshold: float
    difficulty: int
    train_instances: int
    eval_instances: int
    harness: HarnessCfg
    calibration: CalibrationCfg
    generator: GeneratorCfg
    out_dir: str


class TrainingCfg(_Section):
    """Stage `training` (GRPO, one LoRA per capability); field meanings in trace_core/training/settings.py."""

    lora_r: int
    lora_alpha: int
    lora_dropout: float
    target_modules: list[str]
    lr: float
    max_grad_norm: float
    max_steps: int
    num_generations: int
    groups_per_step: int
    micro_batch_size: int
    rollout_batch_size: int
    temperature: float
    max_new_tokens: int
    epsilon: float
    beta: float
    hint_fraction: float
    max_resample_rounds: int
    checkpoint_every: int
    gradient_checkpointing: bool
    seed: int
    group_scoring: bool
    eval_episodes: int
    out_dir: str


class RouterCfg(_Section):
    scoring: str
    examples: int
    top_p: float
    calibrate: bool
    max_task_chars: int
    answer_prefix: str


class GEPACfg(_Section):
    reflection: Literal["local", "endpoint"]
    base_url: str | None
    model: str | None
    api_key_env: str
    temperature: float
    max_new_tokens: int
    minibatch: int
    train_instances: int
    val_instances: int


# The router's scorings (trace_core.routing.router takes this tuple: one list, and config stays free of the
# routing package so that every stage's code dependencies stay what dvc.yaml says).
ROUTER_SCORINGS = ("label", "channel")

EVALUATION_METHODS = (
    "base", "trace", "single", "oracle", "merged_linear", "merged_ties", "mixture", "grpo_target", "gepa", "describe"
)


class EvaluationCfg(_Section):
    source: Literal["procedural", "tau2"]
    seed: int
    instances_per_family: int
    tau2_split: Literal["train", "test", "base"]
    trials: int
    temperature: float
    methods: list[Literal[EVALUATION_METHODS]]  # type: ignore[valid-type]
    router: RouterCfg
    merge_density: float
    target_seed: int
    curve_points: int
    gepa: GEPACfg
    ci: float
    bootstrap_samples: int
    out_dir: str


class TrackingCfg(_Section):
    mlflow_uri: str
    artifact_root: str


class Params(BaseModel):
    model_config = ConfigDict(extra="allow")  # later stages add their own sections

    seed: int
    model: ModelCfg
    env: EnvCfg
    user: UserCfg
    policy: PolicyCfg
    tasks: TasksCfg
    bootstrap: BootstrapCfg
    baseline: BaselineCfg
    analysis: AnalysisCfg
    synthesis: SynthesisCfg
    training: TrainingCfg
    evaluation: EvaluationCfg
    tracking: TrackingCfg


def load_params(path: str | os.PathLike = "params.yaml", overrides: dict[str, Any] | None = None) -> Params:
    """Read params.yaml (plus dotted overrides like {"policy.batch_size": 4}) into a validated `Params`."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p} not found; run from the project root or pass --params PATH")
    raw = yaml.safe_load(p.read_text()) or {}
    for dotted, value in (overrides or {}).items():
        node = raw
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    try:
        params = Params.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(f"{p} is not valid:\n{exc}") from None
    if params.bootstrap.enabled and params.bootstrap.seed == params.baseline.seed:
        raise ValueError(
            f"bootstrap.seed ({params.bootstrap.seed}) equals baseline.seed: the warm-start would train on "
            "evaluation instances. Pick a different bootstrap.seed."
        )
    a = params.analysis
    if not 1 <= a.k <= a.n:
        raise ValueError(f"analysis.k={a.k} must be between 1 and analysis.n={a.n} (select when passing in k of n runs)")
    if not 0 < a.ci < 1:
        raise ValueError(f"analysis.ci={a.ci} must be in (0, 1), e.g. 0.95")
    cal, train = params.synthesis.calibration, params.training
    if cal.enabled and cal.temperature != train.temperature:
        raise ValueError(
            f"synthesis.calibration.temperature={cal.temperature} differs from training.temperature={train.temperature}: "
            "calibration checks the reward band of the groups GRPO will sample, so set both to the same value"
        )
    if cal.enabled and cal.samples != train.num_generations:
        raise ValueError(
            f"synthesis.calibration.samples={cal.samples} differs from training.num_generations={train.num_generations}: "
            "calibration's group statistics (all-success, all-zero, informative groups) are about the groups GRPO will "
            "sample, one per seed, so set both to the same value (change synthesis.calibration.seeds for more rollouts)"
        )
    if cal.enabled and cal.hint_fraction != train.hint_fraction:
        raise ValueError(
            f"synthesis.calibration.hint_fraction={cal.hint_fraction} differs from training.hint_fraction="
            f"{train.hint_fraction}: calibration measures the groups GRPO will sample, hinted share included; set both "
            "to the same value"
        )
    _check_evaluation(params)
    return params


def _check_evaluation(params: Params) -> None:
    e = params.evaluation
    if e.source == "procedural":
        # Held-out means never seen by the warm-start, the analysed baseline or GRPO on the target tasks.
        taken = {"bootstrap.seed": params.bootstrap.seed, "baseline.seed": params.baseline.seed,
                 "evaluation.target_seed": e.target_seed}
        for name, value in taken.items():
            if value == e.seed:
                raise ValueError(
                    f"evaluation.seed ({e.seed}) equals {name}: the evaluation instances would not be held out. "
                    "Pick another evaluation.seed."
                )
    elif e.tau2_split == params.baseline.tau2_split and params.baseline.source == "tau2":
        raise ValueError(
            f"evaluation.tau2_split and baseline.tau2_split are both {e.tau2_split!r}: analysis would have seen the "
            "evaluation tasks. Use e.g. baseline.tau2_split=train and evaluation.tau2_split=test."
        )
    if e.trials < 1 or e.instances_per_family < 1:
        raise ValueError("evaluation.trials and evaluation.instances_per_family must be >= 1")
    if e.trials > 1 and e.temperature <= 0:
        raise ValueError(
            f"evaluation.trials={e.trials} with temperature 0 repeats identical greedy episodes; set "
            "evaluation.temperature > 0 (e.g. 1.0) for pass^k, or trials: 1"
        )
    if e.router.scoring not in ROUTER_SCORINGS:
        raise ValueError(f"evaluation.router.scoring={e.router.scoring!r} must be label (the paper's lettered "
                         "prompt) or channel (the task's likelihood after each capability's card)")
    if e.router.examples < 0:
        raise ValueError(f"evaluation.router.examples={e.router.examples} must be >= 0 (0: descriptions only)")
    if e.router.calibrate and e.router.scoring != "label":
        raise ValueError("evaluation.router.calibrate=true applies to scoring=label only; set it to false")
    if not 0 <= e.router.top_p < 1:
        raise ValueError(f"evaluation.router.top_p={e.router.top_p} must be in [0, 1); 0 = one adapter (argmax)")
    if not 0 < e.ci < 1:
        raise ValueError(f"evaluation.ci={e.ci} must be in (0, 1), e.g. 0.95")
    if not 0 < e.merge_density <= 1:
        raise ValueError(f"evaluation.merge_density={e.merge_density} must be in (0, 1] (TIES keeps this share)")
