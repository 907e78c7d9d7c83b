"""Stage baseline with the real embedded model (SmolLM2-135M, bf16) at a tiny size: a killed and resumed greedy run
writes the same trajectory file, byte for byte, as an uninterrupted one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from trace_core.config import load_params

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "bootstrap.enabled": False,
    "tasks.families": ["single_write", "identify_then_act", "compound"],
    "baseline.instances_per_family": 2,
    "policy.batch_size": 3,
    "policy.max_new_tokens": 32,
    "env.max_steps": 3,
    "model.cache_dir": str(ROOT / ".cache" / "models"),  # the converted model is shared between runs
}


@pytest.mark.model
@pytest.mark.slow
def test_killed_and_resumed_greedy_baseline_is_byte_identical(tmp_path, monkeypatch):
    """Measured before the fix (episodes refilled into a running batch, caches and seeds carried over): a kill after
    1 of 6 episodes and a resume changed 5 of the 6 trajectories."""
    from trace_core import baseline
    from trace_core.agents import local
    from trace_core.agents.model import ModelProvisionError, smollm2_gguf_path
    from trace_core.agents.rollout import read_trajectories

    try:
        smollm2_gguf_path()
    except ModelProvisionError as exc:
        pytest.skip(str(exc))
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    params = load_params(tmp_path / "params.yaml", TINY)
    clean = tmp_path / "clean"
    baseline.run(params, clean, progress=False)
    expected = (clean / "trajectories.jsonl").read_bytes()
    assert len(expected.splitlines()) == 6

    generate = local.LocalPolicy.generate
    for kill_after in (1, 3):  # mid-way through the first batch of 3; at the start of the second
        out = tmp_path / f"killed-{kill_after}"

        def killed(self, requests, sampling, out=out, kill_after=kill_after):
            if len(read_trajectories(out / "trajectories.jsonl")) >= kill_after:
                raise KeyboardInterrupt("simulated kill")
            return generate(self, requests, sampling)

        monkeypatch.setattr(local.LocalPolicy, "generate", killed)
        with pytest.raises(KeyboardInterrupt):
            baseline.run(params, out, progress=False)
        monkeypatch.setattr(local.LocalPolicy, "generate", generate)
        assert 0 < len(read_trajectories(out / "trajectories.jsonl")) < 6
        metrics = baseline.run(params, out, progress=False)  # a fresh policy, as in a new process
        assert metrics["rollout"]["episodes_resumed"] >= kill_after
        assert (out / "trajectories.jsonl").read_bytes() == expected
