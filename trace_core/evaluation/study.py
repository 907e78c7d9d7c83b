"""`study.csv`: the evaluation's per-method comparison with the base agent, one row per method, from stage
evaluation's results.json (issue #31's committed table, docs/results/study.csv).

Columns: method, instances (held-out instances each method played), rollouts (its training rollout budget; 0 for
methods that train nothing), success (pass^1), diff_vs_base (paired, method minus base), the paired 95% CI of that
difference (ci_low, ci_high) and the exact two-sided sign test's p-value (sign_test_p). Rates are fractions in
[0, 1]; the base row leaves the comparison columns empty.

    trace study-csv --out docs/results/study.csv
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trace_core.runs import write_csv_atomic

STUDY = "study.csv"
COLUMNS = ("method", "instances", "rollouts", "success", "diff_vs_base", "ci_low", "ci_high", "sign_test_p")


def study_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per method of an `EvaluationResults` dict, in its `methods` order."""
    summary = results["summary"]["methods"]
    rows = []
    for method in results["methods"]:
        entry = summary[method]
        vs = entry.get("vs_reference")
        rows.append({
            "method": method,
            "instances": entry["pass_hat_k"]["1"]["instances"],
            "rollouts": results.get("budgets", {}).get(method) or 0,
            "success": entry["pass_hat_k"]["1"]["value"],
            "diff_vs_base": vs["difference"] if vs else None,
            "ci_low": vs["ci"][0] if vs else None,
            "ci_high": vs["ci"][1] if vs else None,
            "sign_test_p": vs["sign_test_p"] if vs else None,
        })
    return rows


def write_study(path: str | os.PathLike, rows: list[dict[str, Any]]) -> Path:
    """Write `rows` to `path` as CSV, atomically."""
    return write_csv_atomic(path, COLUMNS, rows)
