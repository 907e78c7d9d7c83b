"""Shared setup for the training tests: a real synthetic environment with a reward a random tiny model can vary,
a user who keeps the conversation going, tiny GRPO settings, and a trainable copy of the tiny model."""

from __future__ import annotations

import copy

import pytest

from trace_core.schemas import Message, RewardResult
from trace_core.synthesis.templates.tool_call_precision import ToolCallPrecision
from trace_core.training import GRPOSettings
from tests.defaults import PARAMS

TINY = {
    "lora_r": 4,
    "lora_alpha": 8,
    "lora_dropout": 0.0,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "lr": 1e-2,  # large, so that one step visibly moves a tiny adapter
    "max_grad_norm": 1.0,
    "max_steps": 1,
    "num_generations": 2,
    "groups_per_step": 2,
    "micro_batch_size": 2,
    "rollout_batch_size": 8,
    "temperature": 1.0,
    "max_new_tokens": 8,
    "epsilon": 0.2,
    "beta": 0.0,
    "hint_fraction": 0.0,
    "max_resample_rounds": 4,
    "balance_refusals": False,
    "select_every": 0,
    "select_episodes": 0,
    "checkpoint_every": 1,
    "gradient_checkpointing": False,
    "seed": 0,
    "group_scoring": True,
}


def tiny_settings(**overrides) -> GRPOSettings:
    return GRPOSettings(**{**TINY, **overrides})


class ParityEnv(ToolCallPrecision):
    """The real `tool_call_precision` environment (τ² retail tools and state, prefilled look-ups) at difficulty 0,
    scored by a reward a random tiny model varies: the parity of the sum of its first turn's token ids."""

    def __init__(self, capability_id=None, difficulty: int = 0, profile: str = PARAMS.env.profile, **kw):
        super().__init__(capability_id, difficulty, profile, **kw)

    def score(self, instance, messages, termination_reason):
        first = next((m.token_ids for m in messages if m.role == "assistant" and m.token_ids), None)
        return RewardResult(reward=float(sum(first) % 2) if first else 0.0)


class ChattyUser:
    """A user who answers every text turn and never ends the conversation: episodes run to `max_steps`, so a
    two-step episode has a user turn between two sampled turns."""

    def opening(self, instance):
        return Message(role="user", content=instance.opening or instance.user_goal)

    def respond(self, instance, messages):
        return Message(role="user", content="Please go on.")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    yield


@pytest.fixture(scope="session")
def parity_env():
    env = ParityEnv(difficulty=0)
    env.reset(0)
    _ = env.target  # load the τ² retail environment once
    return env


@pytest.fixture(scope="session")
def settings_factory():
    return tiny_settings


@pytest.fixture(scope="session")
def chatty_user():
    return ChattyUser


@pytest.fixture
def policy_model(tiny_model):
    """A private copy of the tiny model (PEFT wraps models in place) that fits the ~2,000-token τ² prompts the tiny
    tokenizer makes: Llama's rotary embedding has no fixed length, only the configured limit."""
    model = copy.deepcopy(tiny_model)
    model.config.max_position_embeddings = 4096
    return model
