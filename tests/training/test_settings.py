"""GRPOSettings: the params.yaml section loads, and every bad value fails early with the fix in the message."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trace_core.config import load_params
from trace_core.training import GRPOSettings

ROOT = Path(__file__).resolve().parents[2]


def test_params_yaml_training_section_loads():
    settings = GRPOSettings.from_params(load_params(ROOT / "params.yaml"))
    assert settings.beta == 0.0 and settings.lora_r == 16 and 0 < settings.temperature <= 1.0
    assert settings.rollouts_per_step % settings.micro_batch_size == 0
    assert settings.to_dict()["target_modules"] == settings.target_modules


def test_missing_training_key_names_it(tmp_path):
    text, n = re.subn(r"(?m)^  max_resample_rounds:.*\n", "", (ROOT / "params.yaml").read_text(), count=1)
    assert n == 1
    (tmp_path / "params.yaml").write_text(text)
    with pytest.raises(ValueError, match="training.max_resample_rounds"):
        load_params(tmp_path / "params.yaml")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"num_generations": 6, "groups_per_step": 1, "micro_batch_size": 4},
            "must divide the step's 6 rollouts.*use one of 1, 2, 3, 6",
        ),
        ({"num_generations": 1}, "num_generations\n.*greater than or equal to 2"),
        ({"temperature": 0.0}, "temperature\n.*greater than 0"),
        ({"hint_fraction": 0.1, "num_generations": 4}, "hints 0 of num_generations=4.*or 0"),
        ({"hint_fraction": 1.0}, "hint_fraction\n.*less than 1"),
        ({"epsilon": 0.0}, "epsilon\n.*greater than 0"),
        ({"beta": -0.1}, "beta\n.*greater than or equal to 0"),
        ({"checkpoint_every": 0}, "checkpoint_every\n.*greater than or equal to 1"),
        ({"target_modules": []}, "target_modules\n.*at least 1 item"),
        ({"lora_dropout": 1.0}, "lora_dropout\n.*less than 1"),
        ({"max_resample_rounds": -1}, "max_resample_rounds\n.*greater than or equal to 0"),
        ({"micro_batch_size": 0}, "micro_batch_size\n.*greater than or equal to 1"),
    ],
)
def test_bad_settings_say_how_to_fix(settings_factory, overrides, message):
    with pytest.raises(ValueError, match=message):
        settings_factory(**overrides)


def test_all_problems_are_listed(settings_factory):
    good = settings_factory()
    assert good.problems() == []
    assert good.hinted_per_group == 0
    assert settings_factory(hint_fraction=0.5, num_generations=4).hinted_per_group == 2


def test_training_section_is_the_grpo_settings_plus_the_stage_keys():
    """One list of fields: the params model of `training:` is GRPOSettings plus the stage's own keys, and no GRPO
    field has a default written in code (a key left out of params.yaml is an error, not a silent value)."""
    from dataclasses import MISSING, fields

    from trace_core.config import TrainingCfg

    assert issubclass(TrainingCfg, GRPOSettings)
    extra = {f.name for f in fields(TrainingCfg)} - {f.name for f in fields(GRPOSettings)}
    assert extra == {"eval_episodes", "keep_unlearned", "out_dir"}
    assert all(f.default is MISSING and f.default_factory is MISSING for f in fields(TrainingCfg))
    params = load_params(ROOT / "params.yaml")
    assert GRPOSettings.from_params(params).to_dict() == {
        k: v for k, v in vars(params.training).items() if k not in extra
    }


def test_bad_training_value_fails_when_params_load():
    with pytest.raises(ValueError, match="training.*epsilon=0.0 must be in"):
        load_params(ROOT / "params.yaml", {"training.epsilon": 0.0})
