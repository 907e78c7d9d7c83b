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


def _trained(folder: Path, cid: str, rollouts: int, **gate) -> None:
    """A trained adapter's folder as stage training leaves it (`gate`: learned/gate fields, none = no verdict)."""
    from trace_core.schemas import AdapterRecord
    from trace_core.training.trainer import ADAPTER_FILE, sha256_file

    (folder / cid / "adapter").mkdir(parents=True)
    (folder / cid / "adapter" / ADAPTER_FILE).write_bytes(cid.encode())
    record = AdapterRecord(capability_id=cid, status="trained", rollouts=rollouts, steps=1,
                           adapter_sha256=sha256_file(folder / cid / "adapter" / ADAPTER_FILE), **gate)
    (folder / cid / "adapter_record.json").write_text(record.model_dump_json())


def test_only_learned_adapters_are_used_unless_kept(tmp_path, monkeypatch):
    from trace_core.inputs import (
        adapter_gate,
        dropped_adapters,
        gate_warnings,
        routable_adapters,
        routing_adapters,
        trace_budget,
        trained_adapters,
    )

    out = tmp_path / "training"
    _trained(out, "a", 10, learned=True, gate="learned: ...")
    _trained(out, "b", 20, learned=False, gate="not learned (the CI's lower bound is not above 0): CI [-0.1, +0.2]")
    _trained(out, "c", 30)  # trained, never evaluated: no verdict
    settings = {"synthesis.capabilities": ["a", "b", "c"], "training.out_dir": str(out),
                "synthesis.out_dir": str(tmp_path / "synthesis")}
    params = _params(tmp_path, **settings)
    assert [a.capability_id for a in trained_adapters(params)] == ["a"]
    dropped = dropped_adapters(params)
    assert [(d.capability_id, d.rollouts) for d in dropped] == [("b", 20), ("c", 30)]
    assert "CI [-0.1, +0.2]" in dropped[0].reason and "no held-out evaluation" in dropped[1].reason
    kept, dropped = adapter_gate(params)
    assert trace_budget(kept, dropped) == 60  # the dropped adapters' rollouts were spent too
    lines = gate_warnings(kept, dropped)
    assert len(lines) == 2 and lines[0].startswith("adapter b dropped") and "keep_unlearned" in lines[0]

    keep = _params(tmp_path, **settings, **{"training.keep_unlearned": True})
    assert [a.capability_id for a in trained_adapters(keep)] == ["a", "b", "c"] and dropped_adapters(keep) == []

    # The router's options are every trained adapter, learned or not, in order.
    assert [a.capability_id for a in routable_adapters(params)] == ["a", "b", "c"]

    none_learned = _params(tmp_path, **{**settings, "synthesis.capabilities": ["b", "c"]})
    assert [a.capability_id for a in routable_adapters(none_learned)] == ["b", "c"]
    kept, dropped = adapter_gate(none_learned)
    assert kept == [] and gate_warnings(kept, dropped)[-1].startswith("no adapter learned: TRACE is the base agent")

    # Routing and evaluation read all three at once, hashing each adapter file once.
    from trace_core.training import trainer

    calls = []
    real_hash = trainer.sha256_file
    monkeypatch.setattr(trainer, "sha256_file", lambda path: calls.append(path) or real_hash(path))
    for p in (params, keep, none_learned):
        expected = (routable_adapters(p), *adapter_gate(p))
        calls.clear()
        assert routing_adapters(p) == expected and len(calls) == len(expected[0])
