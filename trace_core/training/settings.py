"""`GRPOSettings`: every knob of one GRPO run that trains one capability's LoRA adapter (docs/method.md §3).

The values live in params.yaml (`training:`); `GRPOSettings.from_params` reads them. Construction validates the
settings and every error says how to fix it, so a bad value fails before any model is loaded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class GRPOSettings:
    # -- the adapter -------------------------------------------------------------------------------------------
    lora_r: int  # LoRA rank (paper: 16)
    lora_alpha: int  # LoRA scale numerator; the update is scaled by lora_alpha / lora_r (paper: 16)
    lora_dropout: float  # dropout on the LoRA input (paper: 0; > 0 makes rollout and training forwards differ)
    target_modules: list[str]  # module names that get adapters (paper: q,k,v,o,gate,up,down projections)
    # -- the optimiser -----------------------------------------------------------------------------------------
    lr: float  # AdamW learning rate, constant (paper: 1e-5)
    max_grad_norm: float  # gradient-norm clip (paper: 1.0)
    max_steps: int  # optimiser steps, one per collected batch of groups (paper: 10-40 iterations)
    # -- the batch ---------------------------------------------------------------------------------------------
    num_generations: int  # G: rollouts of the same instance that form one group (paper: 16)
    groups_per_step: int  # informative groups (distinct seeds) per optimiser step
    micro_batch_size: int  # sequences per forward/backward pass; divides groups_per_step * num_generations
    rollout_batch_size: int  # episodes advanced together during rollouts (one batched generate per turn)
    # -- sampling ----------------------------------------------------------------------------------------------
    temperature: float  # rollout temperature (paper: 1.0); training log-probs use the same temperature
    max_new_tokens: int  # tokens per assistant turn
    # -- the objective -----------------------------------------------------------------------------------------
    epsilon: float  # clip range of the importance ratio, [1 - eps, 1 + eps] (paper: 0.2; released code 0.28)
    beta: float  # KL penalty towards the base model (paper: 0, no KL and no reference forward pass)
    # -- data ----------------------------------------------------------------------------------------------------
    hint_fraction: float  # share of each group's rollouts with a hint in the system prompt (0: off); needs a hint
    max_resample_rounds: int  # rounds of fresh seeds after the first to replace constant-reward groups (DAPO)
    # -- bookkeeping -------------------------------------------------------------------------------------------
    checkpoint_every: int  # save a resumable checkpoint every this many optimiser steps
    gradient_checkpointing: bool  # recompute activations in backward: less memory, ~30% more compute
    seed: int  # seeds the trainer; sampling seeds derive from it and the environment seeds
    # -- scoring -----------------------------------------------------------------------------------------------
    group_scoring: bool = True  # one micro-batch per group, its shared prompt computed once, each row's activations
    #                             recomputed in backward (micro_batch_size is then unused). Same loss.

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

        def need(ok: bool, message: str) -> None:
            if not ok:
                out.append(message)

        need(self.lora_r >= 1, f"lora_r={self.lora_r} must be >= 1 (the paper uses 16)")
        need(self.lora_alpha > 0, f"lora_alpha={self.lora_alpha} must be > 0 (the paper uses 16, i.e. alpha = r)")
        need(0 <= self.lora_dropout < 1, f"lora_dropout={self.lora_dropout} must be in [0, 1); the paper uses 0")
        need(
            bool(self.target_modules) and all(isinstance(m, str) and m for m in self.target_modules),
            f"target_modules={self.target_modules!r} must name at least one module, e.g. "
            "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]",
        )
        need(self.lr > 0, f"lr={self.lr} must be > 0 (the paper uses 1e-5)")
        need(self.max_grad_norm > 0, f"max_grad_norm={self.max_grad_norm} must be > 0 (the paper clips at 1.0)")
        need(self.max_steps >= 1, f"max_steps={self.max_steps} must be >= 1 (the paper trains 10-40 steps)")
        need(G >= 2, f"num_generations={G} must be >= 2: a group needs two rollouts to compare (the paper uses 16)")
        need(self.groups_per_step >= 1, f"groups_per_step={self.groups_per_step} must be >= 1")
        if self.micro_batch_size < 1 or (G >= 2 and self.groups_per_step >= 1 and total % self.micro_batch_size):
            divisors = [d for d in range(1, total + 1) if total % d == 0] if total >= 1 else [1]
            out.append(
                f"micro_batch_size={self.micro_batch_size} must divide the step's {total} rollouts "
                f"(groups_per_step={self.groups_per_step} x num_generations={G}); use one of "
                f"{', '.join(map(str, divisors))}"
            )
        need(self.rollout_batch_size >= 1, f"rollout_batch_size={self.rollout_batch_size} must be >= 1, e.g. 16")
        need(
            self.temperature > 0,
            f"temperature={self.temperature} must be > 0: greedy rollouts of one instance are identical, so no "
            "group would ever be informative; use 1.0 (the paper's value)",
        )
        need(self.max_new_tokens >= 1, f"max_new_tokens={self.max_new_tokens} must be >= 1, e.g. 128")
        need(0 < self.epsilon < 1, f"epsilon={self.epsilon} must be in (0, 1); the paper uses 0.2")
        need(self.beta >= 0, f"beta={self.beta} must be >= 0; use 0 for the paper's no-KL objective")
        if not 0 <= self.hint_fraction < 1:
            out.append(
                f"hint_fraction={self.hint_fraction} must be in [0, 1): some rollouts must stay un-hinted; "
                "the released code hinted 0.25-0.5"
            )
        elif G >= 2 and self.hint_fraction > 0 and not 1 <= self.hinted_per_group < G:
            lo, hi = 0.5 / G, (G - 0.5) / G
            out.append(
                f"hint_fraction={self.hint_fraction} hints {self.hinted_per_group} of num_generations={G} rollouts; "
                f"use a value in [{lo:.3g}, {hi:.3g}) so that at least one rollout is hinted and one is not, or 0"
            )
        need(
            self.max_resample_rounds >= 0,
            f"max_resample_rounds={self.max_resample_rounds} must be >= 0 (0: never refill constant-reward groups)",
        )
        need(
            self.checkpoint_every >= 1,
            f"checkpoint_every={self.checkpoint_every} must be >= 1; set it to max_steps to checkpoint only at the end",
        )
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_params(cls, params: Any) -> GRPOSettings:
        """The settings in `params.training` (a `trace_core.config.Params`)."""
        cfg = params.training
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})
