"""Prefect task for stage `analysis`: `trace_core.analysis.run`, logged to MLflow (experiment trace-analysis)
with the capability dictionary and the report as artifacts."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from tasks import ROOT, STAGE_CODE, code_version, out_dir, run_stage
from trace_core.config import Params

STAGE = "analysis"
VERSION = code_version(STAGE_CODE[STAGE])


@task(name=STAGE, version=VERSION, retries=0, persist_result=False)
def analysis(params: Params, root: str | Path = ROOT) -> dict:
    """Label the baseline trajectories and select capabilities; writes <analysis.out_dir>/{capabilities.json,
    labels.parquet,report.html,metrics.json}."""
    artifacts = ("capabilities.json", "report.html", "labels.parquet", "metrics.json")
    return run_stage(STAGE, VERSION, params, root, out_dir(root, params.analysis.out_dir), artifacts)
