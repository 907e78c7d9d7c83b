"""Stage `evaluation` (docs/method.md §4-5): TRACE's routed adapters against the base agent and the baselines, on
held-out target instances, every method under one rollout ledger.

- `stage`: `run`, the stage entry point (artifacts/evaluation/: results, table, report, plots, trajectories).
- `stats`: pass^k with bootstrap intervals, per-family rows, paired comparisons, the results table.
- `report`: the self-contained HTML report and the DVC plot files.
- `target`: GRPO directly on target training tasks (the same rollout budget as TRACE).
- `mixture`: one LoRA trained on a mixture of all synthetic environments.
- `prompt_evolution`: prompt optimisation with the `gepa` package under the same budget.

Heavy libraries (torch, transformers, peft, gepa) are imported inside the functions that need them.
"""

from trace_core.evaluation.stage import run

__all__ = ["run"]
