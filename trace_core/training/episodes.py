"""One multi-turn episode as the single token sequence GRPO trains on.

TRL's `rollout_func` contract (and our own loss) wants, per rollout: `prompt_ids` (what the model read before its
first sampled turn), `completion_ids` (everything after it, in rendering order), an `env_mask` over the completion
(1 on tokens the policy sampled, 0 on tool results, user turns and chat-template glue) and the sampled `logprobs`
aligned with the completion (0.0 where the mask is 0).

The sequence is assembled in text space from the rendered conversation: the chat template renders the whole
episode once, each sampled assistant turn is located in that text where its prompt (the conversation before it,
with the generation prompt) ends, the text between sampled turns is tokenized as environment tokens, and the
sampled turns contribute their recorded `token_ids` verbatim. So the policy's tokens are exactly the ones it
sampled (their logprobs stay meaningful), and the decoded sequence is exactly the rendered conversation.

Turns the policy did not sample (a synthetic environment's prefilled calls, an assistant message without
`token_ids`) are context: they belong to the prompt, or to the masked environment text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trace_core.agents.chat import END_OF_TURN, render_conversation, render_prompt
from trace_core.schemas import Message


@dataclass
class EpisodeTokens:
    prompt_ids: list[int]
    completion_ids: list[int]
    env_mask: list[int]  # 1 = sampled by the policy (carries loss), 0 = environment / template text
    logprobs: list[float]  # the sampled token's log-probability where env_mask is 1, else 0.0

    @property
    def policy_tokens(self) -> int:
        return sum(self.env_mask)


def _encode(tokenizer: Any, text: str) -> list[int]:
    # The same call LocalPolicy uses on its prompts, so the prompt ids are the ones the model was given.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _turn_end(tokenizer: Any, full: str, start: int, turn: list[int], index: int) -> int:
    """Where the sampled turn `turn`, rendered at `start`, ends in `full`."""
    text = tokenizer.decode(turn, skip_special_tokens=False)
    if full.startswith(text, start):
        return start + len(text)
    body = tokenizer.decode(turn[:-1], skip_special_tokens=False)
    if full.startswith(body, start) and full.startswith(END_OF_TURN, start + len(body)):
        return start + len(body) + len(END_OF_TURN)
    raise ValueError(
        f"message {index}: the rendered conversation does not contain the sampled text {text[:60]!r} where the turn "
        "starts; the turn must be rendered from its exact text (keep Message.raw, render with prefer_raw=True)"
    )


def episode_tokens(
    messages: list[Message],
    tokenizer: Any,
    tools: list[dict] | None,
    *,
    system_prompt: str | None = None,
    include_tail: bool = True,
    generation_prompt: bool = False,
) -> EpisodeTokens:
    """The training sequence of one episode.

    `tools` are the schemas the episode offered (they are part of the rendered system turn). `system_prompt`
    replaces the first message's text, e.g. to train a hinted rollout on the un-hinted prompt. A sampled turn that
    ended with a stop token other than the template's end-of-turn (e.g. <|endoftext|> where the template closes
    the turn with <|im_end|>) keeps its sampled token, which then stands for the template's. `include_tail=False`
    drops the environment text after the last sampled token: with causal attention it influences no
    log-probability that carries loss. `generation_prompt=True` renders the conversation so far with the generation
    prompt: prompt + completion is then the exact context for the policy's next turn (see `policy`).

    An episode without a sampled token (it ended before the policy spoke) has an empty completion."""
    if system_prompt is not None and messages and messages[0].role == "system":
        messages = [messages[0].model_copy(update={"content": system_prompt}), *messages[1:]]
    sampled = [i for i, m in enumerate(messages) if m.role == "assistant" and m.token_ids]
    if not sampled:
        return EpisodeTokens(_encode(tokenizer, render_prompt(tokenizer, messages, tools)), [], [], [])

    render = render_prompt if generation_prompt else render_conversation
    full = render(tokenizer, messages, tools)
    prompt_ids: list[int] | None = None
    ids: list[int] = []
    mask: list[int] = []
    logps: list[float] = []
    cursor = 0  # characters of `full` already turned into tokens
    for i in sampled:
        m = messages[i]
        before = render_prompt(tokenizer, messages[:i], tools)
        if not full.startswith(before):
            raise ValueError(
                f"message {i}: the chat template does not render the conversation before this assistant turn as a "
                "prefix of the whole conversation, so its sampled tokens cannot be placed; use a template that "
                "renders history unchanged (e.g. Qwen2.5's / SmolLM2's)"
            )
        glue = _encode(tokenizer, full[cursor : len(before)])
        if prompt_ids is None:
            prompt_ids = glue
        else:
            ids += glue
            mask += [0] * len(glue)
            logps += [0.0] * len(glue)

        turn = list(m.token_ids or [])
        turn_logps = list(m.logprobs or [])
        if len(turn_logps) != len(turn):
            raise ValueError(
                f"message {i} has {len(turn)} token_ids but {len(turn_logps)} logprobs; record both when sampling "
                "(LocalPolicy does)"
            )
        cursor = _turn_end(tokenizer, full, len(before), turn, i)
        ids += turn
        mask += [1] * len(turn)
        logps += [float(x) for x in turn_logps]

    if include_tail:
        tail = _encode(tokenizer, full[cursor:])
        ids += tail
        mask += [0] * len(tail)
        logps += [0.0] * len(tail)
    assert prompt_ids is not None
    return EpisodeTokens(prompt_ids, ids, mask, logps)
