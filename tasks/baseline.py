"""Prefect task for stage `baseline`: `trace_core.baseline.run`, logged to MLflow (experiment trace-baseline)."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from tasks import ROOT, STAGE_CODE, STAGE_SECTIONS, code_version, out_dir, run_tags, tracking
from trace_core.config import Params

STAGE = "baseline"
VERSION = code_version(STAGE_CODE[STAGE])


@task(name=STAGE, version=VERSION, retries=0, persist_result=False)
def baseline(params: Params, root: str | Path = ROOT) -> dict:
    """Roll out and score the base agent; writes <baseline.out_dir>/{trajectories.jsonl,metrics.json,table.md}."""
    from trace_core import baseline as stage  # looked up at call time (tests replace `stage.run`)

    out = out_dir(root, params.baseline.out_dir)
    with tracking.stage_run(
        STAGE, params, root=root, sections=STAGE_SECTIONS[STAGE], tags=run_tags(VERSION)
    ) as run:
        metrics = stage.run(params, out)
        run.log_metrics(metrics)
        run.log_artifact(out / "metrics.json")
        run.log_artifact(out / "table.md")
    return metrics
