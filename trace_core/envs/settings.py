"""The episode settings params.yaml gives every stage that plays episodes: the limits and the user simulator."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trace_core.config import Params
from trace_core.envs.base import EpisodeLimits


def episode_limits(params: Params) -> EpisodeLimits:
    """The EpisodeLimits of params.env (max_steps, max_errors)."""
    return EpisodeLimits(max_steps=params.env.max_steps, max_errors=params.env.max_errors)


def scripted_user_factory(params: Params) -> Callable[[], Any]:
    """A maker of the scripted user with params.user.max_turns: the user synthesis' calibration set the
    environments' difficulty against, so training and evaluation play against it too."""
    from trace_core.envs.users import ScriptedUser

    return lambda: ScriptedUser(max_turns=params.user.max_turns)
