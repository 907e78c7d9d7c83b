"""Prompt evolution with GEPA on the tiny model: the adapter's evaluate (one real episode per instance, the
candidate as system prompt, cached per prompt and instance, refused beyond the budget), its reflective dataset,
and short `gepa.optimize` runs with a deterministic stub reflection model that find a better prompt, record the
history with the rollouts spent, and never exceed the budget."""

from __future__ import annotations

import copy
import json

import pytest

from trace_core.baselines.prompt_evolution import (
    BudgetExhausted,
    EpisodeCache,
    PromptAdapter,
    best_within,
    evolve_prompt,
)
from trace_core.baselines.target import TargetEnv
from trace_core.envs.procedural import generate_set
from trace_core.schemas import RewardResult, Trajectory
from tests.defaults import PARAMS, default_limits, default_sampling, default_user, local_policy

FAMILIES = ["single_write", "identify_then_act"]
LIMITS = default_limits(max_steps=1)
SAMPLING = default_sampling(temperature=0.0, max_new_tokens=6)
MARKER = "Always double-check identifiers."
# The settings the stage passes from params.yaml (tests/defaults.py)
ADAPTER_KW = {"make_user": default_user, "batch_size": PARAMS.policy.batch_size,
              "max_trajectory_chars": PARAMS.evaluation.gepa.max_trajectory_chars}
EVOLVE_KW = {**ADAPTER_KW, "sampling": SAMPLING, "seed": PARAMS.seed}
ENV = {"domain": PARAMS.env.domain, "profile": PARAMS.env.profile}  # the target environment of params.yaml


class MarkerTarget(TargetEnv):
    """The target scored by whether the system prompt holds MARKER (the tiny model's words cannot earn reward, so
    only the prompt GEPA evolves moves the score)."""

    def score(self, instance, messages, termination_reason):
        return RewardResult(reward=float(MARKER in (messages[0].content or "")))


@pytest.fixture(scope="module")
def policy(tiny_model, tokenizer):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: a second intra-op thread only waits (see tests/training/conftest)
    model = copy.deepcopy(tiny_model)
    model.config.max_position_embeddings = 4096  # the τ² prompts are ~2,000 tiny-tokenizer tokens
    yield local_policy(model, tokenizer, batch_size=8, max_context=4096, name="tiny")
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def env():
    return TargetEnv(FAMILIES, 1, 7000, **ENV)


def test_evaluate_plays_scores_and_caches_within_the_budget(env, policy, tmp_path):
    batch = [env.reset(s) for s in range(2)]
    adapter = PromptAdapter(env, policy, limits=LIMITS, budget_rollouts=5, sampling=SAMPLING,
                            cache=EpisodeCache(tmp_path / "episodes.jsonl"), **ADAPTER_KW)
    seed_prompt = env.system_prompt(batch[0])
    out = adapter.evaluate(batch, {"system_prompt": seed_prompt}, capture_traces=True)
    assert len(out.outputs) == len(out.scores) == len(out.trajectories) == 2 and adapter.spent == 2
    for inst, score, rollout, row in zip(batch, out.scores, out.trajectories, out.outputs):
        traj = rollout.trajectory
        assert rollout.instance is inst and traj.instance_id == inst.instance_id == row["instance_id"]
        assert traj.messages[0].role == "system" and traj.messages[0].content == seed_prompt
        assert score == traj.reward == 0.0  # the real τ² score: a random tiny model solves nothing
        assert traj.num_steps == 1  # LIMITS: one assistant turn

    # The same prompt on the same instances replays the cache: no rollouts, the same scores, no traces asked.
    again = adapter.evaluate(batch, {"system_prompt": seed_prompt})
    assert again.scores == out.scores and again.trajectories is None and adapter.spent == 2
    # Another prompt is new episodes; beyond the budget nothing runs.
    other = adapter.evaluate(batch, {"system_prompt": "Be brief."}, capture_traces=True)
    assert other.trajectories[0].trajectory.messages[0].content == "Be brief." and adapter.spent == 4
    with pytest.raises(BudgetExhausted, match="1 left"):
        adapter.evaluate(batch, {"system_prompt": "Be kind."})
    assert adapter.spent == 4
    # The cache survives a restart: a resumed run does not pay twice.
    reloaded = PromptAdapter(env, policy, limits=LIMITS, budget_rollouts=5, sampling=SAMPLING,
                             cache=EpisodeCache(tmp_path / "episodes.jsonl"), **ADAPTER_KW)
    assert reloaded.spent == 4 and reloaded.evaluate(batch, {"system_prompt": "Be brief."}).scores == other.scores

    data = adapter.make_reflective_dataset({"system_prompt": seed_prompt}, out, ["system_prompt"])
    assert list(data) == ["system_prompt"] and len(data["system_prompt"]) == 2
    for record, inst in zip(data["system_prompt"], batch):
        assert set(record) == {"Inputs", "Generated Outputs", "Feedback"}
        assert record["Inputs"]["Customer request"] == inst.opening
        assert record["Generated Outputs"].startswith(f"task {inst.instance_id} | outcome: FAILURE")
        assert "Not solved" in record["Feedback"]
        assert all(a.name in record["Feedback"] for a in inst.reference_actions)  # what a correct agent does
    json.dumps(data)  # GEPA passes the records verbatim into the reflection prompt


class StubReflection:
    """A deterministic reflection model: it always proposes the seed policy plus MARKER, and keeps the prompts it
    was shown."""

    def __init__(self, base: str):
        self.base = base
        self.prompts: list[str] = []

    def __call__(self, prompt: str) -> str:
        self.prompts.append(prompt)
        return f"Here is the improved instruction:\n```\n{self.base}\n{MARKER}\n```"


