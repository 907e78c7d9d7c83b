"""Policies and user-simulator completers built from the params: `make_policy` (the backend
`params.policy.backend` names), `make_user_completer` and `chat_completer` (plain-chat `complete(messages) -> str`
from either backend), `sampling_from_params`."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from typing import Any

from trace_core.agents.local import LocalPolicy
from trace_core.agents.openai_client import OpenAIPolicy
from trace_core.agents.policy import PolicyError, Sampling


def chat_completer(
    backend: LocalPolicy | OpenAIPolicy,
    *,
    temperature: float,
    max_new_tokens: int,
    seed: int,
) -> Callable[[list[dict]], str]:
    """A `complete(messages) -> str` function for an LLM user simulator, from either backend: plain chat (no
    tools), role/content dicts in, reply text out. A conversation too long for the model yields "" (the
    simulator then treats the user as silent). Each call samples with a seed derived from `seed` and the
    conversation it answers (scenario and turns so far), so a reply does not depend on which calls ran before it
    in the process (a resumed run replays the same user)."""

    def complete(messages: list[dict]) -> str:
        conv = [{"role": m["role"], "content": m.get("content") or ""} for m in messages]
        key = hashlib.sha256(json.dumps([seed, conv], sort_keys=True).encode()).digest()
        # top_p 1: the plain-chat users have no nucleus setting (params.user has none)
        sampling = Sampling(temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens,
                            seed=int.from_bytes(key[:6], "big"))
        text = backend.complete_texts([conv], sampling)[0]
        return text or ""

    return complete


def sampling_from_params(params: Any, seed: int | None = None) -> Sampling:
    p = params.policy
    return Sampling(
        temperature=p.temperature,
        top_p=p.top_p,
        max_new_tokens=p.max_new_tokens,
        seed=params.seed if seed is None else seed,
    )


def make_policy(params: Any, model: Any = None, tokenizer: Any = None) -> LocalPolicy | OpenAIPolicy:
    """The policy `params.policy.backend` names. local: `params.model` (provisioned and cached; or pass an
    already-loaded model + tokenizer). openai: `params.policy.base_url` (env TRACE_POLICY_BASE_URL overrides),
    key from the env var `params.policy.api_key_env`."""
    pc = params.policy
    if pc.backend == "local":
        if model is not None and tokenizer is not None:
            return LocalPolicy.from_model(
                model, tokenizer, batch_size=pc.batch_size, max_context=pc.max_context, threads=params.model.threads
            )
        from trace_core.agents.model import provision_model

        path = provision_model(params.model.path, params.model.cache_dir)
        return LocalPolicy(
            path,
            dtype=params.model.dtype,
            threads=params.model.threads,
            batch_size=pc.batch_size,
            max_context=pc.max_context,
        )
    if pc.backend == "openai":
        base_url = os.environ.get("TRACE_POLICY_BASE_URL") or pc.base_url
        if not base_url:
            raise PolicyError("policy.backend is openai but neither policy.base_url nor TRACE_POLICY_BASE_URL is set")
        if not pc.model:
            raise PolicyError("policy.backend is openai but policy.model (the served model name) is not set")
        return OpenAIPolicy(
            base_url,
            pc.model,
            api_key=os.environ.get(pc.api_key_env) if pc.api_key_env else None,
            concurrency=pc.concurrency,
            timeout_s=pc.timeout_s,
        )
    raise PolicyError(f"unknown policy.backend {pc.backend!r}")


def make_user_completer(params: Any, policy: Any = None) -> Callable[[list[dict]], str]:
    """The completer for `user.kind == "llm"`: `user.model == "local"` reuses the local policy's weights
    (pass `policy`, or the configured local model is loaded); otherwise an OpenAI-compatible endpoint at
    `user.base_url` (env TRACE_USER_BASE_URL overrides)."""
    uc = params.user
    if uc.model == "local":
        if not isinstance(policy, LocalPolicy):
            from trace_core.agents.model import provision_model

            path = provision_model(params.model.path, params.model.cache_dir)
            policy = LocalPolicy(path, dtype=params.model.dtype, threads=params.model.threads,
                                 batch_size=params.policy.batch_size, max_context=params.policy.max_context)
        return chat_completer(policy, temperature=uc.temperature, max_new_tokens=uc.max_new_tokens, seed=params.seed)
    base_url = os.environ.get("TRACE_USER_BASE_URL") or uc.base_url
    if not base_url or not uc.model:
        raise PolicyError("user.kind is llm: set user.model (or 'local') and user.base_url / TRACE_USER_BASE_URL")
    # One conversation per call (`chat_completer`), so one request in flight.
    backend = OpenAIPolicy(base_url, uc.model, api_key=os.environ.get(uc.api_key_env) if uc.api_key_env else None,
                           concurrency=1, timeout_s=uc.timeout_s)
    return chat_completer(backend, temperature=uc.temperature, max_new_tokens=uc.max_new_tokens, seed=params.seed)
