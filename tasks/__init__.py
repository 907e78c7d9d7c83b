"""Prefect tasks: one thin wrapper per TRACE stage around one `trace_core` call, plus `tracking` (the one module
that talks to MLflow).

Importing this package first sets quiet, offline-friendly defaults (no telemetry, a project-local Prefect home,
a startup timeout that suits small machines); variables already set in the environment win.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

_ENV_DEFAULTS = {
    "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "HF_HUB_OFFLINE": "1",
    # The temporary Prefect server that runs a flow when no PREFECT_API_URL is set takes 13-20 s to start on
    # two busy cores; Prefect's default limit is 20 s.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}


def _set_env_defaults() -> None:
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    # Prefect's database and settings for this project live in .prefect/ (git-ignored) unless told otherwise.
    # Only effective before prefect is imported (a Prefect worker has already configured its own home).
    if "prefect" not in sys.modules:
        os.environ.setdefault("PREFECT_HOME", str(ROOT / ".prefect"))


_set_env_defaults()

# The params.yaml sections each stage reads: logged to MLflow with the run, and the `params:` of the stage in
# dvc.yaml (tests/test_pipeline.py keeps the two equal).
STAGE_SECTIONS: dict[str, tuple[str, ...]] = {
    "bootstrap": ("seed", "model", "env", "user", "tasks", "bootstrap"),  # user: max_turns of the replays
    "baseline": ("seed", "model", "env", "user", "policy", "tasks", "baseline"),
    "analysis": ("seed", "baseline", "analysis"),
    "synthesis": ("seed", "model", "env", "policy", "bootstrap", "baseline", "analysis", "synthesis"),
    "training": ("model", "env", "user", "policy", "bootstrap", "analysis", "synthesis", "training", "evaluation.ci",
                 "evaluation.bootstrap_samples"),
    "routing": (
        "seed",
        "model",
        "env",
        "policy",
        "tasks",
        "bootstrap",
        "baseline",
        "analysis",
        "synthesis",
        "training",
        "routing",
        "evaluation",
    ),
    "baselines": (
        "seed",
        "model",
        "env",
        "user",
        "policy",
        "tasks",
        "bootstrap",
        "baseline",
        "synthesis",
        "training",
        "baselines",
        "evaluation",
    ),
    "evaluation": (
        "seed",
        "model",
        "env",
        "user",
        "policy",
        "tasks",
        "bootstrap",
        "baseline",
        "analysis",
        "synthesis",
        "training",
        "routing",
        "baselines",
        "evaluation",
    ),
}

# The trace_core code each stage runs: the task's Prefect `version` is a hash of it, and it is the stage's code
# `deps:` in dvc.yaml (checked by the tests). Folders count all their *.py files.
STAGE_CODE: dict[str, tuple[str, ...]] = {
    "bootstrap": (
        "trace_core/bootstrap.py",
        "trace_core/config.py",
        "trace_core/schemas.py",
        "trace_core/runs.py",  # the run key that lets a re-run reuse the merged weights
        "trace_core/envs",
        "trace_core/agents",
    ),
    "baseline": (
        "trace_core/baseline.py",
        "trace_core/bootstrap.py",
        "trace_core/runs.py",  # imported by bootstrap.py
        "trace_core/config.py",
        "trace_core/schemas.py",
        "trace_core/jsonl.py",  # JSONL that line separators cannot break
        "trace_core/metrics.py",
        "trace_core/envs",
        "trace_core/agents",
    ),
    "synthesis": (
        "trace_core/synthesis",
        "trace_core/bootstrap.py",
        "trace_core/config.py",
        "trace_core/schemas.py",
        "trace_core/jsonl.py",  # JSONL that line separators cannot break
        "trace_core/runs.py",  # the resume folder of calibration trajectories
        "trace_core/agents",
        "trace_core/envs",
    ),
    "analysis": (
        "trace_core/analysis",
        "trace_core/figures.py",  # the report's inline SVG charts
        "trace_core/config.py",
        "trace_core/schemas.py",
        "trace_core/jsonl.py",  # JSONL that line separators cannot break
        "trace_core/agents",
        "trace_core/envs",
    ),
    "training": (
        "trace_core/training",
        "trace_core/synthesis",  # the environments trained on are built from the synthesis code
        "trace_core/runs.py",  # run keys, folder claims, atomic records
        "trace_core/bootstrap.py",
        "trace_core/config.py",
        "trace_core/schemas.py",
        "trace_core/jsonl.py",  # JSONL that line separators cannot break
        "trace_core/agents",
        "trace_core/envs",
    ),
    "routing": (
        "trace_core/routing",
        "trace_core/analysis",  # the gate's representation (MiniLM embedding) and labels
        "trace_core/inputs.py",  # held-out instances, trained adapters, curve marks
        "trace_core/training",  # the base agent, adapter records, the synthetic environments' example openings
        "trace_core/synthesis",
        "trace_core/baseline.py",  # the held-out instances, as the baseline draws target instances
        "trace_core/runs.py",
        "trace_core/bootstrap.py",
        "trace_core/config.py",
        "trace_core/schemas.py",
        "trace_core/jsonl.py",  # JSONL that line separators cannot break
        "trace_core/metrics.py",
        "trace_core/agents",
        "trace_core/envs",
    ),
    "baselines": (
        "trace_core/baselines",
        "trace_core/inputs.py",  # held-out instances, trained adapters, curve marks
        "trace_core/training",  # the base agent, adapter records, GRPO
        "trace_core/synthesis",  # the synthetic environments (the mixture baseline)
        "trace_core/baseline.py",  # the held-out instances and the user simulator, as the baseline builds them
        "trace_core/analysis/base.py",  # trajectory summaries shown to GEPA's reflection
        "trace_core/runs.py",
        "trace_core/bootstrap.py",
        "trace_core/config.py",
        "trace_core/schemas.py",
        "trace_core/jsonl.py",  # JSONL that line separators cannot break
        "trace_core/metrics.py",
        "trace_core/agents",
        "trace_core/envs",
    ),
    "evaluation": (
        "trace_core/evaluation",
        "trace_core/inputs.py",  # held-out instances, trained adapters, curve marks
        "trace_core/routing",  # reading the routing decisions; composing adapters
        "trace_core/baselines",  # reading the baselines' record; GEPA's best prompt per curve mark
        "trace_core/training",  # the base agent, adapter records, rollout ledger
        "trace_core/synthesis",
        "trace_core/baseline.py",  # the user simulator, as the baseline builds it
        "trace_core/analysis",  # the programmatic labeller: the routing ground truth on the base row's episodes
        "trace_core/figures.py",  # the report's plots
        "trace_core/runs.py",  # run keys, folder claims, atomic records
        "trace_core/bootstrap.py",
        "trace_core/config.py",
        "trace_core/schemas.py",
        "trace_core/jsonl.py",  # JSONL that line separators cannot break
        "trace_core/metrics.py",
        "trace_core/agents",
        "trace_core/envs",
    ),
}


def code_version(paths: tuple[str, ...] | list[str], root: Path = ROOT) -> str:
    """A short content hash of the given files and folders (relative to `root`); changes when any of them does."""
    digest = hashlib.sha256()
    for rel in paths:
        path = root / rel
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for file in files:
            digest.update(file.relative_to(root).as_posix().encode())
            digest.update(b"\0")
            digest.update(file.read_bytes() if file.exists() else b"<missing>")
            digest.update(b"\0")
    return digest.hexdigest()[:12]


def out_dir(root: str | Path, configured: str) -> Path:
    """A stage's output folder: `configured` (from params.yaml) relative to the project root unless absolute."""
    path = Path(configured)
    return path if path.is_absolute() else Path(root) / path


