"""Prefect task for stage `baseline`: `trace_core.baseline.run`, logged to MLflow (experiment trace-baseline)."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from tasks import ROOT, STAGE_CODE, code_version, out_dir, run_stage
from trace_core.config import Params

STAGE = "baseline"
VERSION = code_version(STAGE_CODE[STAGE])


@task(name=STAGE, version=VERSION, retries=0, persist_result=False)
def baseline(params: Params, root: str | Path = ROOT) -> dict:
    """Roll out and score the base agent; writes <baseline.out_dir>/{trajectories.jsonl,metrics.json,table.md}."""
    return run_stage(STAGE, VERSION, params, root, out_dir(root, params.baseline.out_dir), ("metrics.json", "table.md"))
