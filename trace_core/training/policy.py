"""`TokenConsistentPolicy`: the local policy GRPO rolls out with, prompted with the very tokens training will see.

`LocalPolicy` prompts each turn with the conversation re-rendered as text and re-tokenized. A sampled turn's tokens
are not always the tokenizer's own encoding of their text (a model may sample "ab" as "a" + "b"), so from the
second turn on the model would have been conditioned on other tokens than the training sequence holds, and the
log-probabilities of later turns would be trained in a context they were not sampled in. Measured with the tiny
test model: first-turn log-probs matched TRL's recomputation to 1e-5, second-turn ones were off by up to 8 nats.

This policy builds each turn's prompt with `episode_tokens(..., generation_prompt=True)`: earlier sampled turns
keep their sampled ids and only the text between them is tokenized. The first turn's prompt is the same as
LocalPolicy's; generation itself (batching, prefix cache, seeded sampling, logprobs) is LocalPolicy's.
"""

from __future__ import annotations

from trace_core.agents.local import LocalPolicy
from trace_core.agents.policy import Request
from trace_core.training.episodes import episode_tokens


class TokenConsistentPolicy(LocalPolicy):
    def prompt_ids(self, request: Request) -> list[int]:
        """The exact token context of the next turn of this conversation."""
        messages, tools = request
        seq = episode_tokens(messages, self.tokenizer, tools, generation_prompt=True)
        return seq.prompt_ids + seq.completion_ids
