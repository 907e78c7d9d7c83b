"""Prefect task for stage `bootstrap`: `trace_core.bootstrap.run`, logged to MLflow (experiment trace-bootstrap)."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from tasks import ROOT, STAGE_CODE, code_version, out_dir, run_stage
from trace_core.config import Params

STAGE = "bootstrap"
VERSION = code_version(STAGE_CODE[STAGE])


@task(name=STAGE, version=VERSION, retries=0, persist_result=False)
def bootstrap(params: Params, root: str | Path = ROOT) -> dict:
    """Warm-start the raw model; writes <bootstrap.out_dir>/{model/,manifest.json,metrics.json}."""
    return run_stage(STAGE, VERSION, params, root, out_dir(root, params.bootstrap.out_dir), ("metrics.json", "manifest.json"))
