"""The one place that talks to MLflow.

Runs go to a local store that needs no server: the tracking URI in `params.tracking.mlflow_uri` (by default
`sqlite:///mlflow/mlflow.db`, relative to the project root) and artifacts under `params.tracking.artifact_root`.
Each stage logs into the experiment `trace-<stage>`, created here with an explicit `file://` artifact location.

    configure(params, root)                  -> MlflowClient (tracking URI set, folders created)
    with stage_run("baseline", params, root=root) as run:
        run.log_metrics(metrics)             # nested dicts flattened with "/"
        run.log_artifact(out_dir / "table.md")

Metric names keep their spelling except for characters MLflow refuses (e.g. "pass^1" is logged as "pass_1").

Trained adapters go to the model registry (`register_adapter`): model `trace-<capability_id>`, one version per
distinct adapter (keyed on its sha256; check-and-create holds an inter-process lock), only the adapter stored, the
newest one under the alias `candidate`.
Stage evaluation moves the alias `champion` to the versions whose adapter improved its capability
(`promote_champion`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import socket
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from tasks import ROOT, STAGE_SECTIONS

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

import mlflow

_BAD_NAME_CHARS = re.compile(r"[^\w./\- ]")
_MAX_PARAM_LEN = 6000  # MLflow's limit for a param value


def resolve_uri(uri: str, root: str | Path = ROOT) -> str:
    """Make a relative `sqlite:///` or plain-path tracking URI absolute under `root`, creating its folder."""
    root = Path(root)
    if uri.startswith("sqlite:///"):
        rel = uri[len("sqlite:///") :]
        path = Path(rel)
        if not path.is_absolute():
            path = root / path
        path.parent.mkdir(parents=True, exist_ok=True)
        return "sqlite:///" + str(path.resolve())
    if "://" not in uri:  # a plain folder: MLflow's file store
        path = Path(uri) if Path(uri).is_absolute() else root / uri
        path.mkdir(parents=True, exist_ok=True)
        return path.resolve().as_uri()
    return uri


def artifact_location(params, experiment: str, root: str | Path = ROOT) -> str:
    base = Path(params.tracking.artifact_root)
    if not base.is_absolute():
        base = Path(root) / base
    path = (base / experiment).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path.as_uri()


def store_lock(uri: str, root: str | Path = ROOT):
    """An inter-process lock (`filelock.FileLock`) for the store at `uri`: beside a sqlite database
    (`<db>.lock`), inside a file store's folder, else (a tracking server) in the project's `mlflow/` folder.
    Held around first-time store creation (schema migrations) and around registration's check-and-create, so
    concurrent processes neither migrate one database twice nor register one adapter twice."""
    from urllib.parse import urlparse

    from filelock import FileLock

    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///") :] + ".lock")
    elif uri.startswith("file:"):
        path = Path(urlparse(uri).path) / ".trace.lock"
    else:
        path = Path(root) / "mlflow" / ".registry.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(path))


_READY: set[str] = set()  # stores this process has opened (created and migrated) under the lock


def configure(params, root: str | Path = ROOT) -> MlflowClient:
    """Point MLflow (the fluent API too) at the project's store and return a client bound to it. The first use of
    a store in a process opens it under `store_lock`: MLflow creates and migrates a new sqlite store's tables on
    first access, and two processes doing that at once fail ("table ... already exists")."""
    uri = resolve_uri(params.tracking.mlflow_uri, root)
    mlflow.set_tracking_uri(uri)
    if uri in _READY:
        return MlflowClient(tracking_uri=uri)
    with store_lock(uri, root):
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)  # creates / migrates the tracking tables
        client.search_registered_models(max_results=1)  # ... and the registry's
    _READY.add(uri)
    return client


def ensure_experiment(client: MlflowClient, name: str, params, root: str | Path = ROOT) -> str:
    """The id of experiment `name`, created (with a file:// artifact location) if missing."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location(params, name, root))
    except MlflowException:  # created concurrently by another process
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def flatten(data: Mapping[str, Any], sep: str, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten(value, sep, name))
        else:
            out[name] = value
    return out


def metric_name(name: str) -> str:
    return _BAD_NAME_CHARS.sub("_", name)


def stage_params(params, sections: tuple[str, ...] | list[str]) -> dict[str, str]:
    """The sections a stage reads (a dotted name picks one key of a section, as in dvc.yaml), flattened to
    "section.key" -> value (lists as JSON)."""
    dumped = params.model_dump(mode="json")
    picked: dict = {}
    for name in sections:
        *parents, leaf = name.split(".")
        source, target = dumped, picked
        for part in parents:
            source, target = source.get(part, {}), target.setdefault(part, {})
        if isinstance(source, dict) and leaf in source:
            target[leaf] = source[leaf]
    out = {}
    for key, value in flatten(picked, ".").items():
        text = value if isinstance(value, str) else json.dumps(value)
        out[metric_name(key)] = text[:_MAX_PARAM_LEN]
    return out


def git_tags(root: str | Path = ROOT) -> dict[str, str]:
    """The git commit (and whether the tree had uncommitted changes) when `root` is a git checkout."""

    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return {}
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"mlflow.source.git.commit": commit, "git.dirty": str(bool(dirty)).lower()}


