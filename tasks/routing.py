"""Prefect task for stage `routing`: `trace_core.routing.run` (the router's choice of adapter per held-out
instance), logged to MLflow (experiment trace-routing) with the decisions as an artifact, and the trained gate (when
a scoring is gate) as artifacts under gate/ with the adapters it routes to as tags."""

from __future__ import annotations

import json
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
    out = out_dir(root, params.routing.out_dir)

    def then(run, metrics: dict) -> None:
        log_gates(run, out)

    return run_stage(STAGE, VERSION, params, root, out, FILES, then=then, progress=True)


def log_gates(run, out: Path) -> list[str]:
    """Log every gate stage routing trained (<out>/gate/*.json) under the artifact path gate/, and tag the run with
    each gate's classes (the adapters it routes to, "none" = the base model) and its sha256; returns their names."""
    decisions = out / "decisions.json"
    hashes = json.loads(decisions.read_text()).get("gates", {}) if decisions.exists() else {}
    tags = {}
    for name, sha in sorted(hashes.items()):
        path = out / "gate" / name
        if not path.exists():
            continue
        run.log_artifact(path, artifact_path="gate")
        stem = name.removesuffix(".json")
        tags[f"trace.{stem}.routes_to"] = ",".join(json.loads(path.read_text())["classes"])
        tags[f"trace.{stem}.sha256"] = sha
    if tags:
        run.set_tags(tags)
    return sorted(hashes)
