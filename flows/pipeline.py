"""The Prefect flow `trace-pipeline`: TRACE's stages in order, each one Prefect task (see tasks/).

    python -m flows.pipeline                      # every stage
    python -m flows.pipeline --stage baseline     # one stage (what dvc.yaml calls)
    python -m flows.pipeline -S policy.batch_size=8 --params params.yaml

With no PREFECT_API_URL set, Prefect starts a temporary local server for the run (10-20 s) and keeps its
records in .prefect/; with a server running (`prefect server start`) the run shows in its UI.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

from prefect import flow

# first: importing tasks sets the quiet/offline environment before prefect loads
from tasks import exit_on_sigterm, out_dir, stopped_by_signal
from tasks.analysis import analysis
from tasks.baseline import baseline
from tasks.baselines import baselines
from tasks.bootstrap import bootstrap
from tasks.evaluation import evaluation
from tasks.routing import routing
from tasks.synthesis import synthesis
from tasks.training import training

# Stage order = data flow. Each stage reads the previous one's outputs from artifacts/<stage>/.
STAGES = ("bootstrap", "baseline", "analysis", "synthesis", "training", "routing", "baselines", "evaluation")


@flow(name="trace-pipeline", persist_result=False, validate_parameters=True)
def pipeline(
    params_path: str = "params.yaml",
    stage: str | None = None,
    overrides: dict[str, Any] | None = None,
    capability: str | None = None,
) -> dict[str, dict]:
    """Run the TRACE stages (or only `stage`) with the parameters in `params_path` plus `overrides`."""
    from trace_core.cli import load

    if stage is not None and stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
    params = load(params_path, overrides or {})
    root = str(Path(params_path).resolve().parent)

    def wanted(name: str) -> bool:
        return stage is None or stage == name

    results: dict[str, dict] = {}
    if wanted("bootstrap"):
        results["bootstrap"] = bootstrap(params, root)  # the raw model -> the base agent
    if wanted("baseline"):
        results["baseline"] = baseline(params, root)  # the base agent on held-out instances -> pass rates
    if wanted("analysis"):
        results["analysis"] = analysis(params, root)  # pass/fail trajectories -> capability dictionary
    if wanted("synthesis"):
        # One task run per capability (the DVC entries synthesis@<id> name one each), concurrently unless the base
        # agent is rolled out for calibration: then they would only compete for the same cores.
        capabilities = [capability] if capability else _synthesis_capabilities(params, root)
        if params.synthesis.calibration.enabled or len(capabilities) == 1:
            results["synthesis"] = {cid: synthesis(params, cid, root, progress=True) for cid in capabilities}
        else:
            futures = [synthesis.submit(params, cid, root) for cid in capabilities]
            results["synthesis"] = {cid: f.result() for cid, f in zip(capabilities, futures)}
    if wanted("training"):
        # One task run per capability (the DVC entries training@<id> name one each), one after another: each
        # trains a model, and concurrent trainers would only compete for the same cores or accelerator memory.
        capabilities = [capability] if capability else _training_capabilities(params, root)
        results["training"] = {cid: training(params, cid, root) for cid in capabilities}
    if wanted("routing"):
        results["routing"] = routing(params, root)  # the router's adapter choice per held-out instance
    if wanted("baselines"):
        results["baselines"] = baselines(params, root)  # grpo_target, gepa, mixture within TRACE's budget
    if wanted("evaluation"):
        results["evaluation"] = evaluation(params, root)  # every method on held-out instances -> table, champions
    return results


def _synthesis_capabilities(params, root: str) -> list[str]:
    """synthesis.capabilities plus whatever analysis selected beyond them."""
    import json

    selected: list[str] = []
    path = out_dir(root, params.analysis.out_dir) / "capabilities.json"
    if path.exists():
        selected = json.loads(path.read_text()).get("selected", [])
    return list(dict.fromkeys([*params.synthesis.capabilities, *selected]))


def _training_capabilities(params, root: str) -> list[str]:
    """synthesis.capabilities plus any other capability whose environment is ready."""
    from trace_core.training.stage import capabilities

    return capabilities(params, out_dir(root, params.synthesis.out_dir))


def main(argv: list[str] | None = None) -> int:
    from trace_core.cli import load, parse_overrides

    parser = argparse.ArgumentParser(
        prog="python -m flows.pipeline",
        description="Run TRACE's stages as the Prefect flow trace-pipeline (MLflow logs each stage's run).",
    )
    parser.add_argument("--stage", choices=STAGES, default=None, help="run only this stage's task (default: all)")
    parser.add_argument("--params", default="params.yaml", metavar="PATH", help="parameters file")
    parser.add_argument(
        "--capability", default=None, metavar="ID", help="synthesis, training: only this capability (default: all)"
    )
    parser.add_argument(
        "-S",
        "--set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override one parameter (value parsed as YAML; repeatable)",
    )
    args = parser.parse_args(argv)
    try:  # fail fast, before Prefect starts a server
        overrides = parse_overrides(args.set)
        params = load(args.params, overrides)
    except (ValueError, FileNotFoundError) as exc:
        print(f"{parser.prog}: bad parameters: {exc}", file=sys.stderr)
        return 2

    exit_on_sigterm()  # a SIGTERM ends the stage's MLflow run as KILLED and stops the temporary Prefect server
    try:
        pipeline(params_path=args.params, stage=args.stage, overrides=overrides, capability=args.capability)
    except BaseException as exc:
        if not stopped_by_signal(exc) or isinstance(exc, KeyboardInterrupt):
            raise
        signum = int(getattr(exc, "signum", getattr(exc, "signal", signal.SIGTERM)))
        print(f"{parser.prog}: stopped by signal {signum}; the stage's MLflow run is marked KILLED", file=sys.stderr)
        return 128 + signum

    root = Path(args.params).resolve().parent
    for name, folder in (("baseline", params.baseline.out_dir), ("evaluation", params.evaluation.out_dir)):
        table = out_dir(root, folder) / "table.md"
        if args.stage in (None, name) and table.exists():
            print(table.read_text().rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
