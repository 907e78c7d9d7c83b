"""The learning curve (trace_core/training/curve.py, bench/learning_curve.py) on the tiny setup of the training stage
tests: points train on from the previous point's weights, a run killed during a point's evaluation resumes with an
exact ledger and the same adapter, a later run extends the curve, and the per-step diagnostics are logged."""

from __future__ import annotations

import json

import pytest

from tests.training.test_stage import READY, TinyBase, _params, project  # noqa: F401  (the module's fixture)
from trace_core.training import curve, stage
from trace_core.training.ledger import RolloutLedger

# 2 rollouts a step (1 group of 2, no refills); checkpoints only every 5 steps, so the points' checkpoints come from
# the rollout budget's stop.
CURVE = {"training.checkpoint_every": 5}


class Killed(RuntimeError):
    pass


def test_points_train_on_resume_after_a_kill_and_extend(project, tiny_model, tokenizer, monkeypatch,  # noqa: F811
                                                        tmp_path):
    monkeypatch.chdir(project)
    params = _params(project, **CURVE)
    spec_dir = project / params.synthesis.out_dir / READY
    out = tmp_path / "curve"
    tiny = TinyBase(tiny_model, tokenizer)
    played: list[str] = []
    real_play = stage.play_greedy

    def play(params, env, model, tokenizer, seeds, name, progress=False):
        played.append(name)
        if kill_at and len(played) == kill_at:
            raise Killed(name)
        return real_play(params, env, model, tokenizer, seeds, name, progress)

    monkeypatch.setattr(stage, "play_greedy", play)
    kill_at = 3  # base, adapter at 2 rollouts, then killed while the adapter at 4 rollouts plays
    with pytest.raises(Killed, match="adapter"):
        curve.learning_curve(params, spec_dir, out, [0, 2, 4], 2, tiny.agent(), echo=lambda s: None)
    assert sorted(curve.read_points(out)) == [0, 2]
    killed = json.loads((out / "train" / "adapter_record.json").read_text())  # the adapter at 4, never evaluated
    assert killed["rollouts"] == 4 and killed["steps"] == 2
    assert (out / "train" / "checkpoints" / "checkpoint-2").is_dir()  # the budget's stop saved it
    point_2 = (out / "points" / "2.json").read_text()

    # The same command again: no training (the ledger has reached 4), the same adapter, only its episodes.
    played.clear()
    kill_at = 0
    rows = curve.learning_curve(params, spec_dir, out, [0, 2, 4], 2, tiny.agent(), echo=lambda s: None)
    assert played == [f"adapter:{READY}"]
    assert [(r["rollouts_target"], r["rollouts"], r["steps"], r["seeds"]) for r in rows] == [
        (0, 0, 0, 2), (2, 2, 1, 2), (4, 4, 2, 2)]
    assert RolloutLedger(out / "train" / "ledger.json").rollouts() == 4
    four = json.loads((out / "points" / "4.json").read_text())
    assert four["adapter_sha256"] == killed["adapter_sha256"]  # the checkpoint's weights, not a fresh adapter
    assert (out / "points" / "2.json").read_text() == point_2
    zero = json.loads((out / "points" / "0.json").read_text())
    assert zero["adapter"] == zero["base"] and zero["difference"]["ci"] == [0.0, 0.0]
    for row in rows:
        assert row["seeds"] == 2 and 0 <= row["base_success"] <= 1 and 0 <= row["adapter_success"] <= 1
        assert row["success_ci_low"] <= row["success_diff"] <= row["success_ci_high"]
        assert row["reward_ci_low"] <= row["reward_diff"] <= row["reward_ci_high"]
    assert (out / "curve.csv").read_text().splitlines()[0].startswith("rollouts_target,rollouts,steps,seeds")

    # GRPO diagnostics per step, in steps.json and in the trainer's training_metrics.json.
    steps = json.loads((out / "steps.json").read_text())["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    assert json.loads((out / "train" / "training_metrics.json").read_text())["steps"] == steps
    for s in steps:
        assert {"informative_fraction", "reward_std", "entropy", "lora_abs_change"} <= set(s)
        assert 0 <= s["informative_fraction"] <= 1 and s["entropy"] >= 0
        # The tiny model's groups are mostly constant (reward 0): no gradient, so the LoRA weights stay put.
        assert s["lora_abs_change"] > 0 if s["informative_fraction"] > 0 else s["lora_abs_change"] == 0

    # More points later: the curve continues from the adapter at 4 rollouts.
    played.clear()
    rows = curve.learning_curve(params, spec_dir, out, [0, 2, 4, 6], 2, tiny.agent(), echo=lambda s: None)
    assert played == [f"adapter:{READY}"] and [r["rollouts"] for r in rows] == [0, 2, 4, 6]
    assert RolloutLedger(out / "train" / "ledger.json").rollouts() == 6
    assert [s["step"] for s in json.loads((out / "steps.json").read_text())["steps"]] == [1, 2, 3]

    # Other settings in the same folder: refused, nothing lost.
    with pytest.raises(curve.CurveError, match="--restart"):
        curve.learning_curve(_params(project, **CURVE, **{"training.lr": 1e-3}), spec_dir, out, [0, 2], 2,
                             tiny.agent(), echo=lambda s: None)
    assert sorted(curve.read_points(out)) == [0, 2, 4, 6]


def test_a_curve_with_other_training_settings_starts_from_the_base_episodes_of_another(
        project, tiny_model, tokenizer, monkeypatch, tmp_path):  # noqa: F811
    monkeypatch.chdir(project)
    spec_dir = project / _params(project).synthesis.out_dir / READY
    tiny = TinyBase(tiny_model, tokenizer)
    played: list[str] = []
    real_play = stage.play_greedy

    def play(params, env, model, tokenizer, seeds, name, progress=False):
        played.append(name)
        return real_play(params, env, model, tokenizer, seeds, name, progress)

    monkeypatch.setattr(stage, "play_greedy", play)

    def run(out, base_from=None, **overrides):
        return curve.learning_curve(_params(project, **CURVE, **overrides), spec_dir, tmp_path / out, [0], 2,
                                    tiny.agent(), base_from=base_from, echo=lambda s: None)

    first = tmp_path / "first"
    run("first")
    assert played == [f"base:{READY}"]
    base = json.loads((first / "base.json").read_text())

    # Another learning rate: the base agent's episodes are the same, so they are copied, not played.
    played.clear()
    rows = run("lr", base_from=first, **{"training.lr": 1e-3})
    assert played == [] and json.loads((tmp_path / "lr" / "base.json").read_text()) == base
    assert rows[0]["base_success"] == rows[0]["adapter_success"]

    # Other play settings (or another base model, environment, seeds): refused, naming why and the way out.
    for name, overrides in (("tokens", {"policy.max_new_tokens": 7}), ("steps", {"env.max_steps": 3})):
        with pytest.raises(curve.CurveError, match="play settings.*drop --base-from"):
            run(name, base_from=first, **overrides)
    with pytest.raises(curve.CurveError, match="no readable base.json"):
        run("empty", base_from=tmp_path / "nowhere")
    assert played == []

    # A base.json from before keys were recorded: refused as a source until its own curve resumes, which stamps it.
    (first / "base.json").write_text(json.dumps({k: v for k, v in base.items() if k != "key"}))
    with pytest.raises(curve.CurveError, match="resume that curve"):
        run("later", base_from=first, **{"training.lr": 1e-3})
    run("first")
    assert played == [] and json.loads((first / "base.json").read_text())["key"] == base["key"]


def test_learning_curve_command_line_help():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(root / "bench" / "learning_curve.py"), "--help"], capture_output=True,
                          text=True, check=True)
    for flag in ("--capability", "--points", "--eval-seeds", "--out", "--base-model", "--synthesis-dir", "--base-from",
                 "-S"):
        assert flag in done.stdout