class StageRun:
    """An open MLflow run of one stage (what `stage_run` yields)."""

    def __init__(self, client: MlflowClient, run_id: str, experiment_id: str):
        self.client = client
        self.run_id = run_id
        self.experiment_id = experiment_id

    def log_metrics(self, metrics: Mapping[str, Any], step: int = 0) -> dict[str, float]:
        """Log every numeric leaf of `metrics` (nested keys joined with "/"); return what was logged."""
        logged: dict[str, float] = {}
        for key, value in flatten(metrics, "/").items():
            if isinstance(value, bool):
                value = float(value)
            if isinstance(value, (int, float)) and math.isfinite(value):
                logged[metric_name(key)] = float(value)
        if logged:
            from mlflow.entities import Metric

            ts = _now_ms()
            self.client.log_batch(
                self.run_id, metrics=[Metric(k, v, ts, step) for k, v in sorted(logged.items())]
            )
        return logged

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path)
        elif path.exists():
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_steps(self, rows: list[Mapping[str, Any]], prefix: str = "train/") -> int:
        """Log per-step rows (each with an integer "step") as metric histories `<prefix><key>`; return the count."""
        for row in rows:
            values = {f"{prefix}{k}": v for k, v in row.items() if k != "step"}
            self.log_metrics(values, step=int(row["step"]))
        return len(rows)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, str(value))


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)


@contextlib.contextmanager
def stage_run(
    stage: str,
    params,
    *,
    root: str | Path = ROOT,
    sections: tuple[str, ...] | list[str] | None = None,
    tags: Mapping[str, Any] | None = None,
    run_name: str | None = None,
) -> Iterator[StageRun]:
    """Open a run in experiment `trace-<stage>` with the stage's params (default: `STAGE_SECTIONS[stage]`) and
    the git commit as tags; it ends FINISHED, FAILED if the body raises, or KILLED when the process is stopped
    by a signal (SIGTERM, raised as `Terminated` or Prefect's `TerminationSignal`; Ctrl-C)."""
    from mlflow.entities import Param, RunStatus

    from tasks import exit_on_sigterm, stopped_by_signal

    exit_on_sigterm()
    client = configure(params, root)
    experiment = f"trace-{stage}"
    experiment_id = ensure_experiment(client, experiment, params, root)
    close_orphaned_runs(client, experiment_id)
    owner = {HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid())}
    all_tags = {"trace.stage": stage, **owner, **git_tags(root), **{k: str(v) for k, v in (tags or {}).items()}}
    run = client.create_run(experiment_id, run_name=run_name, tags=all_tags)
    run_id = run.info.run_id
    try:
        logged = stage_params(params, sections if sections is not None else STAGE_SECTIONS.get(stage, ()))
        items = sorted(logged.items())
        for i in range(0, len(items), 100):  # MLflow accepts at most 100 params per batch
            client.log_batch(run_id, params=[Param(k, v) for k, v in items[i : i + 100]])
        yield StageRun(client, run_id, experiment_id)
    except BaseException as exc:
        status = RunStatus.KILLED if stopped_by_signal(exc) else RunStatus.FAILED
        client.set_terminated(run_id, RunStatus.to_string(status))
        raise
    client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))


