"""What every stage's resumable output folder shares: run keys, claiming a folder for one key, and JSON files that
are read forgivingly and written atomically.

A stage hashes everything its output depends on into a run key (`run_key`), `claim`s its folder for that key (a
folder holding another key's outputs is emptied, one holding this key's is kept for resuming) and writes its
record last with `write_json_atomic`, so a kill leaves the old or the new file, never a torn one.

State that only a killed run needs (training checkpoints, calibration trajectories in progress) lives in
`resume_dir(output folder)`, outside every DVC output: `dvc exp run` restores each cached output to its dvc.lock
version before it runs (a forced checkout, dvc/repo/experiments/executor/base.py), which replaced a killed
experiment's checkpoints with the previous run's files. Resumable outputs that are not needed in the DVC cache
(episodes played so far, probability caches) are `cache: false` in dvc.yaml instead, which that checkout skips.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

RUN_KEY = "run_key.txt"  # the stamp `claim` leaves in a folder
RESUME = "resume"  # the folder beside the stages' output folders that holds what a killed run resumes from


def run_key(data: Any) -> str:
    """A 16-hex-digit hash of `data` (JSON with sorted keys; values JSON cannot hold are written with str())."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_json(path: str | os.PathLike) -> Any:
    """The JSON in `path`, or None when the file is missing or not valid JSON (e.g. left by an older version)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_typed(path: Path, model: Any, what: str, fix: str, error: type[Exception]) -> Any:
    """The typed record at `path` (`model`: a pydantic model class), or `error` saying it is missing or not `what`,
    followed by `fix` (how to make it: the stage to run)."""
    if not path.exists():
        raise error(f"{path} is missing: {fix}")
    try:
        return model.model_validate_json(path.read_text())
    except ValueError as exc:
        raise error(f"{path} is not {what} ({exc.__class__.__name__}): {fix}") from None


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` so that a kill leaves the old or the new file, never a torn one (parents made). Returns the
    path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """Write `data` as JSON (indented, sorted keys), atomically."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_csv_atomic(path: str | os.PathLike, columns: Sequence[str], rows: Iterable[dict[str, Any]]) -> Path:
    """Write `rows` (dicts keyed by `columns`) as CSV with a header, atomically; floats with 4 decimals, None as an
    empty cell. Returns the path."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row[k] is None else f"{row[k]:.4f}" if isinstance(row[k], float) else row[k]
                         for k in columns})
    return write_text_atomic(path, buffer.getvalue())


def empty(folder: str | os.PathLike) -> None:
    """Remove everything inside `folder` (the folder itself stays; a missing folder is left missing)."""
    folder = Path(folder)
    for child in folder.iterdir() if folder.is_dir() else ():
        shutil.rmtree(child) if child.is_dir() else child.unlink()


def claim(folder: str | os.PathLike, key: str) -> None:
    """Make `folder` hold only outputs of `key`: anything from other settings (or with no key) is removed, the
    outputs of a run with this key (a killed one's included) are kept for resuming."""
    folder = Path(folder)
    stamp = folder / RUN_KEY
    if not stamp.exists() or stamp.read_text().strip() != key:
        empty(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stamp.write_text(key + "\n")


def resume_dir(out: str | os.PathLike) -> Path:
    """Where the stage writing output folder `out` keeps what a killed run resumes from: `<stage folder's
    parent>/resume/<stage folder>/<name>`, e.g. artifacts/training/x -> artifacts/resume/training/x. DVC neither
    caches, restores nor deletes it (see the module's docstring); claim it with the output's run key."""
    out = Path(out)
    return out.parent.parent / RESUME / out.parent.name / out.name
