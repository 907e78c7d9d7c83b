"""Stage `bootstrap`: the tool-use warm-start that turns the raw model into the base agent.

(Being implemented; signatures are fixed.)"""

from __future__ import annotations

from pathlib import Path

from trace_core.config import Params


def agent_model_path(params: Params) -> str:
    """Where the base agent's weights are: the bootstrap output when enabled, else the provisioned model."""
    raise NotImplementedError


def run(params: Params, out_dir: Path | None = None) -> dict:
    """Train the warm-start LoRA on reference dialogues, merge it, save `out_dir/model/`; write
    `out_dir/manifest.json` and `out_dir/metrics.json`; return the metrics dict."""
    raise NotImplementedError
