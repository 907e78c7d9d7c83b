"""A multi-turn episode as one GRPO sequence: the decoded sequence is the rendered conversation, the policy's
positions hold exactly the tokens it sampled (with their logprobs), everything else is masked."""

from __future__ import annotations

import pytest

from trace_core.agents.chat import render_conversation, render_prompt
from trace_core.agents.rollout import run_episodes
from trace_core.schemas import Message
from trace_core.training import episode_tokens
from trace_core.training.policy import TokenConsistentPolicy
from tests.defaults import PARAMS, default_limits, default_sampling, local_policy

POLICY = {"batch_size": PARAMS.policy.batch_size, "max_context": PARAMS.policy.max_context}


@pytest.fixture(scope="module")
def rollouts(parity_env, tiny_model, tokenizer, chatty_user):
    """Real two-turn episodes of the tiny model: prefilled look-up, sampled turn, user turn, sampled turn."""
    import copy

    model = copy.deepcopy(tiny_model)
    model.config.max_position_embeddings = 4096
    policy = local_policy(model, tokenizer, batch_size=8)
    instances = [parity_env.reset(s) for s in range(2)]
    trajectories = run_episodes(
        parity_env,
        instances,
        policy,
        chatty_user,
        default_sampling(temperature=1.0, max_new_tokens=8, seed=3),
        default_limits(max_steps=2),
        trials=2,
        batch_size=8,
        progress=False,
    )
    tools = {i.instance_id: parity_env.tool_schemas(i) for i in instances}
    return [(t, tools[t.instance_id]) for t in trajectories]


def _decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_round_trip_and_mask(rollouts, tokenizer):
    for traj, tools in rollouts:
        msgs = traj.messages
        sampled = [m for m in msgs if m.role == "assistant" and m.token_ids]
        assert len(sampled) == 2 and msgs[2].token_ids is None  # the prefilled look-up call was not sampled
        seq = episode_tokens(msgs, tokenizer, tools)

        # The decoded sequence is the conversation as the chat template renders it.
        assert _decode(tokenizer, seq.prompt_ids + seq.completion_ids) == render_conversation(tokenizer, msgs, tools)
        # The prompt is exactly what the model was given before its first turn (prefilled history included).
        first = next(i for i, m in enumerate(msgs) if m.token_ids)
        assert (
            seq.prompt_ids
            == tokenizer(render_prompt(tokenizer, msgs[:first], tools), add_special_tokens=False)["input_ids"]
        )
        # mask == 1 exactly on the sampled tokens, in order, with their sampled logprobs; 0.0 elsewhere.
        assert len(seq.completion_ids) == len(seq.env_mask) == len(seq.logprobs)
        on = [k for k, bit in enumerate(seq.env_mask) if bit]
        assert [seq.completion_ids[k] for k in on] == [t for m in sampled for t in m.token_ids]
        assert [seq.logprobs[k] for k in on] == [lp for m in sampled for lp in m.logprobs]
        assert all(seq.logprobs[k] == 0.0 for k, bit in enumerate(seq.env_mask) if not bit)
        # The sampled turns are contiguous runs separated by masked environment text (the user's reply).
        first_turn = len(sampled[0].token_ids)
        assert seq.env_mask[:first_turn] == [1] * first_turn and seq.env_mask[first_turn] == 0
        assert "Please go on." in _decode(tokenizer, [t for t, bit in zip(seq.completion_ids, seq.env_mask) if not bit])


def test_tail_and_system_prompt_override(rollouts, tokenizer):
    traj, tools = rollouts[0]
    full = episode_tokens(traj.messages, tokenizer, tools)
    short = episode_tokens(traj.messages, tokenizer, tools, include_tail=False)
    # Without the tail, the completion stops at the last sampled token (nothing after it carries loss).
    assert short.env_mask[-1] == 1 and short.completion_ids == full.completion_ids[: len(short.completion_ids)]
    assert sum(short.env_mask) == sum(full.env_mask)

    plain = episode_tokens(traj.messages, tokenizer, tools, system_prompt="Be brief.")
    text = _decode(tokenizer, plain.prompt_ids)
    assert text.startswith("<|im_start|>system\nBe brief.") and traj.messages[0].content not in text
    assert plain.completion_ids == full.completion_ids


def test_other_stop_token_stands_for_end_of_turn(tokenizer):
    """A turn that stopped with <|endoftext|> keeps that sampled token in place of the template's <|im_end|>."""
    hi = tokenizer("Cancel order", add_special_tokens=False)["input_ids"]
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    msgs = [
        Message(role="system", content="You help."),
        Message(role="user", content="Cancel please"),
        Message(
            role="assistant",
            content="Cancel order",
            raw="Cancel order",
            token_ids=hi + [eot],
            logprobs=[-1.0] * (len(hi) + 1),
        ),
        Message(role="user", content="Thanks"),
    ]
    seq = episode_tokens(msgs, tokenizer, None)
    rendered = render_conversation(tokenizer, msgs, None)
    expected = rendered.replace("Cancel order<|im_end|>", "Cancel order<|endoftext|>", 1)
    assert _decode(tokenizer, seq.prompt_ids + seq.completion_ids) == expected
    assert [t for t, bit in zip(seq.completion_ids, seq.env_mask) if bit] == hi + [eot]


def test_episode_without_sampled_tokens_and_bad_input(tokenizer):
    msgs = [Message(role="system", content="You help."), Message(role="user", content="Hi")]
    seq = episode_tokens(msgs, tokenizer, None)
    assert seq.completion_ids == [] and _decode(tokenizer, seq.prompt_ids) == render_prompt(tokenizer, msgs, None)

    lying = msgs + [Message(role="assistant", content="Thanks", raw="Thanks", token_ids=[5, 6], logprobs=[-1.0, -1.0])]
    with pytest.raises(ValueError, match="keep Message.raw"):
        episode_tokens(lying, tokenizer, None)
    uneven = msgs + [
        Message(
            role="assistant",
            raw="Cancel",
            token_ids=tokenizer("Cancel", add_special_tokens=False)["input_ids"],
            logprobs=[],
        )
    ]
    with pytest.raises(ValueError, match="record both when sampling"):
        episode_tokens(uneven, tokenizer, None)


def test_token_consistent_prompts_keep_the_sampled_ids(tokenizer, tiny_model):
    """A turn sampled as single characters stays single characters in the next turn's prompt (LocalPolicy would
    re-tokenize its text), so later turns are sampled in the context training will see."""
    chars = [tokenizer.convert_tokens_to_ids(c) for c in "Cancel"]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer("Cancel", add_special_tokens=False)["input_ids"] != chars  # the tokenizer would merge them
    msgs = [
        Message(role="system", content="You help."),
        Message(role="user", content="Hi"),
        Message(role="assistant", content="Cancel", raw="Cancel", token_ids=[*chars, end], logprobs=[-1.0] * 7),
        Message(role="user", content="Which order?"),
    ]
    ids = TokenConsistentPolicy.from_model(tiny_model, tokenizer, **POLICY).prompt_ids((msgs, None))
    text = render_prompt(tokenizer, msgs, None)
    assert _decode(tokenizer, ids) == text
    assert any(ids[k : k + 7] == [*chars, end] for k in range(len(ids)))
    assert ids != tokenizer(text, add_special_tokens=False)["input_ids"]

    first_turn = msgs[:2]
    assert (
        TokenConsistentPolicy.from_model(tiny_model, tokenizer, **POLICY).prompt_ids((first_turn, None))
        == tokenizer(render_prompt(tokenizer, first_turn, None), add_special_tokens=False)["input_ids"]
    )
