"""Stage `evaluation` (docs/method.md §4-5): TRACE's routed adapters against the base agent and the baselines, on
held-out target instances, every method under one rollout ledger. The router's decisions come from stage routing
(`trace_core.routing.stage`), the baselines' adapters and prompts from stage baselines (`trace_core.baselines`).

- `stage`: `run`, the stage entry point (artifacts/evaluation/: results, table, report, plots, trajectories).
- `stats`: pass^k with bootstrap intervals, per-family rows, paired comparisons, the results table.
- `report`: the self-contained HTML report and the DVC plot files.

Heavy libraries (torch, transformers, peft) are imported inside the functions that need them.
"""

from trace_core.evaluation.stage import run

__all__ = ["run"]
