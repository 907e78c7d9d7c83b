"""Best-step selection (trace_core/training/selection.py): the validation seeds are held back from training, the
adapter saved is the best validated step's (step 0, the base agent, included), and a resumed run keeps what was
validated before the kill."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from trace_core.training import RolloutLedger, train_adapter
from trace_core.training.selection import BEST, SELECTION, better, split_seeds
from tests.defaults import default_limits, default_user
from tests.training.test_trainer import KillAfterFirstCheckpoint, Killed

CAPABILITY = "tool_call_precision"


class Scripted:
    """Stands in for `evaluation.play` during validation: call i solves `solved[i]` of the seeds (reward = success),
    and records the seeds it was asked to play."""

    def __init__(self, solved: list[int]):
        self.solved, self.calls = solved, []

    def __call__(self, env, policy, seeds, **kw):
        k = self.solved[len(self.calls)]
        self.calls.append(list(seeds))
        return [SimpleNamespace(success=i < k, reward=float(i < k)) for i in range(len(seeds))]


def _train(env, model, tokenizer, settings, out, **kw):
    return train_adapter(env, model, tokenizer, settings, out, CAPABILITY, train_seeds=range(10),
                         limits=default_limits(max_steps=1), make_user=default_user, max_context=4096, **kw)


def _adapter(path):
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors"))


def test_the_validation_seeds_are_the_last_training_seeds_and_only_with_selection(settings_factory):
    assert split_seeds(range(10), settings_factory(select_every=2, select_episodes=3)) == (list(range(7)), [7, 8, 9])
    assert split_seeds(range(10), settings_factory()) == (list(range(10)), [])
    with pytest.raises(ValueError, match="select_episodes=10 leaves none"):
        split_seeds(range(10), settings_factory(select_every=1, select_episodes=10))
    with pytest.raises(ValueError, match="select_every=1 needs validation seeds"):
        settings_factory(select_every=1, select_episodes=0)


def test_a_tie_keeps_the_earlier_step():
    a = {"success_rate": 0.5, "mean_reward": 0.6}
    assert better(a, None)
    assert not better(dict(a), a)
    assert better({"success_rate": 0.5, "mean_reward": 0.7}, a)
    assert not better({"success_rate": 0.4, "mean_reward": 0.9}, a)


def test_the_adapter_saved_is_the_best_validated_step(
    parity_env, policy_model, tokenizer, settings_factory, tmp_path, monkeypatch
):
    play = Scripted([1, 2, 0])  # step 0 (base) 1/2, step 1 2/2, step 2 0/2
    monkeypatch.setattr("trace_core.training.evaluation.play", play)
    settings = settings_factory(max_steps=2, select_every=1, select_episodes=2, max_resample_rounds=1)
    record = _train(parity_env, policy_model, tokenizer, settings, tmp_path)

    assert play.calls == [[8, 9]] * 3  # before the first step and after each step, on the held-back seeds
    selection = record["selection"]
    assert selection["best_step"] == 1 and [row["step"] for row in selection["steps"]] == [0, 1, 2]
    assert selection["steps"][1] == {"step": 1, "successes": 2, "episodes": 2, "success_rate": 1.0, "mean_reward": 1.0}
    assert json.loads((tmp_path / "adapter_record.json").read_text()) == record
    assert record["steps"] == 2 and record["selection"]["episodes"] == 6
    # The validation episodes are counted under their own stage, not in the training budget.
    ledger = RolloutLedger(tmp_path / "ledger.json")
    assert ledger.rollouts("validation", CAPABILITY) == 6
    assert ledger.rollouts("training", CAPABILITY) == record["rollouts"]

    saved = _adapter(tmp_path / "adapter")
    step_1, step_2 = _adapter(tmp_path / "checkpoints" / "checkpoint-1"), _adapter(tmp_path / "checkpoints" / "checkpoint-2")
    assert all(torch.equal(saved[n], step_1[n]) for n in saved)
    assert any(not torch.equal(saved[n], step_2[n]) for n in saved)


def test_a_run_that_never_beats_the_base_keeps_the_fresh_adapter(
    parity_env, policy_model, tokenizer, settings_factory, tmp_path, monkeypatch
):
    monkeypatch.setattr("trace_core.training.evaluation.play", Scripted([2, 1, 2]))
    settings = settings_factory(max_steps=2, select_every=1, select_episodes=2, max_resample_rounds=1)
    record = _train(parity_env, policy_model, tokenizer, settings, tmp_path)

    assert record["selection"]["best_step"] == 0  # step 2 only ties step 0: the earlier wins
    lora_b = [t for name, t in _adapter(tmp_path / "adapter").items() if "lora_B" in name]
    assert lora_b and all(not t.any() for t in lora_b)  # LoRA B as initialised: the adapter changes nothing


def test_a_resumed_run_keeps_what_it_validated_before_the_kill(
    parity_env, policy_model, tiny_model, tokenizer, settings_factory, tmp_path, monkeypatch
):
    import copy

    play = Scripted([0, 2, 1, 1])
    monkeypatch.setattr("trace_core.training.evaluation.play", play)
    settings = settings_factory(max_steps=3, select_every=1, select_episodes=2, max_resample_rounds=1)
    with pytest.raises(Killed):
        _train(parity_env, policy_model, tokenizer, settings, tmp_path, callbacks=[KillAfterFirstCheckpoint()])
    state = json.loads((tmp_path / SELECTION).read_text())
    assert state["best_step"] == 1 and sorted(state["steps"]) == ["0", "1"] and (tmp_path / BEST).exists()
    step_1 = _adapter(tmp_path / "checkpoints" / "checkpoint-1")

    fresh = copy.deepcopy(tiny_model)
    fresh.config.max_position_embeddings = 4096
    record = _train(parity_env, fresh, tokenizer, settings, tmp_path)

    assert len(play.calls) == 4  # step 0 was not validated again; steps 2 and 3 were
    assert record["selection"]["best_step"] == 1
    assert [row["step"] for row in record["selection"]["steps"]] == [0, 1, 2, 3]
    saved = _adapter(tmp_path / "adapter")
    assert all(torch.equal(saved[n], step_1[n]) for n in saved)


def test_validation_plays_the_model_being_trained(parity_env, policy_model, tokenizer, settings_factory, tmp_path):
    settings = settings_factory(max_steps=1, select_every=1, select_episodes=2, max_resample_rounds=1)
    record = _train(parity_env, policy_model, tokenizer, settings, tmp_path)
    steps = record["selection"]["steps"]
    assert [row["step"] for row in steps] == [0, 1] and all(row["episodes"] == 2 for row in steps)
    assert record["selection"]["best_step"] in (0, 1) and policy_model.training  # left in training mode


def test_the_kept_weights_load_into_a_fresh_adapter(
    parity_env, policy_model, tiny_model, tokenizer, settings_factory, tmp_path, monkeypatch
):
    """best.safetensors (what `trace eval-kept` plays) loads into a fresh PEFT model as the adapter the run saved."""
    import copy

    from peft import get_peft_model, get_peft_model_state_dict

    from trace_core.training.selection import load_lora_state
    from trace_core.training.trainer import lora_config

    monkeypatch.setattr("trace_core.training.evaluation.play", Scripted([0, 2, 1]))
    settings = settings_factory(max_steps=2, select_every=1, select_episodes=2, max_resample_rounds=1)
    _train(parity_env, policy_model, tokenizer, settings, tmp_path)
    fresh = get_peft_model(copy.deepcopy(tiny_model), lora_config(settings))
    load_lora_state(fresh, tmp_path / BEST)
    saved, loaded = _adapter(tmp_path / "adapter"), get_peft_model_state_dict(fresh)
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[n], loaded[n].float()) for n in saved)
    assert any(t.any() for n, t in saved.items() if "lora_B" in n)  # step 1's weights, not the fresh adapter's

    for other_setup in (settings_factory(lora_r=2), settings_factory(target_modules=["q_proj"])):
        other = get_peft_model(copy.deepcopy(tiny_model), lora_config(other_setup))
        with pytest.raises(ValueError, match="another LoRA setup"):
            load_lora_state(other, tmp_path / BEST)
