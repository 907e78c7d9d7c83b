"""`train_adapter`: one capability's LoRA adapter trained with GRPO on its synthetic environment (docs/method.md §3).

The optimisation is TRL's `GRPOTrainer`; the rollouts are ours. TRL's `rollout_func` hook hands each generation
batch to `EpisodeRollouts`, which runs full multi-turn episodes of the environment with the policy being trained
(`TokenConsistentPolicy` over the trainer's own PEFT model, so every step samples from the current weights, each
turn conditioned on exactly the tokens the training sequence will hold), keeps
informative groups (DAPO-style refill, `grpo.collect_groups`) and returns each episode as one sequence: the
prompt, the completion with its `env_mask` (only sampled tokens carry loss) and the sampled log-probs, plus the
episode reward as an extra column that the reward function hands back to TRL.

Facts this relies on, read from TRL 1.16's `grpo_trainer.py`:
- `rollout_func(prompts, trainer)` gets the generation batch's prompts (each repeated `num_generations` times,
  groups contiguous) and must return `prompt_ids`, `completion_ids` and `logprobs`; `env_mask` becomes the
  trainer's `tool_mask`, multiplied into the loss mask; other keys reach the reward functions as kwargs.
- Advantages are computed per contiguous block of `num_generations` rows: (r - mean) / (std + 1e-4).
- With `gradient_accumulation_steps == steps_per_generation` and `num_iterations=1`, each optimiser step uses
  exactly one freshly generated batch, so `old_per_token_logps` is the current policy's (on-policy GRPO).

Loss aggregation (`loss_type="dapo"`): the clipped surrogate is summed over every policy token of the step and
divided by their count. Episodes differ a lot in how many tokens the policy wrote (one tool call vs. several turns);
"grpo" averages per sequence first, which gives a token of a short episode more weight than one of a long episode,
and "dr_grpo" divides by `max_completion_length`, which has no meaning for multi-turn sequences. DAPO's token-level
mean has neither bias, and its normaliser counts only loss-carrying tokens (env_mask = 1).

Scoring: the trainer is TRL's GRPOTrainer with `_get_per_token_logps_and_entropies` replaced by an unpadded,
per-row version (`logprobs.py`; same values, several times faster on a CPU). With `group_scoring` each micro-batch
is one whole group (TRL's shuffle of the generation batch is skipped; the loss is a token sum over the step, so the
order of micro-batches changes nothing but rounding) and the group's common prompt is computed once
(`logprobs.group_logps`).

Outputs under `out_dir`: `checkpoints/` (TRL/Trainer checkpoints every `checkpoint_every` steps, resumable),
`ledger.json` (the rollout ledger), `adapter/` (the final `save_pretrained` adapter) and `adapter_record.json`;
with `work_dir`, checkpoints/ and the ledger in progress go there instead (`train_adapter`). With
`select_every` > 0 the last `select_episodes` training seeds are held back for validation, `selection.json` and
`best.safetensors` sit beside the checkpoints, and the adapter saved is the best validated step's
(`trace_core.training.selection`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from trace_core.envs.base import Environment, EpisodeLimits
from trace_core.runs import write_json_atomic
from trace_core.schemas import Instance
from trace_core.training.episodes import episode_tokens
from trace_core.training.grpo import Collection, collect_groups, mixes_refusals
from trace_core.training.ledger import RolloutLedger
from trace_core.training.logprobs import completion_logps, group_logps, has_plain_head, row_spans
from trace_core.training.selection import BestStep, split_seeds
from trace_core.training.settings import GRPOSettings

STAGE = "training"
LOSS_TYPE = "dapo"  # see the module docstring
ADAPTER_FILE = "adapter_model.safetensors"
LEDGER = "ledger.json"  # the rollout ledger (trace_core.training.ledger)
LORA_START = "lora_start.safetensors"  # the LoRA weights before the first step (for the weight-change diagnostic)


def lora_config(settings: GRPOSettings) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=settings.lora_r,
        lora_alpha=settings.lora_alpha,
        lora_dropout=settings.lora_dropout,
        target_modules=list(settings.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def _use_bf16(on_cpu: bool) -> bool:
    """bf16 autocast where the hardware multiplies bf16 natively; emulated bf16 is ~25x slower than fp32."""
    import torch

    from trace_core.agents.model import cpu_has_fast_bf16

    if on_cpu:
        return cpu_has_fast_bf16()
    return torch.cuda.is_bf16_supported()


def grpo_config(settings: GRPOSettings, checkpoint_dir: str | os.PathLike, progress: bool = False) -> Any:
    """TRL's GRPOConfig for these settings: one generation batch of `rollouts_per_step` rollouts per optimiser step,
    processed in micro-batches of `micro_batch_size` with gradient accumulation."""
    import torch
    from trl import GRPOConfig

    on_cpu = not torch.cuda.is_available()
    micro_batch = settings.num_generations if settings.scores_groups else settings.micro_batch_size
    accumulation = settings.rollouts_per_step // micro_batch
    return GRPOConfig(
        output_dir=str(checkpoint_dir),
        use_cpu=on_cpu,
        bf16=_use_bf16(on_cpu),
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,  # one generation batch per optimiser step: on-policy
        num_generations=settings.num_generations,
        num_iterations=1,
        max_steps=settings.max_steps,
        learning_rate=settings.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=settings.max_grad_norm,
        temperature=settings.temperature,
        epsilon=settings.epsilon,
        beta=settings.beta,
        loss_type=LOSS_TYPE,
        scale_rewards="group",
        # A turn cut by max_new_tokens is a real outcome of the episode, scored by the environment: keep it.
        mask_truncated_completions=False,
        activation_checkpointing=settings.gradient_checkpointing,  # transformers 5 name of gradient checkpointing
        save_strategy="steps",
        save_steps=settings.checkpoint_every,
        save_total_limit=2,  # the latest checkpoint to resume from, and the one before in case it is torn
        logging_steps=1,
        report_to="none",
        seed=settings.seed,
        disable_tqdm=not progress,
    )


class EpisodeRollouts:
    """TRL's `rollout_func`: runs one step's groups of episodes and returns them as GRPO sequences.

    `seeds` is the endless stream of environment seeds; `last` is the latest step's `Collection`. With
    `max_rollouts`, a step never takes the ledger past that many rollouts: its refill rounds are cut to what the
    budget leaves (each round spends at most `rollouts_per_step`), and `budget_callback()` stops training once the
    budget has no room for another step."""

    def __init__(
        self,
        env: Environment,
        tokenizer: Any,
        settings: GRPOSettings,
        seeds: Iterator[int],
        *,
        ledger: RolloutLedger,
        capability_id: str,
        make_user: Callable[[], Any],
        limits: EpisodeLimits,
        max_context: int,
        hint: Callable[[Instance], str] | None = None,
        progress: bool = False,
        max_rollouts: int | None = None,
    ):
        self.env = env
        self.tokenizer = tokenizer
        self.settings = settings
        self.seeds = seeds
        self.ledger = ledger
        self.capability_id = capability_id
        self.make_user = make_user
        self.limits = limits
        self.max_context = max_context
        self.hint = hint
        self.progress = progress
        self.max_rollouts = max_rollouts
        self.policy: Any = None
        self.last: Collection | None = None
        self.selection: BestStep | None = None  # best-step selection on validation seeds (build_trainer sets it)

    def spent(self) -> int:
        """Rollouts this run's ledger has counted (every episode, dropped groups and redone steps included)."""
        return self.ledger.rollouts(STAGE, self.capability_id)

    def room_for_step(self) -> bool:
        """Whether the budget leaves room for one more step (always, without a budget)."""
        return self.max_rollouts is None or self.max_rollouts - self.spent() >= self.settings.rollouts_per_step

    def _step_settings(self) -> GRPOSettings:
        """The settings for the next step: with a budget, only as many refill rounds as it can pay for."""
        if self.max_rollouts is None:
            return self.settings
        per_round = self.settings.rollouts_per_step  # the first round's cost, and the most any refill costs
        left = self.max_rollouts - self.spent()
        if left < per_round:
            raise RuntimeError(
                f"the rollout budget max_rollouts={self.max_rollouts} leaves {left} rollouts, less than one step's "
                f"{per_round}; the budget callback should have stopped training (pass callbacks from "
                "build_trainer, which adds it)"
            )
        refills = min(self.settings.max_resample_rounds, (left - per_round) // per_round)
        return replace(self.settings, max_resample_rounds=refills)

    def budget_callback(self) -> Any:
        """A Trainer callback that ends training after the step that leaves the budget too small for another."""
        from transformers import TrainerCallback

        rollouts = self

        class RolloutBudget(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if not rollouts.room_for_step():
                    control.should_training_stop = True
                    # A checkpoint of this last step, whatever checkpoint_every says: a run resumed with a larger
                    # budget continues from exactly these weights and this ledger count.
                    control.should_save = True
                return control

        return RolloutBudget()

    def _policy(self, trainer: Any) -> Any:
        from trace_core.training.policy import TokenConsistentPolicy

        model = trainer.accelerator.unwrap_model(trainer.model)
        if self.policy is None or self.policy.model is not model:
            # The trainer's own model: rollouts sample from the weights being optimised. The policy's KV prefix
            # cache is keyed on the weights' version counters, so optimiser steps invalidate it.
            self.policy = TokenConsistentPolicy.from_model(
                model,
                self.tokenizer,
                batch_size=self.settings.rollout_batch_size,
                max_context=self.max_context,
                name="grpo-policy",
            )
        return self.policy

    def __call__(self, prompts: list, trainer: Any) -> dict[str, list]:
        if len(prompts) != self.settings.rollouts_per_step:
            raise RuntimeError(
                f"TRL asked for {len(prompts)} rollouts, the settings give {self.settings.rollouts_per_step}; "
                "build the GRPOConfig with grpo_config()"
            )
        policy = self._policy(trainer)
        with trainer.accelerator.autocast():  # sample in the precision the loss is computed in
            collection = collect_groups(
                self.env,
                policy,
                self.seeds,
                self._step_settings(),
                make_user=self.make_user,
                limits=self.limits,
                ledger=self.ledger,
                capability_id=self.capability_id,
                stage=STAGE,
                hint=self.hint,
                progress=self.progress,
                # Under a rollout budget every rollout counts: rounds run only the groups still missing.
                fill_batch=self.max_rollouts is None,
            )
        # The optimizer step invalidates the cached KV (prefix and rows); free it before the loss needs the memory.
        policy.clear_prefix_cache()
        self.last = collection
        return self.sequences(collection)

    def sequences(self, collection: Collection) -> dict[str, list]:
        """The TRL rows of a collection, groups contiguous.

        A filler (constant-reward) group's rows carry nothing: their advantages are 0 and their tokens would be
        masked out of the token-mean loss anyway. So each of its rows is a one-token stand-in (masked), not the
        episode: TRL needs the rows to keep the groups aligned, but scoring thousands of tokens per filler episode
        through forward and backward would only produce zeros (on a CPU, with a weak base agent whose groups are
        mostly constant, that was most of a step's loss time and memory). The reward is kept, so TRL's group
        statistics see the real rewards."""
        eos = self.tokenizer.eos_token_id
        out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "env_mask": [], "logprobs": [], "reward": []}
        for k, group in enumerate(collection.groups):
            if k >= collection.num_informative:
                for traj in group.trajectories:
                    out["prompt_ids"].append([eos])
                    out["completion_ids"].append([eos])
                    out["env_mask"].append([0])
                    out["logprobs"].append([0.0])
                    out["reward"].append(float(traj.reward))
                continue
            for traj in group.trajectories:
                seq = episode_tokens(
                    traj.messages, self.tokenizer, group.tools, system_prompt=group.system_prompt, include_tail=False
                )
                completion, mask, logprobs = seq.completion_ids, seq.env_mask, seq.logprobs
                if not completion:
                    # The policy never spoke (the prompt overflowed the context): one masked token keeps the
                    # group whole, since TRL needs a non-empty completion per row.
                    completion, mask, logprobs = [eos], [0], [0.0]
                out["prompt_ids"].append(seq.prompt_ids)
                out["completion_ids"].append(completion)
                out["env_mask"].append(mask)
                out["logprobs"].append(logprobs)
                out["reward"].append(float(traj.reward))
        return out

    def reward_function(self) -> Callable[..., list[float]]:
        """The reward TRL optimises: the episode reward R_c returned by the rollouts (the `reward` column). It also
        logs the step's collection statistics next to TRL's metrics."""

        def episode_reward(
            completions: list, reward: list[float], log_metric: Callable | None = None, **_: Any
        ) -> list[float]:
            if log_metric is not None and self.last is not None:
                for key, value in self.last.stats().items():
                    log_metric(f"rollouts/{key}", value)
            return [float(r) for r in reward]

        return episode_reward


def lora_state(model: Any) -> dict[str, Any]:
    """A float32 copy of the model's LoRA weights, by parameter name."""
    return {name: p.detach().float().clone() for name, p in model.named_parameters() if "lora_" in name}


def lora_abs_change(model: Any, start: dict[str, Any]) -> float:
    """The mean absolute change of the LoRA weights since `start` (a `lora_state`), over every LoRA weight."""
    total, count = 0.0, 0
    for name, p in model.named_parameters():
        if name in start:
            total += float((p.detach().float() - start[name]).abs().sum())
            count += p.numel()
    return total / count if count else 0.0


def _lora_start(trainer: Any, out: Path) -> dict[str, Any]:
    """The LoRA weights the run started from: out/lora_start.safetensors, written by the run's first process (a
    resumed run reads it, since its own fresh adapter is not the one the checkpoints grew from)."""
    from safetensors.torch import load_file, save_file

    path = out / LORA_START
    if path.exists():
        return load_file(str(path))
    state = lora_state(trainer.accelerator.unwrap_model(trainer.model))
    out.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(state, str(tmp))
    os.replace(tmp, path)
    return state


def _load_adapter_weights(trainer: Any, checkpoint: Path) -> None:
    """Put a checkpoint's LoRA weights into the trainer's PEFT model (what `train(resume_from_checkpoint=...)`
    would load before its first step)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(checkpoint / ADAPTER_FILE))
    set_peft_model_state_dict(trainer.accelerator.unwrap_model(trainer.model), weights)


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()




def build_trainer(
    env: Environment,
    model: Any,
    tokenizer: Any,
    settings: GRPOSettings,
    out_dir: str | os.PathLike,
    capability_id: str,
    *,
    train_seeds: Sequence[int],
    limits: EpisodeLimits,
    make_user: Callable[[], Any],
    max_context: int,
    hint: Callable[[Instance], str] | None = None,
    callbacks: Sequence[Any] = (),
    progress: bool = False,
    max_rollouts: int | None = None,
) -> tuple[Any, EpisodeRollouts]:
    """The GRPOTrainer (model wrapped with a fresh LoRA adapter) and its rollout function, ready to `train()`.

    The ledger is `out_dir/ledger.json`, loaded if present; environment seeds continue from the ledger's count
    (cycling through `train_seeds`), so a resumed run draws fresh seeds. `max_rollouts` caps the rollouts the
    ledger may count (see `EpisodeRollouts`); training then ends at `settings.max_steps` or when the budget has no
    room for another step, whichever comes first."""
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOTrainer

    if not train_seeds:
        raise ValueError("train_seeds is empty; pass the synthetic environment's training seeds, e.g. range(256)")
    if settings.balance_refusals and not mixes_refusals(env, train_seeds):
        # One kind of instance only (e.g. tool_call_precision never must refuse): nothing to balance.
        settings = replace(settings, balance_refusals=False)
    out = Path(out_dir)
    ledger = RolloutLedger(out / LEDGER)
    train_seeds, validation_seeds = split_seeds(train_seeds, settings)
    seeds = itertools.islice(itertools.cycle(train_seeds), ledger.seeds(STAGE, capability_id), None)
    rollouts = EpisodeRollouts(
        env,
        tokenizer,
        settings,
        seeds,
        ledger=ledger,
        capability_id=capability_id,
        make_user=make_user,
        limits=limits,
        max_context=max_context,
        hint=hint,
        progress=progress,
        max_rollouts=max_rollouts,
    )
    if max_rollouts is not None:
        callbacks = [*callbacks, rollouts.budget_callback()]
    if validation_seeds:  # after the budget's callback, which decides whether a step is the last
        rollouts.selection = BestStep(env, tokenizer, settings, validation_seeds, work=out, ledger=ledger,
                                      capability_id=capability_id, make_user=make_user, limits=limits,
                                      max_context=max_context, progress=progress)
        callbacks = [*callbacks, rollouts.selection.callback()]
    # One dummy row per group: TRL repeats each row num_generations times; the real instance comes from the seeds.
    dataset = Dataset.from_dict(
        {"prompt": [f"group {i}" for i in range(settings.max_steps * settings.groups_per_step)]}
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You are using 'rollout_func'")  # experimental in TRL 1.16; pinned
        trainer = _unpadded(GRPOTrainer, groups=settings.scores_groups)(
            model=model,
            reward_funcs=rollouts.reward_function(),
            args=grpo_config(settings, out / "checkpoints", progress=progress),
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=lora_config(settings),
            rollout_func=rollouts,
            callbacks=list(callbacks) or None,
        )
    if not progress:
        trainer.remove_callback(PrinterCallback)
    if trainer.args.bf16:
        store_frozen_linears_in_bf16(trainer.accelerator.unwrap_model(trainer.model))
    trainer.lora_start = _lora_start(trainer, out)
    if rollouts.selection is not None:
        rollouts.selection.trainer = trainer
    return trainer, rollouts


def skip_zero_gradient_steps(optimizer: Any) -> Any:
    """Make `optimizer.step()` a no-op when every gradient is zero or absent (a GRPO step whose groups are all
    masked fillers: no informative group, or balance_refusals found one kind only). Measured: AdamW's momentum
    otherwise moves the LoRA weights on a zero gradient by about as much as a training step (precondition_verification,
    docs/results.md). Returns the same optimizer."""
    step = optimizer.step

    def guarded(*args: Any, **kwargs: Any) -> Any:
        import torch

        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads or not torch.stack([g.any() for g in grads]).any():  # one device sync, not one per tensor
            return None
        return step(*args, **kwargs)

    optimizer.step = guarded
    return optimizer


def _unpadded(base: type, groups: bool = False) -> type:
    """`base` (TRL's GRPOTrainer) scoring each sequence without its padding, through `logprobs.completion_logps`.
    Batches it does not cover (images, MoE aux losses, scaled or soft-capped logits, masks with holes) keep TRL's
    own scoring. With `groups`, each micro-batch is one GRPO group, in order, and a group whose rows share their
    prompt is scored with that prompt computed once (`logprobs.group_logps`)."""
    from trl.trainer.utils import split_tensor_dict

    class UnpaddedGRPOTrainer(base):
        lora_start: dict | None = None  # the LoRA weights before the first step (build_trainer sets them)

        def create_optimizer(self, *args, **kwargs):
            return skip_zero_gradient_steps(super().create_optimizer(*args, **kwargs))

        def log(self, logs, start_time=None):
            # A training step's log: add how far the LoRA weights moved since the run's start (cheap: the LoRA
            # weights only), so the per-step metrics show whether the adapter moves at all.
            if self.model.training and "loss" in logs and self.lora_start:
                logs["lora_abs_change"] = lora_abs_change(self.accelerator.unwrap_model(self.model), self.lora_start)
            super().log(logs, start_time)

        def _prepare_inputs(self, generation_batch):
            if not (groups and self.model.training):
                return super()._prepare_inputs(generation_batch)
            # TRL's own logic less its row shuffle: the rollouts arrive groups contiguous, and the micro-batch is
            # one group (grpo_config), so contiguous chunks are whole groups.
            chunks = self.args.steps_per_generation
            if self._step % (chunks * self.num_iterations) == 0 or self._buffered_inputs is None:
                batch = self._generate_and_score_completions(generation_batch)
                self._buffered_inputs = split_tensor_dict(batch, chunks)
            return self._buffered_inputs[self._step % chunks]

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                               batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                               **extra):
            unwrapped = self.accelerator.unwrap_model(model)
            spans = row_spans(attention_mask)
            if (compute_aux_loss or any(v is not None for v in extra.values())
                    or not has_plain_head(unwrapped.config) or spans is None):
                return super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                    compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **extra)
            vocab_size = unwrapped.config.get_text_config().vocab_size
            if groups and model is unwrapped:  # a distributed wrapper must see the forward: per-row scoring then
                scored = group_logps(
                    model, input_ids, spans, logits_to_keep, temperature=self.temperature,
                    compute_entropy=compute_entropy, entropy_grad=self._entropy_bonus_enabled, vocab_size=vocab_size,
                    autocast=self.accelerator.autocast,
                )
                if scored is not None:
                    return (*scored, None)

            def fused(ids, n):  # TRL's tiled head on one unpadded row (rows with very many logits)
                labels = ids.clone()
                labels[:, :-n] = -100
                with self.accelerator.autocast():
                    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
                entropy = out.entropy[:, -n:] if compute_entropy else None
                if entropy is not None and not self._entropy_bonus_enabled:
                    entropy = entropy.detach()
                return out.log_probs[:, -n:].float(), entropy

            logps, entropies = completion_logps(
                model, input_ids, spans, logits_to_keep,
                temperature=self.temperature, compute_entropy=compute_entropy,
                entropy_grad=self._entropy_bonus_enabled, vocab_size=vocab_size,
                fused=fused, autocast=self.accelerator.autocast,
            )
            return logps, entropies, None

    return UnpaddedGRPOTrainer


def store_frozen_linears_in_bf16(model: Any) -> int:
    """Keep the frozen base weight of every LoRA-wrapped linear layer in bf16; return how many were cast.

    Under bf16 autocast a matmul casts its fp32 weight to bf16 first, and autocast caches that cast only for
    weights that require grad: the frozen base weights were re-cast at every forward, i.e. at every decoded token
    of the rollouts and in every loss pass. Storing them in bf16 gives bit-identical results (the same bf16 values
    reach the same kernels; checked on sampled rollouts) for less time and half their memory. Only these weights
    change: the LoRA weights, norms and embeddings stay float32, as the optimiser and autocast expect."""
    import torch

    cast = 0
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if isinstance(base, torch.nn.Linear) and not base.weight.requires_grad and base.weight.dtype == torch.float32:
            base.weight.data = base.weight.data.to(torch.bfloat16)
            if base.bias is not None and not base.bias.requires_grad:
                base.bias.data = base.bias.data.to(torch.bfloat16)
            cast += 1
    return cast


def train_adapter(
    env: Environment,
    model_path_or_model: str | os.PathLike | Any,
    tokenizer: Any,
    settings: GRPOSettings,
    out_dir: str | os.PathLike,
    capability_id: str,
    *,
    train_seeds: Sequence[int],
    limits: EpisodeLimits,
    make_user: Callable[[], Any],
    max_context: int,
    hint: Callable[[Instance], str] | None = None,
    resume: bool = True,
    callbacks: Sequence[Any] = (),
    progress: bool = False,
    max_rollouts: int | None = None,
    work_dir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Train `capability_id`'s adapter on `env` and return its record (also written to out_dir/adapter_record.json).

    `model_path_or_model`: a model folder (loaded in float32; `tokenizer` may then be None) or a loaded causal LM,
    which PEFT wraps in place. With `resume`, the run continues from the latest checkpoint in out_dir/checkpoints
    (and the ledger keeps counting); without it, an out_dir holding an earlier run is an error.

    `max_rollouts`: a rollout budget. The run stops at `settings.max_steps` or at the first step after which the
    budget cannot pay for another, and never counts more than `max_rollouts` rollouts. A resumed run whose ledger
    already leaves no room (rollouts spent after the last checkpoint, before a kill) trains no further and keeps
    the checkpoint's adapter. The record's `rollouts` is the ledger's exact count.

    `work_dir`: where the run keeps what it resumes from (checkpoints/, ledger.json, lora_start.safetensors) when
    that is not out_dir, e.g. outside the DVC output (trace_core.runs.resume_dir); out_dir then gets the adapter,
    the record and a copy of the final ledger."""
    from transformers.trainer_utils import get_last_checkpoint

    from trace_core.agents.model import load_model, load_tokenizer

    out = Path(out_dir)
    work = Path(work_dir) if work_dir is not None else out
    checkpoint_dir = work / "checkpoints"
    last = get_last_checkpoint(str(checkpoint_dir)) if checkpoint_dir.is_dir() else None
    if not resume and (last is not None or (work / LEDGER).exists()):
        raise ValueError(
            f"{work} already holds a training run; pass resume=True to continue it, or use an empty out_dir"
        )
    if isinstance(model_path_or_model, (str, os.PathLike)):
        base_model = str(model_path_or_model)
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_path_or_model)
        # fp32 master weights (bf16 only as autocast); threads 0: torch's thread count is the caller's
        model = load_model(model_path_or_model, dtype="float32", threads=0)
    else:
        model = model_path_or_model
        base_model = str(getattr(model.config, "name_or_path", "") or type(model).__name__)
    if tokenizer is None:
        raise ValueError("pass the tokenizer together with an already-loaded model")
    if max_rollouts is not None and max_rollouts < settings.rollouts_per_step:
        raise ValueError(
            f"max_rollouts={max_rollouts} cannot pay for one step of {settings.rollouts_per_step} rollouts "
            f"(groups_per_step x num_generations); raise it or make the groups smaller"
        )

    trainer, rollouts = build_trainer(
        env,
        model,
        tokenizer,
        settings,
        work,
        capability_id,
        train_seeds=train_seeds,
        limits=limits,
        make_user=make_user,
        max_context=max_context,
        hint=hint,
        callbacks=callbacks,
        progress=progress,
        max_rollouts=max_rollouts,
    )
    first_step = 0
    if last is not None:
        first_step = json.loads((Path(last) / "trainer_state.json").read_text())["global_step"]
    started = time.perf_counter()
    selection = rollouts.selection
    if selection is not None and last is None and not selection.validated(0):
        selection.validate(0)  # the fresh adapter (LoRA B = 0): the base agent, the step to beat
    if rollouts.room_for_step():
        trainer.train(resume_from_checkpoint=last)
        steps = int(trainer.state.global_step)
    else:
        # The budget was spent before the kill: TRL would run at least one more step, so keep the checkpoint's
        # weights (none: the fresh adapter, nothing learned survived) and train no further.
        if last is not None:
            _load_adapter_weights(trainer, Path(last))
        steps = first_step
    if selection is not None and selection.best_step is not None:
        selection.restore_best()  # the adapter saved is the best validated step's
    seconds = time.perf_counter() - started  # this process's steps: rollouts, loss, optimiser, checkpoints

    out.mkdir(parents=True, exist_ok=True)
    if work != out and (work / LEDGER).exists():  # the final ledger beside the adapter (work: resumption state)
        shutil.copyfile(work / LEDGER, out / (LEDGER + ".tmp"))
        os.replace(out / (LEDGER + ".tmp"), out / LEDGER)
    adapter_dir, tmp = out / "adapter", out / "adapter.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    trainer.accelerator.unwrap_model(trainer.model).save_pretrained(str(tmp), safe_serialization=True)
    shutil.rmtree(adapter_dir, ignore_errors=True)
    tmp.rename(adapter_dir)

    record = {
        "capability_id": capability_id,
        "adapter_dir": "adapter",
        "adapter_sha256": sha256_file(adapter_dir / ADAPTER_FILE),
        "base_model": base_model,
        "steps": steps,
        "rollouts": rollouts.ledger.rollouts(STAGE, capability_id),
        "seeds": rollouts.ledger.seeds(STAGE, capability_id),
        "resumed_from_step": first_step,
        "train_seconds": round(seconds, 3),
        "seconds_per_step": round(seconds / max(1, steps - first_step), 3),
        "loss_type": LOSS_TYPE,
        "settings": rollouts.settings.to_dict(),  # as trained: balance_refusals is off where nothing mixes
    }
    if max_rollouts is not None:
        record["max_rollouts"] = max_rollouts
    if selection is not None:
        record["selection"] = selection.record()
    write_json_atomic(out / "adapter_record.json", record)
    return record
