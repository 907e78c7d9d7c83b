"""Prefect task for stage `training`, one task run per capability: `trace_core.training.run` for that capability
inside an MLflow run (experiment trace-training) that also holds the per-step training metrics, the adapter record,
the evaluation report and — when an adapter was trained — its registered model version `trace-<capability_id>`
(alias `candidate`)."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task

from tasks import ROOT, STAGE_CODE, code_version, out_dir, run_stage
from trace_core.config import Params
from trace_core.runs import read_typed
from trace_core.inputs import StageInputError
from trace_core.schemas import AdapterEval, AdapterRecord

STAGE = "training"
VERSION = code_version(STAGE_CODE[STAGE])
FILES = ("adapter_record.json", "eval.json", "training_metrics.json")


def capability_tags(params: Params, root: str | Path, capability_id: str) -> dict[str, str]:
    """The analysis statistics of a capability (coverage, contrastive gap, selection) as model-version tags; none
    when capabilities.json does not list it."""
    from trace_core.schemas import CapabilityDictionary

    path = out_dir(root, params.analysis.out_dir) / "capabilities.json"
    if not path.exists():
        return {}
    try:
        capability = CapabilityDictionary.model_validate_json(path.read_text()).get(capability_id)
    except KeyError:
        return {}
    s = capability.stats
    return {
        "capability.selected": str(capability.selected).lower(),
        "capability.labeller": capability.labeller,
        "capability.coverage_mean": f"{s.coverage_mean:.4f}",
        "capability.coverage_ci": json.dumps([round(x, 4) for x in s.coverage_ci]),
        "capability.delta_mean": f"{s.delta_mean:.4f}",
        "capability.delta_ci": json.dumps([round(x, 4) for x in s.delta_ci]),
        "capability.er_minus_mean": f"{s.er_minus_mean:.4f}",
        "capability.er_plus_mean": f"{s.er_plus_mean:.4f}",
        "capability.runs_passed": f"{s.runs_passed}/{s.runs}",
    }


def adapter_tags(record: AdapterRecord, report: AdapterEval | None) -> dict[str, str]:
    """What the adapter was trained on and how it did on held-out seeds, as model-version tags."""
    extra = record.model_extra or {}
    tags = {
        "trace.spec_hash": str(record.spec_hash),
        "trace.data_hash": str(record.data_hash),
        "trace.template": str(extra.get("template")),
        "trace.difficulty": str(extra.get("difficulty")),
        "trace.base_model": str(record.base_model),
        "trace.base_fingerprint": str(record.base_fingerprint),
        "trace.steps": str(record.steps),
        "trace.rollouts": str(record.rollouts),
    }
    if report is not None:
        tags["eval.episodes"] = str(report.base.episodes)
        tags["eval.base_success"] = f"{report.base.success_rate:.4f}"
        tags["eval.adapter_success"] = f"{report.adapter.success_rate:.4f}"
        tags["eval.difference"] = f"{report.difference.success_rate:.4f}"
        tags["eval.difference_ci"] = json.dumps([round(x, 4) for x in report.difference.ci])
        if report.learned is not None:
            tags["eval.learned"] = str(report.learned).lower()
    return tags


def record_outcome(run, params: Params, root: str | Path, folder: Path) -> None:
    """Log a capability's per-step metrics to `run` and register its adapter (when one was trained)."""
    from tasks import tracking

    steps = folder / "training_metrics.json"
    if steps.exists():
        run.log_steps(json.loads(steps.read_text())["steps"])
    fix = f"re-run stage training for {folder.name}"
    record = read_typed(folder / "adapter_record.json", AdapterRecord, "an adapter record", fix, StageInputError)
    if not record.trained:
        return
    eval_path = folder / "eval.json"
    report = read_typed(eval_path, AdapterEval, "a held-out evaluation", fix, StageInputError) \
        if eval_path.exists() else None
    capability_id = record.capability_id
    base = Path(str(record.base_model))
    base = base if base.is_absolute() else Path(root) / base  # the stage ran with the project root as cwd
    tags = {**capability_tags(params, root, capability_id), **adapter_tags(record, report)}
    version = tracking.register_adapter(run, capability_id, folder / "adapter", base, tags, root=root)
    run.set_tags({"trace.model": version.name, "trace.model_version": version.version})


@task(name=STAGE, version=VERSION, retries=0, persist_result=False, task_run_name="training-{capability}")
def training(params: Params, capability: str, root: str | Path = ROOT) -> dict:
    """Train and evaluate `capability`'s adapter (writes <training.out_dir>/<capability>/) and register it."""
    out = out_dir(root, params.training.out_dir)
    files = tuple(f"{capability}/{name}" for name in FILES)

    def then(run, metrics: dict) -> None:
        record_outcome(run, params, root, out / capability)

    # Capabilities train one after another (flows/pipeline.py), so one progress bar at a time.
    return run_stage(STAGE, VERSION, params, root, out, files, then=then, capability=capability, progress=True)
