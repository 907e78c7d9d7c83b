"""Prefect task for stage `baselines`: `trace_core.baselines.run` (grpo_target, gepa, mixture within TRACE's
rollout budget), logged to MLflow (experiment trace-baselines) with the baselines' record as an artifact."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from tasks import ROOT, STAGE_CODE, code_version, out_dir, run_stage
from trace_core.config import Params

STAGE = "baselines"
VERSION = code_version(STAGE_CODE[STAGE])
FILES = ("baselines.json", "metrics.json")


@task(name=STAGE, version=VERSION, retries=0, persist_result=False)
def baselines(params: Params, root: str | Path = ROOT) -> dict:
    """Train or evolve the equal-budget baselines; writes <baselines.out_dir>/{baselines.json,metrics.json,
    grpo_target/,gepa/,mixture/}."""
    return run_stage(STAGE, VERSION, params, root, out_dir(root, params.baselines.out_dir), FILES, progress=True)