def _run(env, policy, out, budget, reflection, **kw):
    return evolve_prompt(
        env, policy, reflection, [env.reset(s) for s in range(2, 6)], [env.reset(s) for s in range(2)], out, budget,
        limits=LIMITS, minibatch_size=1, held_out=generate_set(FAMILIES, 5000, 2, 1), **{**EVOLVE_KW, **kw},
    )


def test_gepa_finds_the_better_prompt_and_records_the_history(policy, tmp_path):
    env = MarkerTarget(FAMILIES, 1, 7000, **ENV)
    seed_prompt = env.system_prompt()
    reflection = StubReflection(seed_prompt)
    result = _run(env, policy, tmp_path, 7, reflection)

    # Seed on 2 validation instances (2), a parent and a child minibatch of 1 (4), the child scored on the
    # validation set (6); one rollout left cannot pay for another child and validation pass.
    assert result["finished"] and result["stopped_by"] == "budget"
    assert result["rollouts"] == len(EpisodeCache(tmp_path / "episodes.jsonl")) == 6 and result["budget_rollouts"] == 7
    seed, child = result["candidates"]
    assert (seed["system_prompt"], seed["val_score"], seed["rollouts"], seed["gepa_idx"]) == (seed_prompt, 0.0, 2, 0)
    assert child["system_prompt"] == f"{seed_prompt}\n{MARKER}" and child["parents"] == [0]
    assert (child["val_score"], child["val_success"], child["rollouts"], child["rollouts_at_proposal"]) == (1.0, 1.0, 6, 4)
    assert result["best_prompt"] == child["system_prompt"] == (tmp_path / "best_prompt.txt").read_text()
    assert best_within(result, 5) == (seed_prompt, 2) and best_within(result, 6) == (child["system_prompt"], 6)
    assert best_within(result, 1) == (seed_prompt, 0)
    # The reflection model saw the seed prompt and GEPA's record of a failed episode.
    assert len(reflection.prompts) == 1 and seed_prompt in reflection.prompts[0] and "Not solved" in reflection.prompts[0]
    assert json.loads((tmp_path / "history.json").read_text()) == result

    # A finished run is reused: no reflection, no episodes.
    assert _run(env, policy, tmp_path, 7, reflection) == result and len(reflection.prompts) == 1


def test_an_evaluation_past_the_budget_ends_the_run_without_running_it(policy, tmp_path):
    env = MarkerTarget(FAMILIES, 1, 7000, **ENV)
    # 5 rollouts: the seed (2) and one iteration's minibatches (4) fit; the child's validation pass (2 more) does
    # not, so it is refused before any episode runs and the child never enters the history.
    result = _run(env, policy, tmp_path, 5, StubReflection(env.system_prompt()))
    assert result["stopped_by"] == "budget" and result["rollouts"] == 4
    assert [c["gepa_idx"] for c in result["candidates"]] == [0] and result["best_prompt"] == env.system_prompt()


def test_bad_inputs_fail_with_the_fix(env, policy, tmp_path):
    held = [env.reset(0)]
    with pytest.raises(ValueError, match="held-out"):
        evolve_prompt(env, policy, StubReflection(""), held, [env.reset(1)], tmp_path, 10, limits=LIMITS,
                      minibatch_size=PARAMS.evaluation.gepa.minibatch, held_out=held, **EVOLVE_KW)
    with pytest.raises(ValueError, match="raise the budget"):
        evolve_prompt(env, policy, StubReflection(""), [env.reset(0)], [env.reset(1), env.reset(2)], tmp_path, 4,
                      limits=LIMITS, minibatch_size=3, **EVOLVE_KW)


class Killed(BaseException):
    """A kill mid-run (not an Exception: GEPA's proposer would catch and skip that)."""


def test_a_killed_run_resumes_without_paying_twice(policy, tmp_path):
    env = MarkerTarget(FAMILIES, 1, 7000, **ENV)

    def dies(prompt: str) -> str:
        raise Killed

    with pytest.raises(Killed):  # after the seed's validation and the first parent minibatch
        _run(env, policy, tmp_path, 7, dies)
    history = json.loads((tmp_path / "history.json").read_text())
    assert not history["finished"] and [c["gepa_idx"] for c in history["candidates"]] == [0]
    assert len(EpisodeCache(tmp_path / "episodes.jsonl")) == 3

    # GEPA reloads its state and re-plays the seed's validation and the parent minibatch: both from the cache.
    result = _run(env, policy, tmp_path, 7, StubReflection(env.system_prompt()))
    assert result["finished"] and result["rollouts"] == 6
    assert [(c["gepa_idx"], c["rollouts"]) for c in result["candidates"]] == [(0, 2), (1, 6)]


def test_the_cache_cuts_a_torn_tail_so_the_next_episode_is_kept(env, tmp_path):
    path = tmp_path / "episodes.jsonl"
    a, b, c = (env.reset(s) for s in range(3))

    def episode(inst):
        return Trajectory(trajectory_id=f"t-{inst.instance_id}", instance_id=inst.instance_id, domain="retail",
                          family=inst.family, source="test", messages=[], termination_reason="agent_stop")

    EpisodeCache(path).add("prompt", [(a, episode(a)), (b, episode(b))])
    whole = path.read_bytes()
    path.write_bytes(whole[: whole.rfind(b"\n", 0, len(whole) - 1) + 1] + b'{"key": "torn')  # killed writing b
    cache = EpisodeCache(path)
    assert len(cache) == 1 and cache.get("prompt", a) is not None and cache.get("prompt", b) is None
    cache.add("prompt", [(c, episode(c))])
    again = EpisodeCache(path)
    assert len(again) == 2 and again.get("prompt", c) is not None  # without the cut, c would be glued to the tear
