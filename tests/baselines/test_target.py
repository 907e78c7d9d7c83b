"""GRPO on the target tasks: the training stream of procedural instances is a pure function of the seed and never
yields a held-out instance; the reward is τ²'s own score; the rollout budget stops GRPO (never exceeded, measured
exactly) and snapshots are saved at the rollout marks; a finished or budget-spent run is resumed without new
rollouts."""

from __future__ import annotations

import copy
import json

import pytest

from trace_core.baselines.target import TargetEnv, assert_disjoint, task_key, train_on_target
from trace_core.envs.oracle import do_nothing, replay_reference
from trace_core.envs.procedural import generate_set
from trace_core.schemas import RewardResult
from trace_core.training import GRPOSettings, RolloutLedger
from trace_core.training.trainer import EpisodeRollouts, sha256_file
from tests.defaults import PARAMS, default_limits, default_user

FAMILIES = ["single_write", "identify_then_act", "variant_choice", "compound", "policy_refusal"]
EVAL_SEED, STREAM = 5000, 7000
ENV = {"domain": PARAMS.env.domain, "profile": PARAMS.env.profile}  # the target environment of params.yaml

TINY = {
    "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "lr": 1e-2,
    "max_grad_norm": 1.0, "max_steps": 1, "num_generations": 2, "groups_per_step": 2, "micro_batch_size": 2,
    "rollout_batch_size": 8, "temperature": 1.0, "max_new_tokens": 6, "epsilon": 0.2, "beta": 0.0,
    "hint_fraction": 0.0, "max_resample_rounds": 0, "balance_refusals": False, "select_every": 0, "select_episodes": 0,
    "checkpoint_every": 1, "gradient_checkpointing": False,
    "seed": 0, "group_scoring": True,
}  # 4 rollouts per step, no refills


# -------------------------------------------------------------------------------------------- the instances
def test_seed_to_instance_is_pure_and_cycles_the_families():
    a, b = TargetEnv(FAMILIES, 1, STREAM, **ENV), TargetEnv(FAMILIES, 1, STREAM, **ENV)
    first = [a.reset(s) for s in range(12)]
    assert [i.model_dump_json() for i in first] == [b.reset(s).model_dump_json() for s in range(12)]
    assert [i.model_dump_json() for i in first] == [a.reset(s).model_dump_json() for s in range(12)]  # no state
    assert [i.family for i in first[:5]] == FAMILIES and first[5].family == FAMILIES[0]
    assert all(i.seed == STREAM and i.source == "procedural" and i.difficulty == 1 for i in first)
    assert len({i.instance_id for i in first}) == len({task_key(i) for i in first}) == 12


def test_the_stream_skips_every_held_out_task_and_the_check_catches_them():
    # At difficulty 0 some draws of the training stream repeat a held-out task (same order, same request) under
    # another id: the content check is what catches them.
    held_out = generate_set(FAMILIES, EVAL_SEED, 24, 0)
    plain = TargetEnv(FAMILIES, 0, STREAM, **ENV)
    guarded = TargetEnv(FAMILIES, 0, STREAM, held_out=held_out, **ENV)
    held_keys = {task_key(h) for h in held_out}
    clashing = [s for s in range(400) if task_key(plain.reset(s)) in held_keys]
    assert clashing, "expected the unguarded stream to repeat some held-out task in 400 seeds"

    with pytest.raises(ValueError, match="held-out evaluation instances"):
        assert_disjoint([plain.reset(s) for s in clashing], held_out)
    guarded.check_disjoint(range(400), held_out)  # no seed yields a held-out task
    assert all(guarded.reset(s).instance_id != plain.reset(s).instance_id for s in clashing)
    unaffected = next(s for s in range(400) if s not in clashing)
    assert guarded.reset(unaffected) == plain.reset(unaffected)

    # Held-out ids alone are checked too, and the held-out stream itself is refused as a training stream.
    with pytest.raises(ValueError, match="held-out"):
        assert_disjoint([held_out[0]], [held_out[0].instance_id])
    with pytest.raises(ValueError, match="stream_seed"):
        TargetEnv(FAMILIES, 0, EVAL_SEED, held_out=held_out, **ENV)


def test_reward_is_the_tau2_score():
    env = TargetEnv(["single_write"], 1, STREAM, **ENV)
    inst = env.reset(0)
    assert replay_reference(env, inst).score().reward == 1.0
    assert do_nothing(env, inst).score().reward == 0.0


