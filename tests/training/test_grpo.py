"""Group advantages, the informative-group filter, and the DAPO-style refill, on the real environment with a fake
policy whose rewards are scripted per seed."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from trace_core.schemas import Message
from trace_core.training import RolloutLedger, collect_groups, group_advantages, informative
from trace_core.training.grpo import Group, is_informative, mixes_refusals
from tests.defaults import default_limits, default_user


def test_group_advantages_match_trl():
    from trl.trainer.utils import nanstd

    rewards = [1.0, 0.0, 0.5, 0.0]
    r = torch.tensor(rewards)
    expected = (r - r.mean()) / (nanstd(r) + 1e-4)  # TRL's scale_rewards="group" formula
    assert group_advantages(rewards) == pytest.approx(expected.tolist(), abs=1e-6)
    assert sum(group_advantages(rewards)) == pytest.approx(0.0, abs=1e-9)
    assert group_advantages([0.3, 0.3]) == [0.0, 0.0]
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages([1.0])


def test_informative_filter():
    assert is_informative([0.0, 1.0]) and not is_informative([0.6, 0.6, 0.6])

    def group(rewards):
        from types import SimpleNamespace

        return Group(0, None, "", [], [SimpleNamespace(reward=r) for r in rewards], [False] * len(rewards))

    groups = [group([0, 0]), group([0, 1]), group([1, 1]), group([0.2, 0.9])]
    assert informative(groups) == [groups[1], groups[3]]


class ScriptedRewards:
    """A fake policy on the parity environment: it answers with one plain-text token, odd (reward 1) or even
    (reward 0). Rollouts of a seed in `constant` all get reward 0; the others alternate 1, 0, 1, ..."""

    name = "scripted"

    def __init__(self, env, tokenizer, constant: set[int]):
        self.seed_of = {env.reset(s).opening: s for s in range(12)}
        self.constant = constant
        self.calls = itertools.count()
        self.system_prompts: list[str] = []
        self.tokenizer = tokenizer
        words = [i for i in range(3, len(tokenizer)) if tokenizer.decode([i]).strip().isalpha()]
        self.even = next(i for i in words if i % 2 == 0)
        self.odd = next(i for i in words if i % 2 == 1)

    def generate(self, requests, sampling):
        out = []
        for messages, _tools in requests:
            self.system_prompts.append(messages[0].content)
            seed = self.seed_of[messages[1].content]
            token = self.even if seed in self.constant or next(self.calls) % 2 else self.odd
            text = self.tokenizer.decode([token])
            out.append(Message(role="assistant", content=text, raw=text, token_ids=[token], logprobs=[-0.5]))
        return out


def _collect(env, settings, policy, ledger=None, seeds=None, **kw):
    return collect_groups(
        env,
        policy,
        iter(seeds if seeds is not None else range(12)),
        settings,
        make_user=default_user,
        limits=default_limits(max_steps=1),
        ledger=ledger,
        capability_id="tool_call_precision",
        **kw,
    )


def test_constant_groups_are_dropped_and_refilled(parity_env, settings_factory, tokenizer):
    # A rollout batch of one group, so that each refill runs only the groups still missing.
    settings = settings_factory(num_generations=4, groups_per_step=2, max_resample_rounds=3, rollout_batch_size=4)
    ledger = RolloutLedger()
    got = _collect(parity_env, settings, ScriptedRewards(parity_env, tokenizer, constant={0, 2}), ledger)
    # Round 1 draws seeds 0, 1 (0 is constant), round 2 draws 2 (constant), round 3 draws 3.
    assert [g.seed for g in got.groups] == [1, 3] and got.fillers == 0
    assert (got.rounds, got.dropped, got.rollouts) == (3, 2, 16)
    assert all(g.informative and len(g.trajectories) == 4 for g in got.groups)
    assert ledger.rollouts("training", "tool_call_precision") == 16  # every rollout, dropped ones included
    assert ledger.seeds("training", "tool_call_precision") == 4
    assert got.stats()["informative_groups"] == 2.0


def test_refill_rounds_run_out_and_fill_with_constant_groups(parity_env, settings_factory, tokenizer):
    settings = settings_factory(num_generations=2, groups_per_step=2, max_resample_rounds=1, rollout_batch_size=2)
    got = _collect(parity_env, settings, ScriptedRewards(parity_env, tokenizer, constant={0, 2, 3}))
    # Round 1: seeds 0 (constant), 1; round 2 (the only refill): seed 2, constant again -> it fills the batch.
    assert [g.seed for g in got.groups] == [1, 2] and got.fillers == 1 and got.num_informative == 1
    assert (got.rounds, got.dropped) == (2, 1)

    with pytest.raises(ValueError, match="itertools.cycle"):
        _collect(parity_env, settings, ScriptedRewards(parity_env, tokenizer, constant={0, 1}), seeds=[0, 1])


def test_a_round_runs_a_full_rollout_batch(parity_env, settings_factory, tokenizer):
    settings = settings_factory(num_generations=4, groups_per_step=1, max_resample_rounds=3, rollout_batch_size=8)
    got = _collect(parity_env, settings, ScriptedRewards(parity_env, tokenizer, constant={0, 2, 3}))
    # One group is needed, but the batch holds two: seeds 0 (constant) and 1 run together, 1 is kept.
    assert [g.seed for g in got.groups] == [1] and (got.rounds, got.rollouts, got.dropped) == (1, 8, 1)
    got = _collect(parity_env, settings, ScriptedRewards(parity_env, tokenizer, constant=set()))
    # Both informative: the step uses groups_per_step of them; the surplus is dropped and counted.
    assert [g.seed for g in got.groups] == [0] and (got.rounds, got.rollouts, got.dropped) == (1, 8, 1)
    # Refills fill the batch too: 0 and 1 constant, then 2 and 3 (2 constant) -> 3 is kept.
    got = _collect(parity_env, settings, ScriptedRewards(parity_env, tokenizer, constant={0, 1, 2}))
    assert [g.seed for g in got.groups] == [3] and (got.rounds, got.rollouts, got.dropped) == (2, 16, 3)
    # Rollout-budgeted runs (fill_batch=False) run only the groups still missing.
    got = _collect(parity_env, settings, ScriptedRewards(parity_env, tokenizer, constant={0, 2, 3}), fill_batch=False)
    assert [g.seed for g in got.groups] == [1] and (got.rounds, got.rollouts, got.dropped) == (2, 8, 1)


def test_hinted_rollouts(parity_env, settings_factory, tokenizer):

    settings = settings_factory(num_generations=4, groups_per_step=1, hint_fraction=0.5, rollout_batch_size=4)
    with pytest.raises(ValueError, match="no hint function"):
        _collect(parity_env, settings, ScriptedRewards(parity_env, tokenizer, constant=set()))

    policy = ScriptedRewards(parity_env, tokenizer, constant=set())
    got = _collect(
        parity_env, settings, policy, hint=lambda inst: f"HINT: the order is {inst.user_facts.get('order_id', '?')}"
    )
    group = got.groups[0]
    assert group.hinted == [False, False, True, True]
    assert [("HINT:" in t.messages[0].content) for t in group.trajectories] == group.hinted
    assert sum("HINT:" in p for p in policy.system_prompts) == 2
    assert len({t.trial for t in group.trajectories}) == 4

    # Training renders every rollout with the un-hinted prompt.
    rollouts = _rollouts(parity_env, tokenizer, settings)
    rows = rollouts.sequences(got)
    assert all(p == rows["prompt_ids"][0] for p in rows["prompt_ids"])
    assert "HINT:" not in tokenizer.decode(rows["prompt_ids"][0])
    assert rows["reward"] == group.rewards


def _rollouts(env, tokenizer, settings):
    """The training-side converter alone (no seeds to draw: the groups are given)."""
    from trace_core.training.trainer import EpisodeRollouts

    return EpisodeRollouts(
        env,
        tokenizer,
        settings,
        iter(()),
        ledger=RolloutLedger(),
        capability_id="x",
        make_user=default_user,
        limits=default_limits(max_steps=1),
        max_context=4096,
    )


def test_filler_groups_are_masked_out(parity_env, settings_factory, tokenizer):

    settings = settings_factory(num_generations=2, groups_per_step=2, max_resample_rounds=0, rollout_batch_size=4)
    got = _collect(parity_env, settings, ScriptedRewards(parity_env, tokenizer, constant={1}))
    assert got.fillers == 1
    rollouts = _rollouts(parity_env, tokenizer, settings)
    rows = rollouts.sequences(got)
    assert [sum(m) for m in rows["env_mask"]] == [1, 1, 0, 0]  # one sampled token per rollout; the filler masked
    assert all(
        len(c) == len(m) == len(lp) for c, m, lp in zip(rows["completion_ids"], rows["env_mask"], rows["logprobs"])
    )


class MarkRefusals:
    """The parity environment with the instances of the seeds in `refuse` marked must-refuse (rewards unchanged)."""

    def __init__(self, env, refuse):
        self.env, self.refuse = env, set(refuse)

    def reset(self, seed):
        return self.env.reset(seed).model_copy(update={"must_refuse": seed in self.refuse})

    def __getattr__(self, name):
        return getattr(self.env, name)


def test_balanced_steps_take_as_many_refusal_groups_as_action_groups(parity_env, settings_factory, tokenizer):
    settings = settings_factory(num_generations=2, groups_per_step=2, max_resample_rounds=3, rollout_batch_size=4,
                                balance_refusals=True)
    # Seeds 0-3 must be refused, 4 on must be acted on; every group varies.
    env = MarkRefusals(parity_env, refuse={0, 1, 2, 3})
    got = _collect(env, settings, ScriptedRewards(parity_env, tokenizer, constant=set()))
    # Rounds of two seeds: (0, 1) keeps 0, (2, 3) only refusals again, (4, 5) brings the action group 4.
    assert [g.seed for g in got.groups] == [0, 4] and got.fillers == 0
    assert (got.rounds, got.rollouts, got.dropped) == (3, 12, 4)
    assert got.stats()["informative_refusals"] == 1.0
    unbalanced = _collect(env, settings_factory(num_generations=2, groups_per_step=2, max_resample_rounds=3,
                                                rollout_batch_size=4),
                          ScriptedRewards(parity_env, tokenizer, constant=set()))
    assert [g.seed for g in unbalanced.groups] == [0, 1] and unbalanced.stats()["informative_refusals"] == 2.0


def test_a_step_without_both_kinds_trains_on_neither(parity_env, settings_factory, tokenizer):
    settings = settings_factory(num_generations=2, groups_per_step=2, max_resample_rounds=1, rollout_batch_size=4,
                                balance_refusals=True)
    # Even seeds must be refused and vary; odd seeds must be acted on and never vary.
    env = MarkRefusals(parity_env, refuse=range(0, 12, 2))
    got = _collect(env, settings, ScriptedRewards(parity_env, tokenizer, constant=set(range(1, 12, 2))))
    # Two rounds find refusal groups 0 and 2 and no varying action group: both fill the step without loss.
    assert got.num_informative == 0 and got.fillers == 2 and len(got.groups) == 2
    assert {g.seed for g in got.groups} <= {0, 1, 2, 3} and got.rounds == 2


def test_only_an_environment_with_both_kinds_mixes_refusals(parity_env):
    assert not mixes_refusals(parity_env, range(64))  # never must refuse
    assert not mixes_refusals(MarkRefusals(parity_env, refuse=range(64)), range(64))  # always must refuse
    assert mixes_refusals(MarkRefusals(parity_env, refuse={63}), range(64))
    assert not mixes_refusals(MarkRefusals(parity_env, refuse={63}), range(63))  # the seeds decide, not the env


def test_a_trainer_balances_only_where_both_kinds_occur(parity_env, policy_model, tokenizer, settings_factory,
                                                        tmp_path):
    from trace_core.training import build_trainer

    settings = settings_factory(num_generations=2, groups_per_step=2, balance_refusals=True)
    kw = dict(train_seeds=range(16), limits=default_limits(max_steps=1), make_user=default_user, max_context=4096)
    fresh = copy.deepcopy(policy_model)  # build_trainer wraps the model it gets in place
    _, plain = build_trainer(parity_env, policy_model, tokenizer, settings, tmp_path / "a", "x", **kw)
    # An environment of one kind would find one kind only at every step and train on nothing.
    assert plain.settings.balance_refusals is False
    mixed_env = MarkRefusals(parity_env, refuse={3})
    _, mixed = build_trainer(mixed_env, fresh, tokenizer, settings, tmp_path / "b", "x", **kw)
    assert mixed.settings.balance_refusals is True


def test_balance_needs_an_even_number_of_groups(settings_factory):
    with pytest.raises(ValueError, match="even groups_per_step"):
        settings_factory(groups_per_step=3, micro_batch_size=1, balance_refusals=True)
