"""Best-step selection: play the adapter on held-back training seeds every few steps and keep the best step's weights.

Why (measured on the embedded default, docs/results.md "Stopping at the best step"): precondition_verification at
difficulty 0 with balanced steps reached its best sampled success at step 4 of 11 and ended at 0/64 held-out
successes (from 12/64), where 5 steps had given +0.094 [+0.016, +0.188]. A fixed step count cannot suit every
capability (tool_call_precision at difficulty 1 plateaus by 256 rollouts), so the trainer measures instead.
(With the zero-gradient guard, `trainer.skip_zero_gradient_steps`, the same profile's validation rose to 9/32 by step
6 and stayed there to step 11, and the step-6 adapter gained +0.141 [+0.063, +0.234]: there selection was insurance.
tool_call_precision at difficulty 2 in the same profile validated 19, 20, 18, 6 of 32 at steps 0-6: there selection
kept step 2, from before the collapse.)

The validation seeds are the last `select_episodes` of the run's training seeds, taken out of the training stream
(`split_seeds`), never the spec's eval seeds, which the stage's held-out evaluation plays afterwards. They are played
greedily (temperature 0, as the held-out evaluation plays) by the model being trained, with the deployed policy
class, before the first step (step 0: the fresh adapter, whose LoRA B is zero, so the base agent), every
`select_every` steps and after the last step. The adapter kept is that of the best step by (success rate, mean
reward); the earliest wins a tie, so a run that never beats step 0 on validation keeps the fresh adapter (no change),
and the held-out evaluation then finds no difference.

On disk, in the run's work folder (kept for resumption): `selection.json`
    {"seeds": [...], "steps": {"0": {"successes": 9, "episodes": 32, "success_rate": 0.28, "mean_reward": 0.41}, ...},
     "best_step": 4}
and `best.safetensors`, the best step's LoRA weights. A step redone after a kill overwrites its entry and replaces
the best only if it validates higher. Validation episodes are not training rollouts: the rollout ledger counts them
under their own stage, `validation`, and the training budget (`rollouts("training", ...)`) leaves them out.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trace_core.envs.base import Environment, EpisodeLimits
from trace_core.runs import write_json_atomic
from trace_core.training.ledger import RolloutLedger
from trace_core.training.settings import GRPOSettings

VALIDATION_STAGE = "validation"  # the ledger's stage for validation episodes
SELECTION = "selection.json"
BEST = "best.safetensors"


def split_seeds(train_seeds: Sequence[int], settings: GRPOSettings) -> tuple[list[int], list[int]]:
    """(training seeds, validation seeds): the last `select_episodes` seeds validate when selection is on."""
    seeds = list(train_seeds)
    if settings.select_every == 0:
        return seeds, []
    n = settings.select_episodes
    if n >= len(seeds):
        raise ValueError(
            f"select_episodes={n} leaves none of the {len(seeds)} training seeds to train on; lower it (e.g. "
            f"{max(1, len(seeds) // 8)}) or give the environment more training instances (synthesis.train_instances)"
        )
    return seeds[:-n], seeds[-n:]


def better(entry: dict[str, Any], best: dict[str, Any] | None) -> bool:
    """Whether a validated step beats the best so far: higher success rate, or equal and higher mean reward."""
    if best is None:
        return True
    return (entry["success_rate"], entry["mean_reward"]) > (best["success_rate"], best["mean_reward"])


class BestStep:
    """Validates the trainer's model on the validation seeds and keeps the best step's LoRA weights in `work`."""

    def __init__(
        self,
        env: Environment,
        tokenizer: Any,
        settings: GRPOSettings,
        seeds: Sequence[int],
        *,
        work: str | os.PathLike,
        ledger: RolloutLedger,
        capability_id: str,
        make_user: Callable[[], Any],
        limits: EpisodeLimits,
        max_context: int,
        progress: bool = False,
    ):
        self.env, self.tokenizer, self.settings = env, tokenizer, settings
        self.seeds = list(seeds)
        self.work = Path(work)
        self.ledger, self.capability_id = ledger, capability_id
        self.make_user, self.limits, self.max_context = make_user, limits, max_context
        self.progress = progress
        self.trainer: Any = None
        self.state = self._load()

    def _load(self) -> dict[str, Any]:
        path = self.work / SELECTION
        if path.exists():
            state = json.loads(path.read_text(encoding="utf-8"))
            if state.get("seeds") != self.seeds:
                raise ValueError(
                    f"{path} validated other seeds than this run's; it belongs to another run: delete the folder "
                    f"{self.work} to start afresh"
                )
            if state.get("best_step") is not None and not (self.work / BEST).exists():
                state["best_step"] = None  # the weights were lost: the next validated step becomes the best
            return state
        return {"seeds": self.seeds, "steps": {}, "best_step": None}

    @property
    def best_step(self) -> int | None:
        return self.state["best_step"]

    def validated(self, step: int) -> bool:
        return str(step) in self.state["steps"]

    def _model(self) -> Any:
        return self.trainer.accelerator.unwrap_model(self.trainer.model)

    def validate(self, step: int) -> dict[str, Any]:
        """Play the validation seeds with the current weights, record the step and keep its weights if best."""
        from trace_core.training.evaluation import play_greedy_model
        from trace_core.training.trainer import lora_state

        model = self._model()
        was_training = model.training
        model.eval()
        try:
            with self.trainer.accelerator.autocast():  # the precision the rollouts sample in
                episodes = play_greedy_model(
                    self.env, model, self.tokenizer, self.seeds, name=f"validation:{self.capability_id}",
                    make_user=self.make_user, limits=self.limits, batch_size=self.settings.rollout_batch_size,
                    max_context=self.max_context, max_new_tokens=self.settings.max_new_tokens,
                    seed=self.settings.seed)
        finally:
            model.train(was_training)
        self.ledger.add(VALIDATION_STAGE, self.capability_id, rollouts=len(episodes))
        successes = sum(t.success for t in episodes)
        entry = {
            "successes": successes,
            "episodes": len(episodes),
            "success_rate": successes / len(episodes),
            "mean_reward": sum(t.reward for t in episodes) / len(episodes),
        }
        best = self.state["steps"].get(str(self.best_step)) if self.best_step is not None else None
        if better(entry, best):
            self._keep(lora_state(model), step)
            self.state["steps"][str(step)] = entry
        elif self.best_step != step:
            self.state["steps"][str(step)] = entry
        # else: a step redone after a kill that validated higher the first time: those weights and figures stay
        write_json_atomic(self.work / SELECTION, self.state)
        if self.progress:
            print(f"[validation] {self.capability_id} step {step}: {successes}/{len(episodes)} solved, mean reward "
                  f"{entry['mean_reward']:.3f} (best: step {self.best_step})", flush=True)
        return entry

    def _keep(self, weights: dict[str, Any], step: int) -> None:
        from safetensors.torch import save_file

        self.work.mkdir(parents=True, exist_ok=True)
        tmp = self.work / (BEST + ".tmp")
        save_file(weights, str(tmp))
        os.replace(tmp, self.work / BEST)
        self.state["best_step"] = step

    def restore_best(self) -> None:
        """Put the best step's LoRA weights into the trainer's model."""
        try:
            load_lora_state(self._model(), self.work / BEST)
        except ValueError as err:
            raise RuntimeError(f"{err}; delete {self.work} and train afresh") from err

    def record(self) -> dict[str, Any]:
        """What the adapter record keeps: the seeds, every validated step and the step kept."""
        return {
            "every": self.settings.select_every,
            "seeds": self.seeds,
            "episodes": self.ledger.rollouts(VALIDATION_STAGE, self.capability_id),
            "steps": [{"step": int(k), **v} for k, v in sorted(self.state["steps"].items(), key=lambda kv: int(kv[0]))],
            "best_step": self.best_step,
        }

    def callback(self) -> Any:
        """A Trainer callback validating after every `select_every`-th step and after the last one."""
        from transformers import TrainerCallback

        selection = self

        class ValidateSteps(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                step = int(state.global_step)
                last = step >= state.max_steps or control.should_training_stop
                if step % selection.settings.select_every == 0 or last:
                    selection.validate(step)
                return control

        return ValidateSteps()


def load_lora_state(model: Any, path: str | os.PathLike) -> None:
    """Copy the LoRA weights saved at `path` (a `trainer.lora_state` file such as best.safetensors: the PEFT model's
    own parameter names, adapter name included) into `model`'s parameters of the same names, in their dtype.

    Why not PEFT's `set_peft_model_state_dict`, as checkpoints are loaded: that takes the adapter file's naming
    (adapter name stripped), while this file is written from `named_parameters()` like `lora_start.safetensors`,
    whose names `lora_abs_change` compares against. Raises ValueError when the file names weights `model` lacks
    or weights of other shapes (another LoRA rank or target modules: another run's file)."""
    import torch
    from safetensors.torch import load_file

    weights = load_file(str(path))
    params = dict(model.named_parameters())
    missing = [name for name in weights if name not in params]
    if missing:
        raise ValueError(f"{path} holds weights the model lacks ({missing[:3]}): it belongs to another LoRA setup")
    shapes = [name for name, value in weights.items() if value.shape != params[name].shape]
    if shapes:
        raise ValueError(f"{path} holds weights of other shapes than the model's ({shapes[:3]}, e.g. another LoRA "
                         "rank): it belongs to another LoRA setup")
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value.to(params[name].dtype))
