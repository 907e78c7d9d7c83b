"""Prefect task for stage `bootstrap`: `trace_core.bootstrap.run`, logged to MLflow (experiment trace-bootstrap)."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from tasks import ROOT, STAGE_CODE, STAGE_SECTIONS, code_version, out_dir, run_tags, tracking
from trace_core.config import Params

STAGE = "bootstrap"
VERSION = code_version(STAGE_CODE[STAGE])


@task(name=STAGE, version=VERSION, retries=0, persist_result=False)
def bootstrap(params: Params, root: str | Path = ROOT) -> dict:
    """Warm-start the raw model; writes <bootstrap.out_dir>/{model/,manifest.json,metrics.json}."""
    from trace_core import bootstrap as stage  # looked up at call time (tests replace `stage.run`)

    out = out_dir(root, params.bootstrap.out_dir)
    with tracking.stage_run(
        STAGE, params, root=root, sections=STAGE_SECTIONS[STAGE], tags=run_tags(VERSION)
    ) as run:
        metrics = stage.run(params, out)
        run.log_metrics(metrics)
        run.log_artifact(out / "metrics.json")
        run.log_artifact(out / "manifest.json")
    return metrics
