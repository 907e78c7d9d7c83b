"""The equal-budget baselines on ToolSandbox (optional extra; skipped without it): grpo_target and gepa train on
the target's own training split (the scenarios of the baseline's half, `baseline.tau2_split`), never on an
evaluation instance or another augmentation of one, and play against ToolSandbox's scripted user."""

from __future__ import annotations

import pytest

pytest.importorskip("tool_sandbox", reason="ToolSandbox extra not installed (bash scripts/install.sh --toolsandbox)")

from trace_core.baselines import stage  # noqa: E402
from trace_core.baselines.target import SplitTargetEnv, TargetEnv, assert_disjoint, task_key  # noqa: E402
from trace_core.config import load_params  # noqa: E402
from tests.defaults import default_limits  # noqa: E402
from trace_core.envs.toolsandbox import ToolSandboxEnvironment, ToolSandboxUser, split_instances  # noqa: E402
from trace_core.inputs import held_out_instances  # noqa: E402

PROFILE = {"env.domain": "toolsandbox", "baseline.source": "toolsandbox", "evaluation.source": "toolsandbox",
           "baseline.tau2_split": "train", "evaluation.tau2_split": "test", "baseline.instances_per_family": 8,
           "evaluation.instances_per_family": 4}


def _params(**overrides):
    return load_params("params.yaml", {**PROFILE, **overrides})


@pytest.fixture(scope="module")
def params():
    return _params()


@pytest.fixture(scope="module")
def held_out(params):
    return held_out_instances(params)


@pytest.fixture(scope="module")
def target(params, held_out):
    return stage.target_training_env(params, held_out)


def test_training_tasks_are_the_baseline_half_and_disjoint_from_the_evaluation(params, held_out, target):
    assert isinstance(target, SplitTargetEnv) and not isinstance(target, TargetEnv)
    assert isinstance(target.env, ToolSandboxEnvironment) and target.domain == "toolsandbox"
    # The whole train half (every augmentation), none held out.
    train = split_instances("train", None, 0)
    assert sorted(i.instance_id for i in target.instances) == sorted(i.instance_id for i in train)
    assert target.excluded == 0
    # Disjoint from the evaluation instances, and from the whole evaluation half, by id, content and base scenario.
    test_half = split_instances("test", None, 0)
    for evaluated in (held_out, test_half):
        assert_disjoint(target.instances, evaluated)
        bases = {i.meta["base_scenario"] for i in evaluated}
        assert not bases & {i.meta["base_scenario"] for i in target.instances}
    # What GRPO draws (seeds cycle through the shuffled split) and GEPA's sets (seeds from 1 << 20).
    gepa = params.evaluation.gepa
    first = 1 << 20
    drawn = [target.reset(s) for s in range(64)]
    drawn += [target.reset(first + s) for s in range(gepa.train_instances + gepa.val_instances)]
    target.check_disjoint(range(64), test_half)
    assert_disjoint(drawn, held_out)
    assert len({i.family for i in drawn[:64]}) == 4  # the shuffle mixes the families
    # Pure in the seed and the stream: the same params give the same tasks.
    again = stage.target_training_env(params, held_out)
    assert [again.reset(s).instance_id for s in range(8)] == [i.instance_id for i in drawn[:8]]
    assert again.describe() == target.describe() and target.describe()["kind"] == "target_split"


def test_held_out_scenarios_and_their_variants_are_left_out_of_any_split(params, held_out):
    # A training split that holds the evaluation instances (`base` = both halves) loses them and every other
    # augmentation of their base scenarios.
    wide = stage.target_training_env(_params(**{"baseline.tau2_split": "base"}), held_out)
    held_bases = {i.meta["base_scenario"] for i in held_out}
    assert not held_bases & {i.meta["base_scenario"] for i in wide.instances}
    removed = [i for i in split_instances("base", None, 0) if i.meta["base_scenario"] in held_bases]
    assert wide.excluded == len(removed) > len(held_out)
    assert not {task_key(i) for i in held_out} & {task_key(i) for i in wide.instances}
    # Nothing left: an error naming the setting to change.
    everything = split_instances("train", None, 0)
    with pytest.raises(stage.BaselinesError, match="baseline.tau2_split"):
        stage.target_training_env(params, everything)


def test_grpo_target_trains_on_the_split_with_the_toolsandbox_user(params, held_out, monkeypatch, tmp_path):
    """Stage baselines used to refuse grpo_target and gepa for any domain but retail."""
    import trace_core.baselines.target as target_module

    seen = {}

    def fake_train(env, model, tokenizer, settings, folder, budget, **options):
        seen.update(env=env, budget=budget, options=options)
        return {"rollouts": budget}

    monkeypatch.setattr(target_module, "train_on_target", fake_train)
    warnings: list[str] = []
    agent = type("Agent", (), {"fingerprint": "tiny", "load": lambda self, dtype: None})()
    per_step = params.training.groups_per_step * params.training.num_generations
    result = stage._train("grpo_target", params, agent, tmp_path, per_step, [per_step], held_out, warnings, False)
    assert result == {"rollouts": per_step} and warnings == []
    env = seen["env"]
    assert isinstance(env, SplitTargetEnv) and env.describe()["split"] == "toolsandbox:train"
    user = seen["options"]["make_user"]()
    assert isinstance(user, ToolSandboxUser) and user.max_turns == params.user.max_turns
    env.check_disjoint(range(32), held_out)
    # An episode of a training task runs in the real ToolSandbox environment and is scored by its evaluator.
    inst = env.reset(0)
    episode = env.start(inst, user, default_limits(max_steps=2))
    assert episode.tools == env.env.tool_schemas(inst)
    from trace_core.schemas import Message

    episode.step(Message(role="assistant", content="Done. ###STOP###"))
    reward = episode.score()
    assert 0.0 <= reward.reward <= 1.0 and "similarity" in reward.info


def test_gepa_is_not_refused_on_toolsandbox(params, held_out, tmp_path):
    """Before: "gepa not run: its target training tasks are procedural"; now only the budget can stop it."""
    warnings: list[str] = []
    agent = type("Agent", (), {"fingerprint": "tiny"})()
    assert stage._evolve_prompt(params, agent, tmp_path, 1, held_out, warnings, False) is None
    assert len(warnings) == 1 and warnings[0].startswith("gepa not run: TRACE's budget of 1 rollouts")
