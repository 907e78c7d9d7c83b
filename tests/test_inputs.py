"""What routing, baselines and evaluation read alike (trace_core/inputs.py): the held-out check against the
baseline's instances and the curve's budget marks."""

from __future__ import annotations

from pathlib import Path

import pytest

from trace_core.config import load_params
from trace_core.inputs import StageInputError, TrainedAdapter, check_held_out, curve_marks, held_out_instances

ROOT = Path(__file__).resolve().parents[1]


def adapter(cid: str, rollouts: int = 10) -> TrainedAdapter:
    return TrainedAdapter(cid, Path(cid), rollouts, "sha", cid.replace("_", " "), f"does {cid}")


def _params(tmp_path: Path, **overrides):
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    return load_params(tmp_path / "params.yaml", overrides)


def test_curve_marks_are_cumulative_adapter_costs():
    adapters = [adapter("a", 10), adapter("b", 20), adapter("c", 30), adapter("d", 40)]
    assert curve_marks(adapters, 1) == [100]
    assert curve_marks(adapters, 2) == [30, 100]
    assert curve_marks(adapters, 4) == [10, 30, 60, 100]
    assert curve_marks(adapters, 9) == [10, 30, 60, 100]
    assert curve_marks([], 3) == [] and curve_marks(adapters, 0) == []



def test_held_out_instances_are_checked_against_the_baseline(tmp_path):
    params = _params(tmp_path, **{"evaluation.instances_per_family": 2, "baseline.out_dir": str(tmp_path / "bl")})
    instances = held_out_instances(params)
    assert len(instances) == 2 * len(params.tasks.families)
    (tmp_path / "bl").mkdir()
    (tmp_path / "bl" / "instances.jsonl").write_text(instances[3].model_dump_json() + "\n")
    with pytest.raises(StageInputError, match="rolled out by the baseline"):
        check_held_out(instances, params)
    other = held_out_instances(_params(tmp_path, **{"evaluation.seed": 5001, "evaluation.instances_per_family": 2}))
    check_held_out(other, params)  # another seed: no clash
