"""Typed views of params.yaml, one model per section. Defaults live in params.yaml only: every field here is
required, so a missing key is an error that names it rather than a silent fallback."""

from __future__ import annotations

import os
from dataclasses import asdict, fields
from pathlib import Path
from typing import Annotated, Any, Literal

import annotated_types
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.dataclasses import dataclass

# Value ranges. Every numeric field below has one; a value outside it fails at load, before any model loads, with
# the dotted key and the allowed range in the message (`_describe`).
Count = Annotated[int, Field(ge=1)]  # sizes, counts, lengths: at least one
Count0 = Annotated[int, Field(ge=0)]  # counts where 0 means none / off
Seed = Annotated[int, Field(ge=0)]
Positive = Annotated[float, Field(gt=0)]  # rates, limits, timeouts
NonNegative = Annotated[float, Field(ge=0)]
Temperature = Annotated[float, Field(ge=0)]  # 0 = greedy
Share = Annotated[float, Field(ge=0, le=1)]  # probabilities, shares, thresholds on rates
Confidence = Annotated[float, Field(gt=0, lt=1)]
TopP = Annotated[float, Field(gt=0, le=1)]
Dropout = Annotated[float, Field(ge=0, lt=1)]
# Procedural task difficulty (trace_core.envs.procedural._retail.MAX_DIFFICULTY; tests keep the two equal).
Difficulty = Annotated[int, Field(ge=0, le=3)]
LoraAlpha = Annotated[int, Field(gt=0)]
Modules = Annotated[list[str], Field(min_length=1)]  # names of the modules that get LoRA adapters


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _known_families(names: list[str]) -> list[str]:
    """Each name must be a procedural family of the registry (trace_core.envs.procedural.FAMILIES)."""
    from trace_core.envs.procedural import FAMILIES

    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown procedural famil{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                         f"choose from {', '.join(sorted(FAMILIES))}")
    return names


class ModelCfg(_Section):
    path: str
    cache_dir: str
    dtype: Literal["bfloat16", "float32", "float16"]
    threads: Count0  # 0 = torch's default


class EnvCfg(_Section):
    domain: Literal["retail", "airline", "telecom", "toolsandbox"]
    profile: Literal["compact", "full"]
    max_steps: Count
    max_errors: Count


class UserCfg(_Section):
    kind: Literal["scripted", "llm"]
    max_turns: Count
    base_url: str | None
    model: str | None
    api_key_env: str
    temperature: Temperature
    max_new_tokens: Count
    timeout_s: Positive


class PolicyCfg(_Section):
    backend: Literal["local", "openai"]
    batch_size: Count
    max_new_tokens: Count
    max_context: Count
    temperature: Temperature
    top_p: TopP
    base_url: str | None
    model: str | None
    api_key_env: str
    concurrency: Count
    timeout_s: Positive


class TasksCfg(_Section):
    families: Annotated[list[str], Field(min_length=1)]
    difficulty: Difficulty

    _families = field_validator("families")(_known_families)


class BootstrapCfg(_Section):
    enabled: bool
    families: Annotated[list[str], Field(min_length=1)]
    difficulty: Difficulty
    seed: Seed
    num_dialogues: Count
    epochs: Count
    lr: Positive
    warmup_ratio: Share
    weight_decay: NonNegative
    max_grad_norm: Positive
    lora_r: Count
    lora_alpha: LoraAlpha
    lora_dropout: Dropout
    target_modules: Modules
    batch_size: Count
    micro_batch_size: Count
    max_length: Count
    out_dir: str

    _families = field_validator("families")(_known_families)


class BaselineCfg(_Section):
    source: Literal["procedural", "tau2", "toolsandbox"]
    seed: Seed
    instances_per_family: Count
    tau2_split: Literal["train", "test", "base"]
    trials: Count
    out_dir: str


class AnalysisLLMCfg(_Section):
    base_url: str | None
    model: str | None
    api_key_env: str
    temperature: Temperature
    max_new_tokens: Count
    max_candidates: Count
    max_attempts: Count
    max_trajectory_chars: Count
    discovery_trajectories: Count
    concurrency: Count
    timeout_s: Positive


