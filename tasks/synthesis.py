"""Prefect task for stage `synthesis`, one task run per capability: `trace_core.synthesis.run` for that capability,
logged to MLflow (experiment trace-synthesis) with the capability's spec and validation report."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from tasks import ROOT, STAGE_CODE, code_version, out_dir, run_stage
from trace_core.config import Params

STAGE = "synthesis"
VERSION = code_version(STAGE_CODE[STAGE])


@task(name=STAGE, version=VERSION, retries=0, persist_result=False, task_run_name="synthesis-{capability}")
def synthesis(params: Params, capability: str, root: str | Path = ROOT, progress: bool = False) -> dict:
    """Build and validate `capability`'s environment; writes <synthesis.out_dir>/<capability>/. `progress` shows
    progress bars (off when capabilities run side by side: their bars would interleave)."""
    out = out_dir(root, params.synthesis.out_dir)
    files = tuple(f"{capability}/{name}" for name in ("spec.json", "validation.json", "validation.html"))
    return run_stage(STAGE, VERSION, params, root, out, files, capability=capability, progress=progress)
