"""`study.csv` (docs/results/study.csv): one row per evaluated method against the base agent, from results.json."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from trace_core.evaluation.stats import evaluate
from trace_core.evaluation.study import COLUMNS, study_rows, write_study
from trace_core.schemas import Trajectory

ROOT = Path(__file__).resolve().parents[2]


def _episodes(successes: list[bool]) -> list[Trajectory]:
    return [Trajectory(trajectory_id=f"i{i}#0", instance_id=f"i{i}", domain="retail", family=f"f{i % 2}",
                       source="procedural", trial=0, messages=[], termination_reason="agent_stop", reward=float(s),
                       success=s)
            for i, s in enumerate(successes)]


def test_one_row_per_method_with_the_paired_comparison_and_the_cli_writes_it(tmp_path):
    base = [True, False, False, True, False, False, False, False, True, False]
    trace = [True, True, False, True, True, False, True, False, True, False]  # 3 won, none lost
    worse = [False, False, False, True, False, False, False, False, True, False]  # 1 lost
    results = {"base": _episodes(base), "trace": _episodes(trace), "grpo_target": _episodes(worse)}
    summary = evaluate(results, budgets={"base": None, "trace": 96, "grpo_target": 96}, samples=500, level=0.95,
                       seed=0)
    record = {"methods": list(results), "summary": summary, "budgets": {"base": None, "trace": 96,
                                                                          "grpo_target": 96}}
    rows = study_rows(record)
    assert [r["method"] for r in rows] == ["base", "trace", "grpo_target"]
    assert rows[0] == {"method": "base", "instances": 10, "rollouts": 0, "success": 0.3, "diff_vs_base": None,
                       "ci_low": None, "ci_high": None, "sign_test_p": None}
    trace_row = rows[1]
    assert trace_row["success"] == 0.6 and trace_row["diff_vs_base"] == pytest.approx(0.3)
    assert trace_row["ci_low"] <= 0.3 <= trace_row["ci_high"] and trace_row["sign_test_p"] == 0.25  # 3-0: 2/8
    assert rows[2]["diff_vs_base"] == pytest.approx(-0.1) and rows[2]["sign_test_p"] == 1.0

    path = write_study(tmp_path / "docs" / "study.csv", rows)
    read = list(csv.DictReader(path.open()))
    assert tuple(read[0]) == COLUMNS == ("method", "instances", "rollouts", "success", "diff_vs_base", "ci_low",
                                         "ci_high", "sign_test_p")
    assert read[0]["diff_vs_base"] == "" and read[1]["success"] == "0.6000" and read[1]["rollouts"] == "96"

    from trace_core.cli import main

    out = tmp_path / "evaluation"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(record))
    cli_csv = tmp_path / "results" / "study.csv"
    args = ["study-csv", "--params", str(ROOT / "params.yaml"), "-S", f"evaluation.out_dir={out}"]
    assert main([*args, "--out", str(cli_csv)]) == 0
    assert cli_csv.read_text() == path.read_text()
    (out / "results.json").unlink()
    assert main(args) == 1  # no results yet: says which stage to run
