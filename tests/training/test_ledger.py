"""RolloutLedger: counts per stage and capability, persisted atomically after every change, reloaded on resume."""

from __future__ import annotations

import json

import pytest

from trace_core.training import RolloutLedger


def test_counts_persist_and_reload(tmp_path):
    path = tmp_path / "run" / "ledger.json"
    ledger = RolloutLedger(path)
    ledger.add("training", "multi_step_completion", rollouts=160, seeds=10)
    ledger.add("training", "multi_step_completion", rollouts=160, seeds=10)
    ledger.add("training", "identification", rollouts=32, seeds=2)
    ledger.add("calibration", "identification", rollouts=64)

    on_disk = json.loads(path.read_text())
    assert on_disk["rollouts"]["training"] == {"multi_step_completion": 320, "identification": 32}
    assert not list(path.parent.glob("*.tmp"))  # written via a temporary file, then renamed

    again = RolloutLedger(path)
    assert again.rollouts("training", "multi_step_completion") == 320
    assert again.rollouts("training") == 352
    assert again.rollouts(capability_id="identification") == 96
    assert again.rollouts() == 416
    assert again.seeds("training", "multi_step_completion") == 20
    again.add("training", "identification", rollouts=8, seeds=1)
    assert RolloutLedger(path).rollouts("training", "identification") == 40


def test_in_memory_ledger_and_bad_input(tmp_path):
    ledger = RolloutLedger()
    ledger.add("training", "x", rollouts=3)
    assert ledger.rollouts() == 3
    with pytest.raises(ValueError, match="only grow"):
        ledger.add("training", "x", rollouts=-1)

    broken = tmp_path / "ledger.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="delete it to restart"):
        RolloutLedger(broken)
