"""params.yaml validation: every number has a range, unknown sections and families fail at load, and each error
names the dotted key and the allowed range (before any model is loaded)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import BaseModel

from trace_core.config import Params, load_params

ROOT = Path(__file__).resolve().parents[1]
PARAMS = ROOT / "params.yaml"


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("policy.batch_size", 0, ">= 1"),
        ("policy.batch_size", -4, ">= 1"),
        ("policy.max_new_tokens", -5, ">= 1"),
        ("policy.max_context", -1, ">= 1"),
        ("baseline.trials", 0, ">= 1"),
        ("env.max_steps", -1, ">= 1"),
        ("model.threads", -2, ">= 0"),
        ("policy.temperature", -1, ">= 0"),
        ("policy.top_p", 1.5, "in (0, 1]"),
        ("baseline.instances_per_family", -3, ">= 1"),
        ("tasks.difficulty", 9, "in [0, 3]"),
        ("bootstrap.difficulty", -1, "in [0, 3]"),
        ("analysis.rho", 1.5, "in [0, 1]"),
        ("analysis.llm.temperature", -0.5, ">= 0"),
        ("synthesis.calibration.hint_fraction", 1.0, "in [0, 1)"),
        ("training.lr", 0, "> 0"),
        ("training.num_generations", 1, ">= 2"),
        ("evaluation.gepa.minibatch", 0, ">= 1"),
        ("evaluation.router.top_p", 1.0, "in [0, 1)"),
        ("evaluation.merge_density", 0, "in (0, 1]"),
        ("seed", -1, ">= 0"),
    ],
)
def test_out_of_range_values_name_the_key_and_the_range(key, value, allowed):
    with pytest.raises(ValueError) as err:
        load_params(PARAMS, {key: value})
    assert f"{key}={value!r} must be {allowed}" in str(err.value)


def test_unknown_sections_keys_families_are_rejected(tmp_path):
    text = PARAMS.read_text() + "\npolcy:\n  batch_size: 4\n"
    (tmp_path / "params.yaml").write_text(text)
    with pytest.raises(ValueError, match="polcy: unknown key in params.yaml"):
        load_params(tmp_path / "params.yaml")
    with pytest.raises(ValueError, match="policy.batchsize: unknown key in section policy"):
        load_params(PARAMS, {"policy.batchsize": 4})
    with pytest.raises(ValueError, match=r"tasks.families=.*unknown procedural family nope; choose from compound"):
        load_params(PARAMS, {"tasks.families": ["single_write", "nope"]})
    with pytest.raises(ValueError, match="bootstrap.families=.*unknown procedural family"):
        load_params(PARAMS, {"bootstrap.families": ["Single_Write"]})
    with pytest.raises(ValueError, match="calibration.low=0.7 is above"):
        load_params(PARAMS, {"synthesis.calibration.low": 0.7})


def _numeric_fields(model, prefix=""):
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):  # a nested section
            yield from _numeric_fields(ann, f"{prefix}{name}.")
        elif ann in (int, float):
            yield f"{prefix}{name}", info


def test_every_numeric_field_has_a_range():
    fields = dict(_numeric_fields(Params))
    assert len(fields) > 90
    unbounded = [key for key, info in fields.items() if not info.metadata]
    assert unbounded == []


def test_difficulty_range_is_the_procedural_registrys():
    from trace_core.envs.procedural import MAX_DIFFICULTY

    load_params(PARAMS, {"tasks.difficulty": MAX_DIFFICULTY})
    with pytest.raises(ValueError, match=f"in \\[0, {MAX_DIFFICULTY}\\]"):
        load_params(PARAMS, {"tasks.difficulty": MAX_DIFFICULTY + 1})


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "trace_core.cli", "baseline", "-S", "policy.batch_size=0"],
        ["-m", "flows.pipeline", "--stage", "baseline", "-S", "policy.batch_size=0"],
    ],
)
def test_commands_fail_fast_on_a_bad_value(argv):
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv], check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - started
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "policy.batch_size=0 must be >= 1" in proc.stderr
    assert elapsed < 10  # the bound: no model load, no Prefect server before the check


@pytest.mark.parametrize("profile", sorted((ROOT / "profiles").glob("*.overrides")), ids=lambda p: p.stem)
def test_every_profile_loads_over_the_defaults(profile):
    """A profile is one `key=value` override per line (comments with #), applied as `-S` options: each key must
    exist in params.yaml, and the whole profile must pass the same checks as a run's parameters."""
    from trace_core.cli import parse_overrides  # what `-S` does with each line

    lines = [line.strip() for line in profile.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert lines, f"{profile} holds no override"
    overrides = parse_overrides(lines)
    params = load_params(PARAMS, overrides)
    for key, value in overrides.items():
        node = params
        for part in key.split("."):
            node = getattr(node, part)
        assert node == value, (key, node, value)


def test_the_study_trains_with_the_cpu_learn_settings():
    """profiles/study.overrides repeats cpu-learn's training and calibration lines (a profile is a flat list of -S
    options, it cannot include another): the study must train as the learning curves were measured."""

    def settings(name):
        lines = (ROOT / "profiles" / name).read_text().splitlines()
        return {line.strip() for line in lines if line.startswith(("training.", "synthesis."))}

    assert settings("cpu-learn.overrides") == settings("study.overrides")
