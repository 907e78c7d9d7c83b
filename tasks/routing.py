"""Prefect task for stage `routing`: `trace_core.routing.run` (the router's choice of adapter per held-out
instance), logged to MLflow (experiment trace-routing) with the decisions as an artifact."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from tasks import ROOT, STAGE_CODE, code_version, out_dir, run_stage
from trace_core.config import Params

STAGE = "routing"
VERSION = code_version(STAGE_CODE[STAGE])
FILES = ("decisions.json", "metrics.json")


@task(name=STAGE, version=VERSION, retries=0, persist_result=False)
def routing(params: Params, root: str | Path = ROOT) -> dict:
    """Route every held-out instance over the trained adapters; writes <routing.out_dir>/{decisions.json,
    metrics.json,probabilities/}."""
    return run_stage(STAGE, VERSION, params, root, out_dir(root, params.routing.out_dir), FILES, progress=True)
