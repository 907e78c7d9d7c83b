"""Prefect task for stage `evaluation`: `trace_core.evaluation.run` (every method on the held-out target instances),
logged to MLflow (experiment trace-evaluation) with the results, table, report and plot data as artifacts; each
adapter that improved its own capability becomes the `champion` version of its model `trace-<capability_id>`."""

from __future__ import annotations

import logging
from pathlib import Path

from prefect import task

from tasks import ROOT, STAGE_CODE, code_version, out_dir, run_stage
from trace_core.config import Params
from trace_core.inputs import StageInputError
from trace_core.runs import read_typed
from trace_core.schemas import AdapterRecord, EvaluationResults

STAGE = "evaluation"
VERSION = code_version(STAGE_CODE[STAGE])
FILES = ("results.json", "metrics.json", "table.md", "report.html", "curve.csv", "confusion.csv", "transfer.csv",
         "routing.csv")


def _logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        from prefect.logging import get_run_logger

        return get_run_logger()  # shows in the Prefect UI under the task run
    except Exception:  # noqa: BLE001 - outside a flow/task run
        return logging.getLogger(__name__)


def promote_champions(run, params: Params, root: str | Path, out: Path) -> dict[str, str]:
    """Point alias `champion` of each champion's model (results.json `champions`) at the version holding the adapter
    that was evaluated (its sha256 in <training.out_dir>/<id>/adapter_record.json); tag `run` with
    `trace.champion.<id>` = the version, or `unregistered`; return those tags' values by capability."""
    from tasks import tracking

    results = out / "results.json"
    fix = "re-run stage evaluation (and training for a missing adapter record)"
    champions = read_typed(results, EvaluationResults, "evaluation results", fix, StageInputError).champions \
        if results.exists() else []
    training_dir = out_dir(root, params.training.out_dir)
    outcome: dict[str, str] = {}
    for capability_id in champions:
        record = training_dir / capability_id / "adapter_record.json"
        sha = read_typed(record, AdapterRecord, "an adapter record", fix, StageInputError).adapter_sha256 \
            if record.exists() else None
        try:
            version = tracking.promote_champion(run, capability_id, sha, root=root)
        except LookupError as exc:  # the evaluation stands; only the registry bookkeeping is missing
            _logger().warning("champion %s not promoted: %s", capability_id, exc)
            outcome[capability_id] = "unregistered"
        else:
            outcome[capability_id] = str(version.version)
    run.set_tags({f"trace.champion.{cid}": value for cid, value in outcome.items()})
    return outcome


@task(name=STAGE, version=VERSION, retries=0, persist_result=False)
def evaluation(params: Params, root: str | Path = ROOT) -> dict:
    """Evaluate every method on held-out instances (writes <evaluation.out_dir>/{results.json,table.md,report.html,
    curve.csv,confusion.csv,transfer.csv,metrics.json,trajectories/}) and promote the champions."""
    out = out_dir(root, params.evaluation.out_dir)

    def then(run, metrics: dict) -> None:
        promote_champions(run, params, root, out)

    return run_stage(STAGE, VERSION, params, root, out, FILES, then=then, progress=True)
