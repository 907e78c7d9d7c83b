"""`own_env.csv`: each adapter against the base agent on held-out seeds of its own environment, one row per
capability, from stage training's eval.json and adapter_record.json files.

Columns: capability, seeds (held-out episodes per side), rollouts (training rollouts of the adapter, the ledger's
count), base_success, adapter_success, diff (adapter minus base, paired) and the paired 95% CI of diff
(ci_low, ci_high); rates are fractions in [0, 1].

A run of stage training over every capability writes <training.out_dir>/own_env.csv; `trace own-env [--out FILE]`
writes it from the per-capability folders (e.g. after `dvc repro`, whose stages train one capability each);
with `--merge` it keeps the rows of an existing file for capabilities that have no evaluated adapter here, for a
profile run whose capabilities trained in separate sittings (`merge_rows`).
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trace_core.runs import write_csv_atomic

OWN_ENV = "own_env.csv"
COLUMNS = ("capability", "seeds", "rollouts", "base_success", "adapter_success", "diff", "ci_low", "ci_high")


def own_env_rows(training_dir: str | os.PathLike, capability_ids: Sequence[str]) -> list[dict[str, Any]]:
    """One row per capability (in the given order) whose folder under `training_dir` holds a trained adapter's
    record and its eval.json; the others are left out."""
    from trace_core.training.stage import EVAL, RECORD, read_eval, read_record

    rows = []
    for cid in capability_ids:
        folder = Path(training_dir) / cid
        record, report = read_record(folder / RECORD), read_eval(folder / EVAL)
        if record is None or not record.trained or report is None:
            continue
        low, high = report.difference.ci
        rows.append({
            "capability": cid,
            "seeds": report.base.episodes,
            "rollouts": record.rollouts,
            "base_success": report.base.success_rate,
            "adapter_success": report.adapter.success_rate,
            "diff": report.difference.success_rate,
            "ci_low": low,
            "ci_high": high,
        })
    return rows


def write_own_env(path: str | os.PathLike, rows: Sequence[dict[str, Any]]) -> Path:
    """Write `rows` to `path` as CSV, atomically (a kill leaves the old file or the new one)."""
    return write_csv_atomic(path, COLUMNS, rows)


def merge_rows(path: str | os.PathLike, rows: Sequence[dict[str, Any]],
               capability_ids: Sequence[str]) -> list[dict[str, Any]]:
    """`rows` plus the rows of the CSV at `path` (if it exists) for capabilities `rows` does not have: a row here
    replaces the file's row of the same capability. Ordered as `capability_ids`, other capabilities after them in
    the file's order. Raises ValueError when the file's columns are not `COLUMNS`."""
    kept: list[dict[str, Any]] = []
    path = Path(path)
    if path.exists():
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if tuple(reader.fieldnames or ()) != COLUMNS:
                raise ValueError(f"{path} has the columns {reader.fieldnames}, not {list(COLUMNS)}: not an "
                                 "own_env.csv to merge into; write to another --out or drop --merge")
            kept = [{k: (v if k == "capability" else int(v) if k in ("seeds", "rollouts") else float(v))
                     for k, v in row.items()} for row in reader]
    new = {r["capability"] for r in rows}
    merged = [r for r in kept if r["capability"] not in new] + list(rows)
    rank = {cid: i for i, cid in enumerate(capability_ids)}
    return sorted(merged, key=lambda r: rank.get(r["capability"], len(rank)))  # stable: the rest keep file order
