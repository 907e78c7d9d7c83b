"""Stage `baselines` (docs/method.md §5): the equal-budget baselines TRACE is compared with, each trained or evolved
within TRACE's total training rollouts (the sum over the adapter records), on a fresh copy of the base weights.

- `stage`: `run`, the stage entry point (artifacts/baselines/: baselines.json and one folder per baseline).
- `target`: GRPO directly on target training tasks (`grpo_target`).
- `mixture`: one LoRA trained on a mixture of all synthetic environments (`mixture`).
- `prompt_evolution`: prompt optimisation with the `gepa` package (`gepa`).

Stage evaluation plays what these produce on the held-out instances. Heavy libraries (torch, transformers, peft,
gepa) are imported inside the functions that need them.
"""

from trace_core.baselines.stage import run

__all__ = ["run"]
