"""Library settings for tests, read from params.yaml (the one home of default values, issue #32): a test that does not
care about a setting takes it from here instead of writing the number again."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from trace_core.config import load_params

PARAMS = load_params(Path(__file__).resolve().parents[1] / "params.yaml")


def default_limits(**overrides):
    """params.env's EpisodeLimits, with `overrides` (e.g. max_steps=1)."""
    from trace_core.envs.settings import episode_limits

    return replace(episode_limits(PARAMS), **overrides)


def default_user(**overrides):
    """The scripted user of params.user, with `overrides` (e.g. max_turns=10)."""
    from trace_core.envs.users import ScriptedUser

    return ScriptedUser(**{"max_turns": PARAMS.user.max_turns, **overrides})


def default_sampling(**overrides):
    """params.policy's Sampling (`sampling_from_params`), with `overrides` (e.g. max_new_tokens=8)."""
    from trace_core.agents.factories import sampling_from_params

    return replace(sampling_from_params(PARAMS), **overrides)


def local_policy(model, tokenizer, **overrides):
    """`LocalPolicy.from_model` with params.policy's batch_size and max_context, and `overrides`."""
    from trace_core.agents.local import LocalPolicy

    kw = {"batch_size": PARAMS.policy.batch_size, "max_context": PARAMS.policy.max_context, **overrides}
    return LocalPolicy.from_model(model, tokenizer, **kw)


def openai_policy(base_url, model, **overrides):
    """`OpenAIPolicy` with params.policy's concurrency and timeout_s, and `overrides`."""
    from trace_core.agents.openai_client import OpenAIPolicy

    kw = {"concurrency": PARAMS.policy.concurrency, "timeout_s": PARAMS.policy.timeout_s, **overrides}
    return OpenAIPolicy(base_url, model, **kw)


def completer(backend, **overrides):
    """`chat_completer` with params.user's temperature and max_new_tokens and params.seed, and `overrides`."""
    from trace_core.agents.factories import chat_completer

    kw = {"temperature": PARAMS.user.temperature, "max_new_tokens": PARAMS.user.max_new_tokens,
          "seed": PARAMS.seed, **overrides}
    return chat_completer(backend, **kw)


def calibration_config(**overrides):
    """params.synthesis.calibration's CalibrationConfig, with `overrides` (e.g. seeds=4, samples=10)."""
    from trace_core.synthesis.calibration import CalibrationConfig

    c = PARAMS.synthesis.calibration
    names = ("seeds", "samples", "low", "high", "min_std", "max_all_success", "max_all_zero", "min_informative",
             "max_adjustments")
    return CalibrationConfig(**{**{n: getattr(c, n) for n in names}, **overrides})


def harness_config(**overrides):
    """The stage's HarnessConfig (params.synthesis.harness and the manifest sizes), with `overrides`; a unit test that
    checks one environment without manifests passes train_instances=0, eval_instances=0."""
    from trace_core.synthesis.stage import harness_config as from_params

    return replace(from_params(PARAMS), **overrides)
