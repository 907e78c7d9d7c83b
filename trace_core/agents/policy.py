"""The policy interface shared by the backends: one method (`Policy.generate`), two implementations —
`trace_core.agents.local.LocalPolicy` (a transformers causal LM on this machine) and
`trace_core.agents.openai_client.OpenAIPolicy` (any OpenAI-compatible `/chat/completions` endpoint).

`generate(requests, sampling)` takes a list of (conversation so far incl. system, OpenAI tool schemas) and returns
one entry per request, in order: the assistant `Message`, or **None when the request's prompt does not fit the
context** (`max_context` for the local backend; a context-length error from the server for the OpenAI one). The
rollout engine ends such an episode with `termination_reason="context_overflow"`. Every other failure of the
backend raises `PolicyError` (the rollout engine records it as `policy_error`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from trace_core.schemas import Message

Request = tuple[list[Message], list[dict]]


class PolicyError(RuntimeError):
    """The policy backend cannot produce an answer (endpoint down, repeated server errors, bad configuration)."""


@dataclass
class Sampling:
    # Every setting is required (params.yaml's policy section is their one home: `sampling_from_params`).
    temperature: float  # 0 = greedy
    top_p: float  # 1 = no nucleus truncation
    max_new_tokens: int
    seed: int  # request i of a call samples with seed + i, unless `seeds` is given
    seeds: tuple[int, ...] | None = None  # one seed per request (the rollout engine's per-episode, per-turn seeds)

    def seed_for(self, i: int) -> int:
        """The sampling seed of request i of a call."""
        return int(self.seeds[i]) if self.seeds is not None else self.seed + i


@runtime_checkable
class Policy(Protocol):
    name: str

    def generate(self, requests: list[Request], sampling: Sampling) -> list[Message | None]: ...