HOST_TAG, PID_TAG = "trace.host", "trace.pid"  # which process owns a RUNNING run


def close_orphaned_runs(client: MlflowClient, experiment_id: str) -> list[str]:
    """End as KILLED the RUNNING runs of this experiment whose owning process (same host, `trace.pid`) is gone.

    A SIGKILL (or a power cut) gives `stage_run` no chance to end its run, so the next start of the stage does it;
    runs of other hosts, and runs without an owner tag, are left alone. Returns the run ids it ended."""
    from mlflow.entities import RunStatus

    host, ended = socket.gethostname(), []
    for run in client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=1000):
        tags = run.data.tags
        if tags.get(HOST_TAG) != host or not tags.get(PID_TAG, "").isdigit() or _alive(int(tags[PID_TAG])):
            continue
        client.set_tag(run.info.run_id, "trace.ended_by", "the next start of the stage (its process was gone)")
        client.set_terminated(run.info.run_id, RunStatus.to_string(RunStatus.KILLED))
        ended.append(run.info.run_id)
    return ended


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


# --------------------------------------------------------------------------------------------- model registry
CANDIDATE = "candidate"  # alias of the newest adapter of a capability
CHAMPION = "champion"  # alias of the adapter that stage evaluation last found to improve its own capability
ADAPTER_SHA_TAG = "trace.adapter_sha256"


def model_name(capability_id: str) -> str:
    return f"trace-{capability_id}"


def find_version(client: MlflowClient, name: str, adapter_sha256: str):
    """The version of registered model `name` holding the adapter with this sha256, or None."""
    for version in client.search_model_versions(f"name='{name}'"):
        if version.tags.get(ADAPTER_SHA_TAG) == adapter_sha256:
            return version
    return None


def _adapter_requirements() -> list[str]:
    """What loading the model needs, pinned to the installed versions. MLflow's default list for a torch model adds
    torchvision, which TRACE does not install, and then fails to find its version."""
    from importlib.metadata import version

    # A local build label ("2.13.0+cpu") is not installable from PyPI; keep the release.
    return [f"{pkg}=={version(pkg).split('+')[0]}" for pkg in ("torch", "transformers", "peft", "accelerate")]


def _log_adapter(run: StageRun, adapter_dir: Path, base_model_path: Path) -> str:
    """Log base + adapter as an MLflow transformers model of `run` that stores only the adapter; return its URI."""
    import mlflow.transformers
    from peft import PeftModel

    from trace_core.agents.model import load_model, load_tokenizer

    # The base weights are loaded only to build the pipeline MLflow saves; `base_model_path` makes it store the
    # adapter and a reference to the base instead of a copy.
    tokenizer = load_tokenizer(base_model_path)
    model = PeftModel.from_pretrained(load_model(base_model_path, dtype="float32", threads=0), str(adapter_dir))
    # The fluent API attaches the logged model to the active run's experiment: make `run` the active one.
    with mlflow.start_run(run_id=run.run_id):
        info = mlflow.transformers.log_model(
            {"model": model, "tokenizer": tokenizer},
            name="adapter",
            task="text-generation",
            base_model_path=str(base_model_path),
            pip_requirements=_adapter_requirements(),
        )
    return info.model_uri