class AnalysisEmbeddingCfg(_Section):
    clusters: Count
    max_steps: Count
    min_failure_lift: Positive
    min_steps: Count
    excerpts: Count0
    runs: Count
    restarts: Count
    match_overlap: Share


class AnalysisCfg(_Section):
    labellers: list[Literal["programmatic", "llm", "embedding"]]
    rho: Share
    delta: Share
    k: Count
    n: Count
    ci: Confidence
    bootstrap_samples: Count
    min_delta_ci_low: Annotated[float, Field(ge=-1, le=1)]  # a difference of two rates
    within_family: bool
    drop_vacuous_successes: bool  # leave out successes the do-nothing control also gets (`stage.vacuous_successes`)
    controls: bool
    max_examples: Count0
    report_excerpts: Count0
    llm: AnalysisLLMCfg
    embedding: AnalysisEmbeddingCfg
    out_dir: str


class HarnessCfg(_Section):
    seeds: Count
    reference_seeds: Count
    probe_seeds: Count
    min_distinct: Share
    max_probe_reward: Share
    max_probe_success: Share
    spot_seeds: Count0  # 0 = no spot checks


class CalibrationCfg(_Section):
    enabled: bool
    seeds: Count
    samples: Count
    temperature: Temperature
    hint_fraction: Dropout  # [0, 1): some rollouts stay un-hinted
    low: Share
    high: Share
    min_std: NonNegative
    max_all_success: Share
    max_all_zero: Share
    min_informative: Share
    max_adjustments: Count0


class GeneratorCfg(_Section):
    base_url: str | None
    model: str | None
    api_key_env: str
    max_attempts: Count
    temperature: Temperature
    max_new_tokens: Count
    timeout_s: Positive