# ------------------------------------------------------------------------------------------- the budget stop
def test_step_settings_cut_refills_to_what_the_budget_leaves(tmp_path):
    settings = GRPOSettings(**{**TINY, "max_resample_rounds": 4})  # 4 rollouts per step (and per refill)
    ledger = RolloutLedger(tmp_path / "ledger.json")
    rollouts = EpisodeRollouts(None, None, settings, iter(()), ledger=ledger, capability_id="t", make_user=None,
                               limits=default_limits(), max_context=512, max_rollouts=14)
    assert rollouts._step_settings().max_resample_rounds == 2  # 4 + 2 refills x 4 = 12 <= 14
    ledger.add("training", "t", rollouts=6)
    assert rollouts._step_settings().max_resample_rounds == 1 and rollouts.room_for_step()
    ledger.add("training", "t", rollouts=5)  # 3 left: not one more step
    assert not rollouts.room_for_step()
    with pytest.raises(RuntimeError, match="budget"):
        rollouts._step_settings()
    unlimited = EpisodeRollouts(None, None, settings, iter(()), ledger=ledger, capability_id="t", make_user=None,
                                limits=default_limits(), max_context=512)
    assert unlimited._step_settings() is settings and unlimited.room_for_step()


class SpreadTarget(TargetEnv):
    """The target with a reward a random tiny model varies within every group (so each step moves the adapter):
    the sum of its first turn's token ids, scaled into [0, 1]."""

    def score(self, instance, messages, termination_reason):
        first = next((m.token_ids for m in messages if m.role == "assistant" and m.token_ids), None)
        return RewardResult(reward=(sum(first) % 97) / 96 if first else 0.0)


@pytest.fixture
def policy_model(tiny_model):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: a second intra-op thread only waits (see tests/training/conftest)
    model = copy.deepcopy(tiny_model)  # PEFT wraps models in place
    model.config.max_position_embeddings = 4096  # the τ² prompts are ~2,000 tiny-tokenizer tokens
    yield model
    torch.set_num_threads(before)


def test_budget_stops_grpo_and_snapshots_land_at_the_marks(policy_model, tiny_model, tokenizer, tmp_path):
    env = SpreadTarget(FAMILIES, 1, STREAM, **ENV)
    settings = GRPOSettings(**TINY)  # 4 rollouts per step, no refills
    common = {"limits": default_limits(max_steps=1), "make_user": default_user, "max_context": 4096,
              "depends_on": {"base": "tiny"}}
    record = train_on_target(env, policy_model, tokenizer, settings, tmp_path, 10, snapshots=[3, 8, 10], **common)

    # 10 rollouts pay for two steps of 4; the third would pass the budget, so the run stopped before max_steps
    # (raised to ceil(10 / 4) = 3 so that the budget, not max_steps, ends it).
    ledger = RolloutLedger(tmp_path / "ledger.json")
    assert record["rollouts"] == ledger.rollouts("training", "grpo_target") == 8 <= record["budget_rollouts"] == 10
    assert record["steps"] == 2 and record["settings"]["max_steps"] == 3 and record["max_rollouts"] == 10
    snaps = {m: json.loads((tmp_path / "snapshots" / f"r{m:07d}" / "snapshot.json").read_text()) for m in (3, 8, 10)}
    assert (snaps[3]["rollouts"], snaps[3]["step"]) == (4, 1)  # the first step end at or past the mark
    assert (snaps[8]["rollouts"], snaps[8]["step"]) == (8, 2)
    assert snaps[10]["final"] and snaps[10]["rollouts"] == 8  # never reached: the final adapter
    assert snaps[3]["adapter_sha256"] != snaps[8]["adapter_sha256"] == record["adapter_sha256"]
    for m, snap in snaps.items():
        folder = tmp_path / "snapshots" / f"r{m:07d}"
        assert sha256_file(folder / "adapter_model.safetensors") == snap["adapter_sha256"]
        assert record["snapshots"][str(m)] == str(folder.resolve())
        assert record["snapshot_rollouts"][str(m)] == snap["rollouts"]
    assert len(json.loads((tmp_path / "training_metrics.json").read_text())["steps"]) == 2

    # A finished run is reused as it is: no model, no rollouts.
    again = train_on_target(env, None, None, settings, tmp_path, 10, snapshots=[3, 8, 10], **common)
    assert again == record and RolloutLedger(tmp_path / "ledger.json").rollouts() == 8

    # Killed after the budget was spent, before the record: the resumed run trains no further and keeps the
    # latest checkpoint's weights.
    (tmp_path / "adapter_record.json").unlink()
    fresh = copy.deepcopy(tiny_model)
    fresh.config.max_position_embeddings = 4096
    resumed = train_on_target(env, fresh, tokenizer, settings, tmp_path, 10, snapshots=[3, 8, 10], **common)
    assert resumed["rollouts"] == 8 and resumed["steps"] == 2
    assert resumed["adapter_sha256"] == record["adapter_sha256"]


def test_target_hints_name_the_lookups_not_the_values():
    from trace_core.envs.tau2_env import write_tools

    env = TargetEnv(FAMILIES, 1, STREAM, **ENV)
    for seed in range(4):
        inst = env.reset(seed)
        text = env.hint(inst)
        reads = [a.name for a in inst.reference_actions if a.name not in write_tools("retail")]
        assert text.startswith("Expert guidance") and all(r in text for r in reads)
        values = [str(v) for a in inst.reference_actions for v in a.arguments.values() if len(str(v)) >= 3]
        assert not any(v in text for v in values)
