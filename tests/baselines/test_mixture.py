"""One LoRA on a mixture of synthetic environments: `MixtureEnv` hands seeds round robin to its components (within
their training seeds), and every Environment call an episode makes goes to the component that made the instance —
so each template's reference solution still scores 1.0 through the mixture; a GRPO run on it stays in budget and
reports each component's share."""

from __future__ import annotations

import copy

import pytest

from trace_core.baselines.mixture import COMPONENT, COMPONENT_SEED, MixtureEnv, train_on_mixture
from trace_core.envs.base import Episode
from trace_core.envs.oracle import do_nothing, replay_reference
from trace_core.schemas import Message, ToolCall
from trace_core.synthesis.templates import make
from trace_core.training import GRPOSettings, RolloutLedger
from tests.defaults import default_limits, default_user

A, B = "tool_call_precision", "structured_data_reasoning"


@pytest.fixture(scope="module")
def components():
    return {A: make(A, difficulty=0), B: make(B, difficulty=1)}


@pytest.fixture(scope="module")
def mixture(components):
    return MixtureEnv(components, train_seeds={A: range(10), B: range(100, 103)})


def test_seeds_go_round_robin_to_each_components_training_seeds(mixture, components):
    assert [mixture.locate(s) for s in range(8)] == [
        (A, 0), (B, 100), (A, 1), (B, 101), (A, 2), (B, 102), (A, 3), (B, 100),  # B's 3 seeds cycle
    ]
    for s in range(6):
        cid, own = mixture.locate(s)
        inst = mixture.reset(s)
        mine = components[cid].reset(own)
        assert inst.meta[COMPONENT] == cid and inst.meta[COMPONENT_SEED] == own and inst.family == cid
        # The component's instance, untouched but for the tags.
        assert inst.model_copy(update={"meta": mine.meta}) == mine
        assert mixture.reset(s) == inst  # pure
        assert mixture.tool_schemas(inst) == components[cid].tool_schemas(mine)
        assert mixture.system_prompt(inst) == components[cid].system_prompt(mine)
        assert mixture.reference(inst) == components[cid].reference(mine)
    assert mixture.component_counts(range(8)) == {A: 4, B: 4}


def test_every_reference_solution_scores_one_through_the_mixture(mixture, components):
    for s in range(4):  # two instances of each component
        inst = mixture.reset(s)
        cid = inst.meta[COMPONENT]
        episode = replay_reference(mixture, inst)
        assert episode.env is components[cid]  # started by the component: its prefilled calls ran
        result = episode.score()
        assert result.reward == 1.0, (cid, result)
        assert mixture.score(inst, episode.messages, episode.termination_reason) == result
        assert do_nothing(mixture, inst).score().reward == 0.0


def test_state_and_tool_calls_are_routed_to_the_component(mixture, components):
    inst = mixture.reset(0)  # tool_call_precision: its look-ups name the order
    order_id = next(a.arguments["order_id"] for a in inst.reference_actions if "order_id" in a.arguments)
    call = ToolCall(id="c1", name="get_order_details", arguments={"order_id": order_id})
    ours = mixture._execute(mixture._new_state(inst), call)
    theirs = components[A]._execute(components[A]._new_state(inst), call)
    assert ours == theirs and not ours[1] and order_id in ours[0]
    # An episode built on the mixture itself (not via start) runs its tools through the routing too.
    episode = Episode(mixture, inst, default_user(), default_limits(max_steps=2))
    episode.step(Message(role="assistant", tool_calls=[call]))
    assert episode.messages[-1].content == ours[0]


def test_foreign_instances_and_mixed_domains_are_refused(mixture, components):
    with pytest.raises(ValueError, match="not made by this MixtureEnv"):
        mixture.score(components[A].reset(0), [], "agent_stop")
    with pytest.raises(ValueError, match="training seeds"):
        MixtureEnv(components, train_seeds={A: range(3)})
    airline = make(A, difficulty=0)
    airline.domain = "airline"
    with pytest.raises(ValueError, match="domains"):
        MixtureEnv({A: components[A], "other": airline})


@pytest.fixture
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: a second intra-op thread only waits (see tests/training/conftest)
    yield
    torch.set_num_threads(before)


def test_grpo_on_the_mixture_stays_in_budget(mixture, tiny_model, tokenizer, tmp_path, one_thread):
    model = copy.deepcopy(tiny_model)  # PEFT wraps models in place
    model.config.max_position_embeddings = 4096  # the τ² prompts are ~2,000 tiny-tokenizer tokens
    settings = GRPOSettings(
        lora_r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], lr=1e-2, max_grad_norm=1.0,
        max_steps=1, num_generations=2, groups_per_step=2, micro_batch_size=2, rollout_batch_size=8,
        temperature=1.0, max_new_tokens=6, epsilon=0.2, beta=0.0, hint_fraction=0.0, max_resample_rounds=2,
        balance_refusals=False, select_every=0, select_episodes=0,
        checkpoint_every=1, gradient_checkpointing=False, seed=0, group_scoring=True,
    )
    record = train_on_mixture(mixture, model, tokenizer, settings, tmp_path, 7, limits=default_limits(max_steps=1),
                              make_user=default_user, max_context=4096)
    # One step of 4 rollouts fits in 7; no refill round could (it might cost 4 more), nor a second step.
    assert record["rollouts"] == RolloutLedger(tmp_path / "ledger.json").rollouts("training", "mixture") == 4
    assert record["steps"] == 1 and record["budget_rollouts"] == 7
    assert record["component_rollouts"] == {A: 2, B: 2}
    assert sum(record["component_rollouts"].values()) == record["rollouts"]


def test_hints_come_from_the_component(mixture, components):
    for seed in (0, 1):
        inst = mixture.reset(seed)
        own = components[mixture.component_of(inst)]
        assert mixture.hint(inst) == own.hint(inst) and mixture.hint(inst).startswith("Expert guidance")