class SynthesisCfg(_Section):
    capabilities: list[str]
    templates: dict[str, str]
    match_threshold: Share
    difficulty: Count0  # each template checks its own maximum
    train_instances: Count
    eval_instances: Count
    harness: HarnessCfg
    calibration: CalibrationCfg
    generator: GeneratorCfg
    out_dir: str


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class GRPOSettings:
    """Every knob of one GRPO run that trains one LoRA adapter (docs/method.md §3): the GRPO part of params.yaml's
    `training:` section, and the only place its fields are listed (`TrainingCfg` adds the stage's own keys).

    A (pydantic) dataclass, so that `dataclasses.replace` derives variants (a step's refill rounds, a budget's
    step count). Construction validates the settings and every error says how to fix it, so a bad value fails
    when params.yaml is loaded, before any model is."""

    # -- the adapter -------------------------------------------------------------------------------------------
    lora_r: Count  # LoRA rank (paper: 16)
    lora_alpha: LoraAlpha  # LoRA scale numerator; the update is scaled by lora_alpha / lora_r (paper: 16)
    lora_dropout: Dropout  # dropout on the LoRA input (paper: 0; > 0 makes rollout and training forwards differ)
    target_modules: Modules  # module names that get adapters (paper: q,k,v,o,gate,up,down projections)
    # -- the optimiser -----------------------------------------------------------------------------------------
    lr: Positive  # AdamW learning rate, constant (paper: 1e-5)
    max_grad_norm: Positive  # gradient-norm clip (paper: 1.0)
    max_steps: Count  # optimiser steps, one per collected batch of groups (paper: 10-40 iterations)
    # -- the batch ---------------------------------------------------------------------------------------------
    num_generations: Annotated[int, Field(ge=2)]  # G: rollouts of the same instance that form one group (paper: 16)
    groups_per_step: Count  # informative groups (distinct seeds) per optimiser step
    micro_batch_size: Count  # sequences per forward/backward pass; divides groups_per_step * num_generations
    rollout_batch_size: Count  # episodes advanced together during rollouts (one batched generate per turn)
    # -- sampling ----------------------------------------------------------------------------------------------
    temperature: Positive  # rollout temperature (paper: 1.0); training log-probs use the same temperature
    max_new_tokens: Count  # tokens per assistant turn
    # -- the objective -----------------------------------------------------------------------------------------
    epsilon: Confidence  # clip range of the importance ratio, [1 - eps, 1 + eps] (paper: 0.2; released code 0.28)
    beta: NonNegative  # KL penalty towards the base model (paper: 0, no KL and no reference forward pass)
    # -- data ----------------------------------------------------------------------------------------------------
    hint_fraction: Dropout  # share of each group's rollouts with a hint in the system prompt (0: off); needs a hint
    max_resample_rounds: Count0  # rounds of fresh seeds after the first to replace constant-reward groups (DAPO)
    balance_refusals: bool  # each step trains on as many informative groups of must-refuse instances as of
    #                         must-act ones (the surplus of either kind is left out); needs an even groups_per_step
    # -- best-step selection (trace_core/training/selection.py) -------------------------------------------------
    select_every: Count0  # play the validation seeds greedily every this many steps and keep the best step (0: off,
    #                       the last step's adapter is kept)
    select_episodes: Count0  # validation seeds: the last this many training seeds, left out of training
    # -- bookkeeping -------------------------------------------------------------------------------------------
    checkpoint_every: Count  # save a resumable checkpoint every this many optimiser steps
    gradient_checkpointing: bool  # recompute activations in backward: less memory, ~30% more compute
    seed: Seed  # seeds the trainer; sampling seeds derive from it and the environment seeds
    # -- scoring -----------------------------------------------------------------------------------------------
    group_scoring: bool  # one micro-batch per group, its shared prompt computed once, each row's activations
    #                      recomputed in backward (micro_batch_size is then unused). Same loss.

    def __post_init__(self) -> None:
        for problem in self.problems():
            raise ValueError(f"training settings: {problem}")

    @property
    def rollouts_per_step(self) -> int:
        return self.groups_per_step * self.num_generations

    @property
    def scores_groups(self) -> bool:
        """Whether the loss is computed one group at a time with its prompt shared (not with activation
        checkpointing, under which transformers turns off the key/value cache the sharing goes through)."""
        return self.group_scoring and not self.gradient_checkpointing

    @property
    def hinted_per_group(self) -> int:
        """How many rollouts of each group get the hint."""
        return round(self.hint_fraction * self.num_generations)

    def problems(self) -> list[str]:
        """Every invalid value, each with the fix (empty when the settings are usable)."""
        out: list[str] = []
        G, total = self.num_generations, self.rollouts_per_step

        # Single-field ranges are the field types' (checked by pydantic first); these are the cross-field rules.
        if total % self.micro_batch_size:
            divisors = [d for d in range(1, total + 1) if total % d == 0]
            out.append(
                f"micro_batch_size={self.micro_batch_size} must divide the step's {total} rollouts "
                f"(groups_per_step={self.groups_per_step} x num_generations={G}); use one of "
                f"{', '.join(map(str, divisors))}"
            )
        if self.hint_fraction > 0 and not 1 <= self.hinted_per_group < G:
            lo, hi = 0.5 / G, (G - 0.5) / G
            out.append(
                f"hint_fraction={self.hint_fraction} hints {self.hinted_per_group} of num_generations={G} rollouts; "
                f"use a value in [{lo:.3g}, {hi:.3g}) so that at least one rollout is hinted and one is not, or 0"
            )
        if self.balance_refusals and self.groups_per_step % 2:
            out.append(
                f"balance_refusals needs an even groups_per_step (half must-refuse, half must-act groups), got "
                f"{self.groups_per_step}; use {self.groups_per_step + 1} or set balance_refusals: false"
            )
        if self.select_every and not self.select_episodes:
            out.append(
                f"select_every={self.select_every} needs validation seeds: set select_episodes (e.g. 32) or "
                "select_every: 0"
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_params(cls, params: Any) -> GRPOSettings:
        """The GRPO part of `params.training` (a `trace_core.config.Params`): the same fields, same values."""
        cfg = params.training
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class TrainingCfg(GRPOSettings):
    """Stage `training` (GRPO, one LoRA per capability): the GRPO settings plus the stage's own keys."""

    eval_episodes: Count0  # held-out seeds played by the base agent and by base + adapter
    keep_unlearned: bool  # routing/evaluation also use adapters whose held-out gain's CI does not clear 0
    out_dir: str


class GateCfg(_Section):
    """The trained gate (evaluation.router.scoring = gate, trace_core/routing/gate.py)."""

    per_capability: Count  # synthetic training openings per capability (its first train seeds)
    distractors: Count0  # generated off-topic openings labelled "no adapter"
    # grid searched by cross-validation on the baseline openings (routing.gate.select_settings), first point wins ties
    synthetic_weights: Annotated[list[Annotated[float, Field(gt=0)]], Field(min_length=1)]  # per synthetic opening
    inverse_regularizations: Annotated[list[Annotated[float, Field(gt=0)]], Field(min_length=1)]  # LR's C
    folds: Annotated[int, Field(ge=2)]  # folds of the grid's cross-validation and of the temperature calibration


class RouterCfg(_Section):
    scoring: str
    compare: list[str]  # further scorings routed (full adapter set) for the routing report and trace_<scoring> rows
    examples: Count0
    top_p: Annotated[float, Field(ge=0, lt=1)]  # 0 = one adapter (argmax)
    calibrate: bool
    max_task_chars: Count
    answer_prefix: str
    gate: GateCfg


class GEPACfg(_Section):
    reflection: Literal["local", "endpoint"]
    base_url: str | None
    model: str | None
    api_key_env: str
    temperature: Temperature
    max_new_tokens: Count
    minibatch: Count
    train_instances: Count
    val_instances: Count
    max_trajectory_chars: Count
    timeout_s: Positive


# The router's scorings (trace_core.routing.router takes this tuple: one list, and config stays free of the
# routing package so that every stage's code dependencies stay what dvc.yaml says).
ROUTER_SCORINGS = ("label", "channel", "gate")

EVALUATION_METHODS = (
    "base", "trace", "single", "oracle", "merged_linear", "merged_ties", "mixture", "grpo_target", "gepa", "describe",
    *(f"trace_{s}" for s in ROUTER_SCORINGS),
)


class EvaluationCfg(_Section):
    source: Literal["procedural", "tau2", "toolsandbox"]
    seed: Seed
    instances_per_family: Count
    tau2_split: Literal["train", "test", "base"]
    trials: Count
    temperature: Temperature
    methods: list[Literal[EVALUATION_METHODS]]  # type: ignore[valid-type]
    router: RouterCfg
    merge_density: Annotated[float, Field(gt=0, le=1)]  # TIES keeps this share
    target_seed: Seed
    curve_points: Count
    gepa: GEPACfg
    ci: Confidence
    bootstrap_samples: Count
    out_dir: str


class RoutingCfg(_Section):
    # The router's own settings stay under evaluation.router (the methods it serves are evaluation's).
    out_dir: str


class BaselinesCfg(_Section):
    # The baselines' settings stay under evaluation (target_seed, gepa) and training (GRPO).
    out_dir: str


class TrackingCfg(_Section):
    mlflow_uri: str
    artifact_root: str


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt or stray section is an error, not ignored

    seed: Seed
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
    routing: RoutingCfg
    baselines: BaselinesCfg
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
        raise ValueError(f"{p} is not valid:\n" + "\n".join(_describe(e) for e in exc.errors())) from None
    if params.bootstrap.enabled and params.bootstrap.seed == params.baseline.seed:
        raise ValueError(
            f"bootstrap.seed ({params.bootstrap.seed}) equals baseline.seed: the warm-start would train on "
            "evaluation instances. Pick a different bootstrap.seed."
        )
    a = params.analysis
    if not 1 <= a.k <= a.n:
        raise ValueError(f"analysis.k={a.k} must be between 1 and analysis.n={a.n} (select when passing in k of n runs)")
    cal, train = params.synthesis.calibration, params.training
    if cal.low > cal.high:
        raise ValueError(f"synthesis.calibration.low={cal.low} is above synthesis.calibration.high={cal.high}: the "
                         "reward band is [low, high]; swap them")
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
    _check_toolsandbox(params)
    _check_evaluation(params)
    return params


def _check_toolsandbox(params: Params) -> None:
    """ToolSandbox scenarios play only in the ToolSandbox environment, and it has no other instances."""
    on_target = params.env.domain == "toolsandbox"
    for section in ("baseline", "evaluation"):
        source = getattr(params, section).source
        if on_target != (source == "toolsandbox"):
            raise ValueError(
                f"env.domain={params.env.domain} with {section}.source={source}: ToolSandbox scenarios need "
                "env.domain=toolsandbox and that environment has no other instances; set both, e.g. with "
                "`-S env.domain=toolsandbox -S baseline.source=toolsandbox -S evaluation.source=toolsandbox` "
                "(profiles/toolsandbox.overrides)"
            )


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
    elif e.tau2_split == params.baseline.tau2_split and params.baseline.source == e.source:
        raise ValueError(
            f"evaluation.tau2_split and baseline.tau2_split are both {e.tau2_split!r}: analysis would have seen the "
            "evaluation tasks. Use e.g. baseline.tau2_split=train and evaluation.tau2_split=test."
        )
    if e.trials > 1 and e.temperature <= 0:
        raise ValueError(
            f"evaluation.trials={e.trials} with temperature 0 repeats identical greedy episodes; set "
            "evaluation.temperature > 0 (e.g. 1.0) for pass^k, or trials: 1"
        )
    for where, scoring in [("scoring", e.router.scoring), *(("compare", s) for s in e.router.compare)]:
        if scoring not in ROUTER_SCORINGS:
            raise ValueError(f"evaluation.router.{where} has {scoring!r}; use label (the paper's lettered prompt), "
                             "channel (the task's likelihood after each capability's card) or gate (a classifier "
                             "trained per run)")
    if e.router.calibrate and e.router.scoring != "label":
        raise ValueError("evaluation.router.calibrate=true applies to scoring=label only; set it to false")


def _fields_of(model: Any) -> dict[str, Any] | None:
    """The pydantic fields of a model or pydantic dataclass (such as `GRPOSettings`); None for anything else."""
    if isinstance(model, type) and issubclass(model, BaseModel):
        return model.model_fields
    return getattr(model, "__pydantic_fields__", None) if isinstance(model, type) else None


def _field(loc: tuple) -> tuple[Any, Any]:
    """The FieldInfo at a dotted location of `Params` (None past a list index or an unknown key), and the model
    that holds it."""
    model: Any = Params
    info, owner = None, None
    for part in loc:
        fields = _fields_of(model)
        if fields is None or not isinstance(part, str) or part not in fields:
            return None, model
        owner, info = model, fields[part]
        model = info.annotation
    return info, owner


def _allowed(info: Any) -> str | None:
    """The range a field's constraints allow, as text: ">= 1", "in [0, 1]", "in (0, 1)"."""
    lo = hi = None
    for m in getattr(info, "metadata", ()):
        if isinstance(m, annotated_types.Ge):
            lo = ("[", ">=", m.ge)
        elif isinstance(m, annotated_types.Gt):
            lo = ("(", ">", m.gt)
        elif isinstance(m, annotated_types.Le):
            hi = ("]", "<=", m.le)
        elif isinstance(m, annotated_types.Lt):
            hi = (")", "<", m.lt)
    if lo and hi:
        return f"in {lo[0]}{lo[2]}, {hi[2]}{hi[0]}"
    if lo or hi:
        bound = lo or hi
        return f"{bound[1]} {bound[2]}"
    return None


def _describe(err: dict) -> str:
    """One pydantic error as "section.key=value must be <range>" (or what else is wrong, and the fix)."""
    loc = tuple(err["loc"])
    key = ".".join(str(part) for part in loc)
    kind, value = err["type"], err.get("input")
    if kind == "missing":
        return f"{key}: missing; every key is required (defaults live in params.yaml only), add it"
    if kind == "extra_forbidden":
        info, owner = _field(loc[:-1]) if len(loc) > 1 else (None, Params)
        holder = info.annotation if info is not None else owner
        known = ", ".join(_fields_of(holder) or {})
        where = f"section {'.'.join(map(str, loc[:-1]))}" if len(loc) > 1 else "params.yaml"
        return f"{key}: unknown key in {where}; the known keys are {known} (a misspelling?)"
    info, _ = _field(loc)
    allowed = _allowed(info) if info is not None else None
    if allowed and kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return f"{key}={value!r} must be {allowed}"
    msg = err["msg"].removeprefix("Value error, ")
    return f"{key}={value!r}: {msg}" + (f" (allowed: {allowed})" if allowed else "")
