"""Stage `training` (docs/method.md §3): one LoRA adapter per capability, trained with GRPO on its synthetic
environment.

- `settings`: `GRPOSettings`, the validated knobs of a run (values in params.yaml `training:`).
- `episodes`: a multi-turn episode as one training sequence (prompt, completion, env_mask, sampled logprobs).
- `policy`: `TokenConsistentPolicy`, the rollout policy whose every turn is prompted with the training tokens.
- `grpo`: groups of rollouts, group advantages, and the DAPO-style refill of constant-reward groups.
- `ledger`: `RolloutLedger`, every rollout spent per stage and capability, persisted.
- `trainer`: `train_adapter`, TRL's GRPOTrainer driven by our multi-turn rollouts, checkpoints, the adapter record.
- `evaluation`: held-out success of base vs. base + adapter, with Wilson and paired bootstrap intervals.
- `stage`: `run`, the stage entry point: one folder per capability under artifacts/training/.

Heavy libraries (torch, transformers, trl, peft) are imported inside the functions that need them.
"""

from trace_core.training.episodes import EpisodeTokens, episode_tokens
from trace_core.training.grpo import Collection, Group, collect_groups, group_advantages, informative, run_groups
from trace_core.training.ledger import RolloutLedger
from trace_core.training.policy import TokenConsistentPolicy
from trace_core.training.settings import GRPOSettings
from trace_core.training.trainer import build_trainer, train_adapter

__all__ = [
    "Collection",
    "EpisodeTokens",
    "GRPOSettings",
    "Group",
    "RolloutLedger",
    "TokenConsistentPolicy",
    "build_trainer",
    "collect_groups",
    "episode_tokens",
    "group_advantages",
    "informative",
    "run",
    "run_groups",
    "train_adapter",
]


def run(params, out_dir=None, **kwargs):
    """Stage entry point (see `trace_core.training.stage.run`)."""
    from trace_core.training.stage import run as _run

    return _run(params, out_dir, **kwargs)
