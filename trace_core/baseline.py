"""Stage `baseline`: roll out the base agent on held-out target instances and score it.

(Being implemented; signatures are fixed.)"""

from __future__ import annotations

from pathlib import Path

from trace_core.config import Params


def run(params: Params, out_dir: Path | None = None, progress: bool = True) -> dict:
    """Write `out_dir/trajectories.jsonl` (resumable), `out_dir/metrics.json` and `out_dir/table.md`;
    return the metrics dict (keys include "pass^1", "mean_reward", "per_family")."""
    raise NotImplementedError