def register_adapter(
    target,
    capability_id: str,
    adapter_dir: str | Path,
    base_model_path: str | Path,
    tags: Mapping[str, Any],
    *,
    root: str | Path = ROOT,
    alias: str = CANDIDATE,
):
    """Register the PEFT adapter in `adapter_dir` as a version of model `trace-<capability_id>` and point `alias` at
    it; return the ModelVersion.

    `target` is the open `StageRun` the model is logged under, or params (a run of experiment trace-training is
    opened for it). Only the adapter is stored; the version references the base weights at `base_model_path`,
    which must stay there for `models:/trace-<capability_id>@candidate` to load. The version is tagged with `tags`,
    the adapter's sha256 and the git commit. An adapter already registered (same sha256) is not registered again:
    its existing version gets the alias and is returned."""
    if not isinstance(target, StageRun):
        with stage_run("training", target, root=root, run_name=f"register-{capability_id}") as run:
            return register_adapter(run, capability_id, adapter_dir, base_model_path, tags, root=root, alias=alias)
    from trace_core.training.trainer import ADAPTER_FILE, sha256_file

    run, client, name = target, target.client, model_name(capability_id)
    adapter_dir, base_model_path = Path(adapter_dir), Path(base_model_path)
    weights = adapter_dir / ADAPTER_FILE
    if not weights.exists():
        raise FileNotFoundError(f"{weights} not found: train the adapter first (`trace training --capability "
                                f"{capability_id}`)")
    if not (base_model_path / "config.json").exists():
        raise FileNotFoundError(f"{base_model_path} is not a model folder (no config.json); the registry references "
                                "the base weights by a local folder, e.g. artifacts/bootstrap/model")
    sha = sha256_file(weights)
    # Check-and-create under the store's inter-process lock: two processes registering the same adapter at once
    # would otherwise both find no version and both create one.
    with store_lock(client.tracking_uri, root):
        version = find_version(client, name, sha)
        if version is None:
            commit = git_tags(root).get("mlflow.source.git.commit")
            all_tags = {"trace.capability_id": capability_id, **tags, ADAPTER_SHA_TAG: sha}
            if commit:
                all_tags["git.commit"] = commit
            uri = _log_adapter(run, adapter_dir, base_model_path)
            # Registered with its tags in one call, so a version without its sha256 tag (never deduplicated) cannot
            # exist.
            version = mlflow.register_model(uri, name, tags={k: str(v) for k, v in all_tags.items()})
        client.set_registered_model_alias(name, alias, version.version)
    return client.get_model_version(name, version.version)


def promote_champion(target, capability_id: str, adapter_sha256: str | None = None, *, root: str | Path = ROOT,
                     alias: str = CHAMPION):
    """Point `alias` (default `champion`) of model `trace-<capability_id>` at the version holding the adapter with
    this sha256 (the one that was evaluated) or, without a sha256, at the `candidate` version, else the newest one;
    return that ModelVersion. The alias leaves whichever version held it before.

    `target` is an open `StageRun`, an `MlflowClient` or params (then the project's store under `root`). Raises
    LookupError, saying how to register the adapter, when there is no such version."""
    client = target.client if isinstance(target, StageRun) else target
    if not isinstance(client, MlflowClient):
        client = configure(target, root)
    name = model_name(capability_id)
    register_hint = (f"register it by running the training stage through the flow (`python -m flows.pipeline --stage "
                     f"training --capability {capability_id}` or `dvc repro training@{capability_id}`); `trace "
                     "training` alone does not register adapters")
    if adapter_sha256:
        version = find_version(client, name, adapter_sha256)
        if version is None:
            raise LookupError(f"no version of model {name} holds the evaluated adapter (sha256 "
                              f"{adapter_sha256[:12]}...): {register_hint}")
    else:
        versions = client.search_model_versions(f"name='{name}'")
        if not versions:
            raise LookupError(f"model {name} has no registered version: {register_hint}")
        try:
            version = client.get_model_version_by_alias(name, CANDIDATE)
        except MlflowException:  # no candidate alias: the newest version
            version = max(versions, key=lambda v: int(v.version))
    client.set_registered_model_alias(name, alias, version.version)
    return client.get_model_version(name, version.version)
