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
