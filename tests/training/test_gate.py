"""The training stage's gate (an adapter is `learned` only when the paired 95% CI of its held-out success difference
lies above 0), own_env.csv from the stage's eval.json files, and the learning curve's bookkeeping (points, paired
CIs, the output folder), on fabricated evaluations: no model."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tests.defaults import PARAMS
from trace_core.runs import write_json_atomic
from trace_core.schemas import AdapterEval, AdapterRecord
from trace_core.training.curve import (
    CurveError,
    check_points,
    claim_output,
    csv_row,
    curve_settings,
    format_table,
    parse_points,
    point_report,
)
from trace_core.training.evaluation import compare
from trace_core.training.own_env import COLUMNS, own_env_rows, write_own_env
from trace_core.training.stage import EVAL, RECORD, gate


class Episode:
    def __init__(self, success: bool, reward: float | None = None):
        self.success, self.reward = success, float(success) if reward is None else reward


def _report(base: list[bool], adapter: list[bool]) -> dict:
    return compare(list(range(len(base))), [Episode(s) for s in base], [Episode(s) for s in adapter],
                   samples=PARAMS.evaluation.bootstrap_samples, level=PARAMS.evaluation.ci, seed=0)


def test_learned_only_when_the_ci_lower_bound_is_above_zero():
    # 16 of 64 seeds improved, none regressed: the paired CI lies above 0.
    better = _report([False] * 64, [True] * 16 + [False] * 48)
    learned, why = gate(better)
    assert better["difference"]["ci"][0] > 0 and learned
    assert why.startswith("learned:") and "+0.250" in why and "64 seeds" in why
    # As many regressed as improved: the CI straddles 0.
    mixed = _report([True] * 8 + [False] * 56, [False] * 8 + [True] * 8 + [False] * 48)
    assert mixed["difference"]["ci"][0] < 0 < mixed["difference"]["ci"][1]
    learned, why = gate(mixed)
    assert not learned and why.startswith("not learned")
    # No change at all: CI [0, 0], whose lower bound is not above 0.
    same = _report([True] * 4 + [False] * 60, [True] * 4 + [False] * 60)
    assert same["difference"]["ci"] == [0.0, 0.0] and not gate(same)[0]
    # The typed records carry the verdict.
    assert AdapterEval.model_validate({**better, "learned": True}).learned is True
    assert AdapterRecord(capability_id="x", status="trained", learned=False, gate=why).learned is False


def _stage_folder(out: Path, cid: str, rollouts: int, base: list[bool], adapter: list[bool]) -> dict:
    (out / cid).mkdir(parents=True)
    report = _report(base, adapter)
    write_json_atomic(out / cid / EVAL, AdapterEval.model_validate({**report, "capability_id": cid}).model_dump())
    record = AdapterRecord(capability_id=cid, status="trained", rollouts=rollouts, steps=2, adapter_sha256="ab")
    write_json_atomic(out / cid / RECORD, record.model_dump())
    return report


def test_own_env_csv_has_one_row_per_evaluated_adapter(tmp_path):
    out = tmp_path / "training"
    ident = _stage_folder(out, "identification", 304, [True] * 35 + [False] * 29,
                          [True] * 41 + [False] * 23)
    _stage_folder(out, "tool_call_precision", 256, [True] * 28 + [False] * 36, [True] * 30 + [False] * 34)
    (out / "friendly_tone").mkdir()
    write_json_atomic(out / "friendly_tone" / RECORD,
                      AdapterRecord(capability_id="friendly_tone", status="skipped", reason="unmapped").model_dump())
    (out / "no_eval").mkdir()  # trained, not evaluated yet
    write_json_atomic(out / "no_eval" / RECORD,
                      AdapterRecord(capability_id="no_eval", status="trained", rollouts=8).model_dump())

    rows = own_env_rows(out, ["identification", "friendly_tone", "no_eval", "tool_call_precision", "missing"])
    assert [r["capability"] for r in rows] == ["identification", "tool_call_precision"]
    path = write_own_env(tmp_path / "docs" / "own_env.csv", rows)
    with path.open() as f:
        read = list(csv.DictReader(f))
    assert tuple(read[0]) == COLUMNS == ("capability", "seeds", "rollouts", "base_success", "adapter_success",
                                         "diff", "ci_low", "ci_high")
    first = read[0]
    assert first["capability"] == "identification" and first["seeds"] == "64" and first["rollouts"] == "304"
    assert float(first["base_success"]) == pytest.approx(35 / 64, abs=1e-4)
    assert float(first["adapter_success"]) == pytest.approx(41 / 64, abs=1e-4)
    assert float(first["diff"]) == pytest.approx(6 / 64, abs=1e-4)
    assert float(first["ci_low"]) == pytest.approx(ident["difference"]["ci"][0], abs=1e-4)
    assert float(first["ci_high"]) == pytest.approx(ident["difference"]["ci"][1], abs=1e-4)
    for row in read:
        assert all(0 <= float(row[k]) <= 1 for k in ("base_success", "adapter_success"))
        assert -1 <= float(row["ci_low"]) <= float(row["diff"]) <= float(row["ci_high"]) <= 1
    assert write_own_env(tmp_path / "empty.csv", []).read_text() == ",".join(COLUMNS) + "\n"

    # `trace own-env` writes the same file from params (training.out_dir, the stage's capabilities).
    from trace_core.cli import main

    root = Path(__file__).resolve().parents[2]
    cli_csv = tmp_path / "results" / "own_env.csv"
    assert main(["own-env", "--params", str(root / "params.yaml"), "-S", f"training.out_dir={out}",
                 "-S", f"synthesis.out_dir={tmp_path / 'synthesis'}",
                 "-S", "synthesis.capabilities=[identification, friendly_tone, tool_call_precision]",
                 "--out", str(cli_csv)]) == 0
    assert cli_csv.read_text() == path.read_text()


def test_curve_points_and_paired_report(settings_factory):
    assert parse_points("128, 0,64,64") == [0, 64, 128]
    for bad in ("", "a,b", "-8,16"):
        with pytest.raises(CurveError, match="--points"):
            parse_points(bad)
    settings = settings_factory(num_generations=4, groups_per_step=2, micro_batch_size=2)  # 8 rollouts a step
    check_points([0, 8, 64], settings)
    with pytest.raises(CurveError, match=r"\[4\] are below one GRPO step of 8"):
        check_points([0, 4, 64], settings)
    assert curve_settings(settings, [0, 32, 100]).max_steps == 12  # enough steps for the largest budget

    base = [{"success": s, "reward": r} for s, r in [(False, 0.2), (True, 1.0), (False, 0.0), (False, 0.5)]]
    adapter = [{"success": s, "reward": r} for s, r in [(True, 1.0), (True, 1.0), (False, 0.4), (False, 0.5)]]
    report = point_report(64, [10, 11, 12, 13], base, adapter, samples=PARAMS.evaluation.bootstrap_samples,
                          level=PARAMS.evaluation.ci, seed=0, rollouts=56, steps=7)
    assert report["base"]["success_rate"] == 0.25 and report["adapter"]["success_rate"] == 0.5
    assert report["difference"]["success_rate"] == 0.25 and report["difference"]["improved"] == 1
    assert report["reward_difference"]["mean"] == pytest.approx((0.8 + 0 + 0.4 + 0) / 4)
    low, high = report["reward_difference"]["ci"]
    assert 0 <= low <= report["reward_difference"]["mean"] <= high <= 0.8
    assert report["base"]["mean_reward"] == pytest.approx(1.7 / 4)
    row = csv_row(report)
    assert (row["rollouts_target"], row["rollouts"], row["steps"], row["seeds"]) == (64, 56, 7, 4)
    assert "+0.250" in format_table([row])


def test_curve_output_folder_is_claimed_safely(tmp_path):
    out = tmp_path / "curve"
    claim_output(out, "k1", restart=False)
    (out / "points").mkdir()
    (out / "points" / "8.json").write_text("{}")
    claim_output(out, "k1", restart=False)  # the same curve: resumed, kept
    assert (out / "points" / "8.json").exists()
    with pytest.raises(CurveError, match="--restart"):
        claim_output(out, "k2", restart=False)
    assert (out / "points" / "8.json").exists()
    claim_output(out, "k2", restart=True)
    assert not (out / "points").exists()
    other = tmp_path / "docs"
    other.mkdir()
    (other / "README.md").write_text("not a curve")
    with pytest.raises(CurveError, match="not a learning curve"):
        claim_output(other, "k1", restart=True)
    assert (other / "README.md").exists()


def test_held_out_play_is_saved_per_chunk_and_resumed(tmp_path, monkeypatch):
    from trace_core.config import load_params
    from trace_core.training import curve, stage

    root = Path(__file__).resolve().parents[2]
    params = load_params(root / "params.yaml", {"policy.batch_size": 2})
    calls: list[list[int]] = []

    def play(params, env, model, tokenizer, seeds, name, progress=False):
        calls.append(list(seeds))
        if len(calls) == 2 and fail:
            raise RuntimeError("killed")
        return [Episode(s % 2 == 0, s / 10) for s in seeds]

    monkeypatch.setattr(stage, "play_greedy", play)
    path, seeds = tmp_path / "base.partial.json", [10, 11, 12, 13, 14]
    fail = True
    with pytest.raises(RuntimeError, match="killed"):
        curve.play_cached(path, "k", params, None, None, None, seeds, "base", False)
    calls.clear()
    fail = False
    outcomes = curve.play_cached(path, "k", params, None, None, None, seeds, "base", False)
    assert calls == [[12, 13], [14]]  # the first chunk was kept
    assert outcomes == [{"success": s % 2 == 0, "reward": s / 10} for s in seeds]
    calls.clear()
    curve.play_cached(path, "other adapter", params, None, None, None, seeds[:1], "base", False)
    assert calls == [[10]]  # another key plays again


def test_own_env_merge_keeps_other_sittings_rows_and_replaces_its_own(tmp_path):
    """A profile run whose capabilities trained in separate sittings: `--merge` keeps the file's rows for capabilities
    not evaluated here, replaces the one that is, and orders rows as the capabilities."""
    from trace_core.cli import main
    from trace_core.training.own_env import merge_rows

    out = tmp_path / "training"
    _stage_folder(out, "tool_call_precision", 256, [True] * 28 + [False] * 36, [True] * 30 + [False] * 34)
    csv_path = tmp_path / "own_env.csv"
    earlier = [
        {"capability": "precondition_verification", "seeds": 64, "rollouts": 512, "base_success": 0.1875,
         "adapter_success": 0.3281, "diff": 0.1406, "ci_low": 0.0625, "ci_high": 0.2344},
        {"capability": "tool_call_precision", "seeds": 64, "rollouts": 1, "base_success": 0.5,
         "adapter_success": 0.0, "diff": -0.5, "ci_low": -0.6, "ci_high": -0.4},
    ]
    write_own_env(csv_path, earlier)

    root = Path(__file__).resolve().parents[2]
    args = ["own-env", "--params", str(root / "params.yaml"), "-S", f"training.out_dir={out}",
            "-S", f"synthesis.out_dir={tmp_path / 'synthesis'}",
            "-S", "synthesis.capabilities=[tool_call_precision, precondition_verification]", "--out", str(csv_path)]
    assert main([*args, "--merge"]) == 0
    with csv_path.open() as f:
        read = list(csv.DictReader(f))
    assert [r["capability"] for r in read] == ["tool_call_precision", "precondition_verification"]
    assert read[0]["rollouts"] == "256" and float(read[0]["diff"]) == pytest.approx(2 / 64, abs=1e-4)
    assert read[1]["rollouts"] == "512" and read[1]["ci_low"] == "0.0625"  # the other sitting's row, as it was

    # Without --merge the file holds this folder's adapters only.
    assert main(args) == 0
    assert [r["capability"] for r in csv.DictReader(csv_path.open())] == ["tool_call_precision"]

    # A file that is not an own_env.csv is refused, not overwritten.
    other = tmp_path / "other.csv"
    other.write_text("method,success\nbase,0.2\n")
    with pytest.raises(ValueError, match="not an own_env.csv"):
        merge_rows(other, [], ["tool_call_precision"])
    assert main([*args[:-1], str(other), "--merge"]) == 1
    assert other.read_text() == "method,success\nbase,0.2\n"