class Terminated(BaseException):
    """SIGTERM arrived (`exit_on_sigterm`): raised in the main thread so that the stage's MLflow run ends KILLED and
    the process exits normally, which stops Prefect's temporary server (its atexit hook) instead of orphaning it."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum


def stopped_by_signal(exc: BaseException) -> bool:
    """Whether `exc` is how a signal stops a stage: `Terminated`, Prefect's `TerminationSignal` (the flow engine
    installs its own SIGTERM handler while a flow runs) or KeyboardInterrupt (Ctrl-C)."""
    if isinstance(exc, (Terminated, KeyboardInterrupt)):
        return True
    try:
        from prefect.exceptions import TerminationSignal
    except ImportError:  # pragma: no cover - prefect is a dependency of tasks/
        return False
    return isinstance(exc, TerminationSignal)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into `Terminated` in this process (main thread only; where another handler is already set,
    e.g. by a Prefect worker, it is kept)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return

    def handler(signum, frame):  # noqa: ARG001 - the signal handler's signature
        raise Terminated(signum)

    signal.signal(signal.SIGTERM, handler)


def run_tags(version: str) -> dict[str, str]:
    """MLflow tags linking a stage's run to its Prefect task version and flow/task run (when inside Prefect)."""
    tags = {"trace.task_version": version}
    try:
        from prefect.runtime import flow_run, task_run

        if flow_run.id:
            tags["prefect.flow_run_id"] = str(flow_run.id)
            tags["prefect.flow_run_name"] = str(flow_run.name)
        if task_run.id:
            tags["prefect.task_run_id"] = str(task_run.id)
    except Exception:  # noqa: BLE001 - tags are a convenience; never fail a stage over them
        pass
    return tags


def run_stage(
    stage: str,
    version: str,
    params,
    root: str | Path,
    out: Path,
    artifacts: tuple[str, ...],
    then: Callable[[Any, dict], None] | None = None,
    **kwargs,
) -> dict:
    """The body every stage task shares: call `trace_core.<stage>.run(params, out, **kwargs)` inside an MLflow run
    of experiment trace-<stage>, then log its metrics and the named output files (those that exist). `then(run,
    metrics)`, when given, records more in the same run (e.g. per-step metrics, a registered model)."""
    import importlib

    from tasks import tracking

    stage_module = importlib.import_module(f"trace_core.{stage}")  # looked up at call time (tests replace `run`)
    with tracking.stage_run(stage, params, root=root, sections=STAGE_SECTIONS[stage], tags=run_tags(version)) as run:
        metrics = stage_module.run(params, out, **kwargs)
        run.log_metrics(metrics)
        for name in artifacts:
            if (out / name).exists():
                run.log_artifact(out / name)
        if then is not None:
            then(run, metrics)
    return metrics
